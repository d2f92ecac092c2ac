"""hcfjax.fp8 against a numpy rendering of DeepSeek-V3's fp8 inference (inference/kernel.py: act_quant, fp8_gemm,
weight_dequant), and DeepSeek's `quantization_config` block in ModelConfig."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from hcfjax import fp8
from hcfjax.config import ConfigError, ModelConfig
from hcfjax.random_model import PRESETS
from tests.conftest import jaxpr_eqns
from tests.test_checkpoint import quantize_fp8_blocks

E4M3 = ml_dtypes.float8_e4m3fn
V3_FP8_BLOCK = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def act_quant_np(x: np.ndarray, pow2: bool = False):
    """DeepSeek's act_quant per 128 channels: s = amax / 448, x / s cast to e4m3 (scale_fmt ue8m0: s rounded up to a
    power of two). A partial last group (not in DeepSeek's shapes) is quantised by itself. -> (q, s [M, K/128])."""
    m, k = x.shape
    groups = -(-k // 128)
    xp = np.zeros((m, groups * 128), np.float32)
    xp[:, :k] = x
    xg = xp.reshape(m, groups, 128)
    s = np.maximum(np.abs(xg).max(-1), 1e-12) / np.float32(448.0)
    if pow2:
        s = np.exp2(np.ceil(np.log2(s))).astype(np.float32)
    q = (xg / s[..., None]).astype(E4M3).reshape(m, groups * 128)[:, :k]
    return q, s


def expand(s: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """[R/128, C/128] block scales -> one per element [R, C]."""
    return np.repeat(np.repeat(s, 128, 0), 128, 1)[:rows, :cols]


def expand_groups(s: np.ndarray, cols: int) -> np.ndarray:
    """[M, C/128] activation scales -> one per element [M, C]."""
    return np.repeat(s, 128, 1)[:, :cols]


def fp8_gemm_np(x: np.ndarray, wq: np.ndarray, ws: np.ndarray, pow2: bool = False) -> np.ndarray:
    """DeepSeek's fp8 linear: quantise x, then the product of both operands dequantised with their scales (float64,
    so that only the fp8 rounding of x separates it from x @ W)."""
    q, s = act_quant_np(x, pow2)
    return (q.astype(np.float64) * expand_groups(s, x.shape[1])) @ (wq.astype(np.float64) * expand(ws, *wq.shape)).T


def random_fp8_weight(rng, n: int, k: int, lead=()):
    """An fp8 weight [*lead, N, K] with its block scales, quantised from N(0, 1/K) as DeepSeek quantises."""
    w = rng.normal(size=(*lead, n, k)).astype(np.float32) / np.sqrt(k)
    w = w * np.linspace(0.2, 3.0, k, dtype=np.float32)  # blocks of different scales
    parts = [quantize_fp8_blocks(wi) for wi in w.reshape(-1, n, k)]
    q = np.stack([p[0] for p in parts]).reshape(*lead, n, k)
    s = np.stack([p[1] for p in parts]).reshape(*lead, *parts[0][1].shape)
    return q, s


@pytest.mark.parametrize("m, n, k, pow2", [(5, 160, 256, False), (3, 384, 512, True), (4, 96, 200, False)])
def test_matmul_is_deepseeks_fp8_gemm(m, n, k, pow2):
    """Partial output blocks (N = 160, 96), several K blocks, ue8m0 scales, and a partial K block (200)."""
    rng = np.random.default_rng(m)
    wq, ws = random_fp8_weight(rng, n, k)
    x = (rng.normal(size=(m, k)) * rng.uniform(0.01, 10, size=(m, 1))).astype(np.float32)  # tokens of many scales
    w = fp8.Fp8Weight(jnp.asarray(wq), jnp.asarray(ws), "ue8m0" if pow2 else None)
    y = np.asarray(jnp.asarray(x) @ w, np.float64)  # Fp8Weight.__rmatmul__, as the model runs `x @ p["gate"]`
    want = fp8_gemm_np(x, wq, ws, pow2)
    wd = wq.astype(np.float64) * expand(ws, n, k)
    scale = np.abs(x) @ np.abs(wd).T  # the size of each output's terms
    np.testing.assert_array_less(np.abs(y - want), 1e-5 * scale + 1e-30)  # f32 accumulation
    # Against the unquantised activations: within e4m3 rounding of x (4 significant bits: at most 2^-4 of a normal
    # value, and half the subnormal step 2^-9 of its group's scale below 2^-6).
    _, s = act_quant_np(x, pow2)
    step = expand_groups(s, k) * 2.0**-10
    bound = (2.0**-4 * np.abs(x) + step) @ np.abs(wd).T
    exact = x.astype(np.float64) @ wd.T
    np.testing.assert_array_less(np.abs(y - exact), bound * (1 + 1e-5) + 1e-30)
    assert np.abs(y - exact).max() > 1e-3 * np.abs(exact).max()  # the activations were quantised


def test_quantize_act_matches_act_quant():
    rng = np.random.default_rng(1)
    x = (rng.normal(size=(6, 384)) * 3).astype(np.float32)
    x[2, 128:256] = 0.0  # an all-zero group quantises to zeros
    for pow2 in (False, True):
        q, s = fp8.quantize_act(jnp.asarray(x), "ue8m0" if pow2 else None)
        want_q, want_s = act_quant_np(x, pow2)
        np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want_q.view(np.uint8))
        np.testing.assert_allclose(np.asarray(s), want_s, rtol=1e-6)  # XLA may divide by a reciprocal
        assert np.all(np.asarray(q)[2, 128:256] == 0)


def test_ragged_dot_runs_each_expert_as_its_fp8_gemm():
    """Rows sorted by expert, an empty expert, and rows past the groups (which give 0), as moe.experts calls it."""
    rng = np.random.default_rng(2)
    e, n, k = 4, 160, 256
    wq, ws = random_fp8_weight(rng, n, k, lead=(e,))
    sizes = [3, 0, 5, 2]
    m = sum(sizes) + 2
    x = rng.normal(size=(m, k)).astype(np.float32)
    y = np.asarray(fp8.ragged_dot(jnp.asarray(x), fp8.Fp8Weight(jnp.asarray(wq), jnp.asarray(ws)), jnp.asarray(sizes)))
    start = 0
    for i, size in enumerate(sizes):
        rows = slice(start, start + size)
        np.testing.assert_allclose(y[rows], fp8_gemm_np(x[rows], wq[i], ws[i]), rtol=1e-5, atol=1e-5)
        start += size
    assert np.all(y[start:] == 0)


def test_the_dots_take_fp8_operands():
    """What XLA is given: e4m3 x e4m3 dots accumulating in f32 (so a GPU backend may run them on fp8 tensor cores),
    and no dot of upcast operands."""
    x = jnp.ones((2, 256), jnp.bfloat16)
    cases = (
        (fp8.matmul, (x, fp8.quantize(jnp.ones((256, 64))))),
        (fp8.ragged_dot, (x, fp8.quantize(jnp.ones((3, 256, 64))), jnp.array([1, 0, 1]))),
    )
    for fn, args in cases:
        dots = [e for e, _ in jaxpr_eqns(jax.make_jaxpr(fn)(*args).jaxpr) if "dot" in e.primitive.name]
        assert dots
        for e in dots:
            assert [v.aval.dtype for v in e.invars[:2]] == [jnp.float8_e4m3fn] * 2, e
            assert e.params["preferred_element_type"] == jnp.float32, e


def test_quantize_dequantize_round_trip():
    """fp8.quantize is DeepSeek's block quantisation (the numpy one of test_checkpoint) in the params' [K, N] view."""
    rng = np.random.default_rng(3)
    w = rng.normal(size=(2, 200, 160)).astype(np.float32)  # [L, K, N], partial blocks both ways
    qw = fp8.quantize(jnp.asarray(w))
    assert qw.shape == w.shape and qw.q.dtype == jnp.float8_e4m3fn and qw.scale_inv.shape == (2, 2, 2)
    for i in range(2):
        q, s = quantize_fp8_blocks(w[i].T)
        np.testing.assert_allclose(np.asarray(qw.scale_inv[i]), s, rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(qw.q[i]).astype(np.float32), q.astype(np.float32))
    step = np.stack([expand(np.asarray(qw.scale_inv[i]), 160, 200).T for i in range(2)]) * 2.0**-10  # subnormals
    np.testing.assert_array_less(np.abs(np.asarray(fp8.dequantize(qw)) - w), 2.0**-4 * np.abs(w) + step)


def test_v3_quantization_config_is_read():
    cfg = ModelConfig.from_dict({**PRESETS["deepseek-v3"], "quantization_config": V3_FP8_BLOCK})
    q = cfg.quantization
    assert (q.scheme, q.experts, q.linear, q.kv_cache_dtype) == ("fp8", "fp8", "fp8", None)
    assert (q.fp8.fmt, q.fp8.activation_scheme, q.fp8.weight_block_size, q.fp8.scale_fmt) == (
        "e4m3",
        "dynamic",
        (128, 128),
        None,
    )
    assert cfg.to_dict()["quantization_config"] == V3_FP8_BLOCK  # written back as DeepSeek writes it
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    v31 = ModelConfig.from_dict(
        {**PRESETS["deepseek-v3"], "quantization_config": {**V3_FP8_BLOCK, "scale_fmt": "ue8m0"}}
    )
    assert v31.quantization.fp8.scale_fmt == "ue8m0"


@pytest.mark.parametrize(
    "key, value",
    [("fmt", "e5m2"), ("activation_scheme", "static"), ("weight_block_size", [64, 64]), ("scale_fmt", "e8m0")],
)
def test_unsupported_fp8_formats_are_named(key, value):
    with pytest.raises(ConfigError, match=rf"quantization_config\.{key}=.* is not supported"):
        ModelConfig.from_dict({**PRESETS["deepseek-v3"], "quantization_config": {**V3_FP8_BLOCK, key: value}})
