"""The fp8 block-scaled kernel (pallas_kernels/moe_fp8.py) against a numpy rendering of DeepSeek's fp8_gemm
(tests/test_fp8.py), run by Mosaic GPU's interpreter on the CPU, and lowered for Hopper."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hcfjax import fp8
from hcfjax.options import Options
from pallas_kernels import moe_fp8
from pallas_kernels.moe_fp8 import Fp8Tiling, default_tiling, fp8_gated_ragged_dot, fp8_ragged_dot
from tests.test_fp8 import act_quant_np, expand, expand_groups, fp8_gemm_np, random_fp8_weight

INTERPRET = Options(moe="interpret")


def _silu(v):
    return v / (1.0 + np.exp(-v))


def _close(y, want):
    """bf16 output: within a few of its roundings of the largest value."""
    np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=0, atol=4e-3 * np.abs(want).max())


@pytest.mark.usefixtures("reset_interpreter")
@pytest.mark.parametrize("tiling", [None, Fp8Tiling(32, 128, 2), Fp8Tiling(16, 64, 2, splits=3)])
def test_kernel_runs_each_expert_as_deepseeks_fp8_gemm(tiling):
    """Empty expert, groups not multiples of the token block, rows past the groups (zeros), more K blocks than
    pipeline stages, blocks of different scales, split-K; the one-weight and the gated (silu(gate) * up) kernels."""
    rng = np.random.default_rng(3)
    e, n, k = 3, 128, 384
    (gq, gs), (uq, us) = (random_fp8_weight(rng, n, k, lead=(e,)) for _ in range(2))
    sizes = [5, 0, 19]
    m = sum(sizes) + 3
    x = rng.normal(size=(m, k)).astype(np.float32)
    xq, xs = act_quant_np(x)
    args = (jnp.asarray(xq), jnp.asarray(xs.T))
    gsz = jnp.asarray(sizes, jnp.int32)
    y = fp8_ragged_dot(*args, jnp.asarray(gq), jnp.asarray(gs), gsz, interpret=True, tiling=tiling)
    h = fp8_gated_ragged_dot(*args, (gq, gs), (uq, us), gsz, interpret=True, tiling=tiling)
    want_y, want_h, start = np.zeros((m, n)), np.zeros((m, n)), 0
    for i, size in enumerate(sizes):
        rows = slice(start, start + size)
        want_y[rows] = fp8_gemm_np(x[rows], gq[i], gs[i])
        want_h[rows] = _silu(want_y[rows]) * fp8_gemm_np(x[rows], uq[i], us[i])
        start += size
    _close(y, want_y)
    _close(h, want_h)
    assert np.all(np.asarray(y[start:]) == 0) and np.all(np.asarray(h[start:]) == 0)


@pytest.mark.usefixtures("reset_interpreter")
def test_model_layers_take_the_kernel_where_options_say(monkeypatch):
    """hcfjax.fp8's matmul (a dense linear: one expert), gated_matmul and ragged_dot run the kernel (interpreted)
    where the options say, and give DeepSeek's fp8_gemm of the tokens as hcfjax.fp8 quantises them (XLA's division
    rounds a few values to the other e4m3 neighbour than numpy's); N not a multiple of 128 (64-row tiles within a
    scale block)."""
    rng = np.random.default_rng(4)
    k, n = 256, 192
    ws = [random_fp8_weight(rng, n, k) for _ in range(3)]
    w, g, u = (fp8.Fp8Weight(*map(jnp.asarray, pair)) for pair in ws)
    x = jnp.asarray(rng.normal(size=(2, 5, k)), jnp.bfloat16)
    xq, xs = (np.asarray(a, np.float64) for a in fp8.quantize_act(x.reshape(10, k)))
    x64 = xq * expand_groups(xs, k)  # the quantised tokens

    def truth(wq, ws):
        return x64 @ (wq.astype(np.float64) * expand(ws, *wq.shape)).T

    calls = []
    run = moe_fp8._run
    monkeypatch.setattr(
        moe_fp8, "_run", lambda xq, xs, weights, *a: calls.append(len(weights)) or run(xq, xs, weights, *a)
    )
    _close(fp8.matmul(x, w, INTERPRET).reshape(10, n), truth(*ws[0]))
    _close(fp8.gated_matmul(x, g, u, INTERPRET).reshape(10, n), _silu(truth(*ws[1])) * truth(*ws[2]))
    eq, es = random_fp8_weight(rng, n, k, lead=(2,))
    we = fp8.Fp8Weight(jnp.asarray(eq), jnp.asarray(es))
    ye = fp8.ragged_dot(x.reshape(10, k), we, jnp.asarray([4, 5], jnp.int32), INTERPRET)
    _close(ye[:4], truth(eq[0], es[0])[:4])
    _close(ye[4:9], truth(eq[1], es[1])[4:9])
    assert np.all(np.asarray(ye[9:]) == 0)
    assert calls == [1, 2, 1]  # each on the kernel, the gated form fused


def test_tiling_and_errors():
    """Token blocks follow the rows per expert (16 for decode's few, up to 128 / 64 gated); K splits where the
    output tiles are few (V3's q_a and kv_a in decode), none where they fill the SMs; bad operands are rejected
    with the reason."""
    assert default_tiling(384, 64, 2, 1408, 2048) == Fp8Tiling(16)
    assert default_tiling(4096, 1, 1, 1536, 7168).bm == 128 and default_tiling(4096, 1, 2, 1536, 7168).bm == 64
    assert default_tiling(64, 1, 1, 1536, 7168).splits == 4  # 24 tiles, 56 K blocks: 14 a split
    assert default_tiling(64, 1, 1, 576, 7168).splits == 4  # 9 tiles; 8 splits would leave 7 K blocks each
    assert default_tiling(64, 1, 1, 7168, 16384).splits == 2  # o_proj: 112 tiles
    assert default_tiling(2048, 256, 2, 2048, 7168).splits == 1
    q = jnp.zeros((1, 128, 256), jnp.float8_e4m3fn)
    s = jnp.ones((1, 1, 2), jnp.float32)
    xq, xs, one = jnp.zeros((4, 256), jnp.float8_e4m3fn), jnp.ones((2, 4), jnp.float32), jnp.array([4], jnp.int32)
    with pytest.raises(ValueError, match="xq must be float8"):
        fp8_ragged_dot(xq.astype(jnp.bfloat16), xs, q, s, one, interpret=True)
    with pytest.raises(ValueError, match="s must be f32"):
        fp8_ragged_dot(xq, xs, q, jnp.ones((1, 2, 2)), one, interpret=True)
    with pytest.raises(ValueError, match="N \\(=96\\)"):
        fp8_ragged_dot(xq, xs, q[:, :96], s, one, interpret=True)


@pytest.mark.parametrize("gated", [False, True])
def test_lowers_for_hopper_at_deepseek_v3_shapes(gated):
    """Mosaic GPU lowers the kernels for sm_90 (layouts, shared memory) at V3's expert shapes in decode (256
    experts, 8 routed rows each), a dense prefill linear and a dense decode one (split-K)."""
    from pallas_kernels.cross_lower import lower_for_hopper

    sd = jax.ShapeDtypeStruct
    for m, e, k, n in [(2048, 256, 7168, 2048), (4096, 1, 7168, 1536), (64, 1, 7168, 1536)]:  # the last split-K
        xq, xs = sd((m, k), jnp.float8_e4m3fn), sd((k // 128, m), jnp.float32)
        q, s, gs = sd((e, n, k), jnp.float8_e4m3fn), sd((e, n // 128, k // 128), jnp.float32), sd((e,), jnp.int32)
        if gated:
            fn = lambda xq, xs, q, s, gs: fp8_gated_ragged_dot(xq, xs, (q, s), (q, s), gs)  # noqa: E731
        else:
            fn = fp8_ragged_dot
        assert "moe_fp8" in lower_for_hopper(fn, xq, xs, q, s, gs)


@pytest.mark.usefixtures("reset_interpreter")
def test_fp8_model_on_the_kernel_matches_its_reference_path(monkeypatch):
    """A one-layer fp8 MoE model (tiny-v3 widened to whole 128-channel blocks) through the model's own forward: with
    the kernel (interpreted) every fp8 linear runs on it (q_a, q_b, kv_a, o, the shared MLP, the experts), and the
    hidden states match the XLA path's as closely as the XLA path matches itself under bf16-sized noise."""
    from hcfjax.model import hidden_states
    from hcfjax.quantize import quantize_model
    from hcfjax.random_model import preset_config, random_model

    wide = dict(num_hidden_layers=1, first_k_dense_replace=0, q_lora_rank=128, kv_lora_rank=128, qk_rope_head_dim=64)
    wide.update(moe_intermediate_size=128, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1)
    model = quantize_model(random_model(preset_config("tiny-v3", **wide), dtype=jnp.float32), "fp8")
    tokens = jnp.asarray([[5, 9, 200, 31, 7, 64]], jnp.int32)
    positions = jnp.arange(6, dtype=jnp.int32)[None]
    calls = []

    def counted(fn):  # records each call's weight shape (the gated form's third argument is gate's (q, s))
        def call(xq, xs, w, *args, **kw):
            calls.append(w.shape if hasattr(w, "shape") else w[0].shape)
            return fn(xq, xs, w, *args, **kw)

        return call

    for name in ("fp8_ragged_dot", "fp8_gated_ragged_dot"):  # (hcfjax.fp8 imports them at each call)
        monkeypatch.setattr(moe_fp8, name, counted(getattr(moe_fp8, name)))
    ref = np.asarray(hidden_states(model.params, model.cfg, tokens, positions, opts=Options(moe="reference"))[0])
    got = np.asarray(hidden_states(model.params, model.cfg, tokens, positions, opts=INTERPRET)[0])
    # per layer q_a, q_b, kv_a, o; the dense MLP's gate/up (fused) and down; the shared MLP's and the experts' too
    assert len(calls) == 4 + 2 + 2
    assert calls.count((4, 128, 128)) == 2 and (1, 192, 128) in calls  # the experts; kv_a
    # The kernel rounds each product to bf16 (one linear: 0.17% from the XLA path), and the next linear's e4m3
    # activations then round some values to the other neighbour (a step of 1/16; q_a then q_b: 1.4%), which can move
    # the router's choice: the yardstick is the reference path with its embeddings perturbed by bf16's rounding.
    embed = model.params["embed"]
    noisy = dict(model.params, embed=embed * (1 + 2.0**-9 * jax.random.normal(jax.random.key(1), embed.shape)))
    floor = _rel(hidden_states(noisy, model.cfg, tokens, positions, opts=Options(moe="reference"))[0], ref)
    assert floor < 0.15  # (about 6% here: the yardstick itself cannot grow to let anything pass)
    assert _rel(got, ref) < 1.5 * floor, (_rel(got, ref), floor)


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))
