"""Quantised weights (hcfjax/quant.py): packing, quantisation error, the pure-jnp references of the quantised
products, the quantisation config, and the MoE experts over quantised weights (which path runs, what it is given)."""

from __future__ import annotations

import functools
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hcfjax
from hcfjax import moe, quant
from hcfjax.cache import quantize_int8
from hcfjax.config import ConfigError, ModelConfig, QuantConfig
from tests.conftest import jit_as_eager, rel_err


def test_int4_pack_round_trip():
    # each one program, as the model runs them (not one per operation)
    pack, unpack = jax.jit(quant.pack_int4, static_argnums=1), jax.jit(quant.unpack_int4, static_argnums=1)
    q = jnp.array(np.random.default_rng(0).integers(-8, 8, (3, 5, 64)), jnp.int8)
    packed = pack(q, 32)
    assert packed.dtype == jnp.uint8 and packed.shape == (3, 5, 32)
    np.testing.assert_array_equal(unpack(packed, 32), q)
    # The documented layout: per group, byte j holds k = j (low nibble) and k = j + G/2 (high nibble).
    assert int(pack(jnp.array([[-1, 5, 3, 2]], jnp.int8), 4)[0, 0]) == 0x3F


@pytest.mark.parametrize("bits, k, n", [(4, 256, 96), (4, 48, 40), (8, 256, 96), (8, 48, 40)])
def test_quantize_round_trip_error_bound(bits, k, n):
    # drawn and checked in numpy: the jitted quantize and dequantize are the only programs compiled
    rng = np.random.default_rng(bits + k)
    w = rng.standard_normal((2, k, n), np.float32) * np.linspace(0.1, 3.0, n, dtype=np.float32)
    qw = quant.quantize(jnp.asarray(w), bits)
    assert qw.shape == w.shape and qw.k == k and qw.n == n
    assert qw.group == (min(quant.GROUP, k) if bits == 4 else k)
    assert qw.scale.shape == (2, k // qw.group, n)  # K-group-major, like W
    err = np.abs(np.asarray(quant.dequantize(qw)) - w)  # [2, K, N]
    half_step = np.repeat(np.asarray(qw.scale), qw.group, axis=-2) / 2  # [2, K, N]
    assert bool(np.all(err <= half_step * (1 + 1e-5)))
    rel = float(np.linalg.norm(err) / np.linalg.norm(w))
    assert rel < (0.12 if bits == 4 else 0.01), rel
    again = quant.quantize(quant.dequantize(qw), bits)  # quantising a dequantised weight gives it back
    np.testing.assert_allclose(quant.dequantize(again), quant.dequantize(qw), rtol=1e-5, atol=1e-6)


GROUPS = [
    (256, 96, [7, 0, 33, 0]),  # empty groups, sizes not multiples of any block
    (128, 64, [0, 0, 0, 40]),
    (48, 40, [1, 17, 2, 9]),  # K below the group size: one group of 48
    (384, 128, [5, 60, 0, 3]),  # rows past sum(group_sizes) (M = 80) must come out 0
]


@pytest.mark.parametrize("bits, act", [(4, "bf16"), (4, "int8"), (8, "int8")])
@pytest.mark.parametrize("k, n, sizes", GROUPS)
def test_reference_ragged_dot(k, n, sizes, bits, act):
    e, m = len(sizes), max(sum(sizes), 80)
    rng = np.random.default_rng(k * n)
    w = jnp.asarray(rng.standard_normal((e, k, n), np.float32) / np.float32(np.sqrt(k)))
    x = jnp.asarray(rng.standard_normal((m, k), np.float32).astype(jnp.bfloat16))
    gs = jnp.array(sizes, jnp.int32)
    qw = quant.quantize(w, bits, act)
    y = np.asarray(jax.jit(quant.ragged_dot_reference)(x, qw, gs), np.float32)
    assert y.shape == (m, n) and not y[sum(sizes) :].any()

    @jit_as_eager  # both references one program
    def references(x, w, qw, gs):
        # Exactly the quantised function: dequantised weights (and activations) through a float32 ragged_dot.
        xe = x.astype(jnp.float32)
        if act == "int8":
            xq, xs = quant.quantize_int8(x)
            xe = xq.astype(jnp.float32) * xs[:, None]
        exact = jax.lax.ragged_dot(xe, quant.dequantize(qw), gs, precision="highest")
        # And the unquantised product.
        return exact, jax.lax.ragged_dot(x.astype(jnp.float32), w, gs, precision="highest")

    exact, full = map(np.asarray, references(x, w, qw, gs))
    np.testing.assert_allclose(y, exact, atol=0.02 * float(np.abs(exact).max()), rtol=0.02)
    # And close to the unquantised product.
    rel = float(np.linalg.norm(y - full) / np.linalg.norm(full))
    assert rel < (0.15 if bits == 4 else 0.03), rel


@pytest.mark.parametrize("bits, k", [(4, 512), (8, 2048)])
def test_int8_activation_reference_is_exact(bits, k):
    """With unit scales (integer weights and tokens whose maxima are qmax and 127) the w4a8 / w8a8 reference must
    return the integer products themselves: the per-group dot products are exact (w8a8 with G = K = 2048 sums
    past 2^24, so a single f32 accumulation would round; the reference adds exact chunks in int32)."""
    rng = np.random.default_rng(bits)
    e, m, n, qmax = 3, 40, 64, 7 if bits == 4 else 127
    lo = -qmax if bits == 4 else 90  # w8a8: large positive weights, so the sums pass 2^24
    w = rng.integers(lo, qmax + 1, (e, k, n)).astype(np.float32)
    w[:, :: quant.group_size(k, bits)] = qmax  # every (group, output) has a +qmax entry: its scale is exactly 1
    x = rng.integers(90, 128, (m, k)).astype(np.float32)  # mostly large, one sign: large sums
    x[:, 0] = 127  # token scale 1
    gs = jnp.array([11, 0, 25], jnp.int32)  # rows 36.. are past the groups
    qw = quant.quantize(jnp.asarray(w), bits, "int8")
    ints = np.asarray(jax.jit(quant.int_values)(qw))
    assert bool(np.all(np.asarray(qw.scale) == 1)) and bool(np.all(ints == np.swapaxes(w, -1, -2)))
    y = np.asarray(jax.jit(quant.ragged_dot_reference)(jnp.asarray(x), qw, gs))
    expert = np.repeat(np.arange(e), np.asarray(gs))
    exact = np.einsum("MK,MKN->MN", x[: len(expert)].astype(np.int64), w[expert].astype(np.int64))
    assert bits == 4 or exact.max() > 2**24
    np.testing.assert_array_equal(y[: len(expert)], exact.astype(np.float32))
    assert not y[len(expert) :].any()


def test_int8_activation_reference_inside_shard_map():
    """Under a decode plan the experts run inside shard_map over the EP axis, each rank its own experts and rows;
    the int8-activation reference's loop over K groups must type-check there (its carry varies over the axis) and
    give each rank what it gives alone."""
    from jax.sharding import PartitionSpec as P

    k, n, ranks = 256, 64, 2  # two K groups: the loop runs
    rng = np.random.default_rng(0)
    w = rng.standard_normal((2 * ranks, k, n), np.float32) / np.float32(np.sqrt(k))
    x = rng.standard_normal((8 * ranks, k), np.float32).astype(jnp.bfloat16)
    qw = quant.quantize(jnp.asarray(w), 4, "int8")
    q, scale = np.asarray(qw.q), np.asarray(qw.scale)  # (sliced per rank on the host)
    gs = np.array([3, 5] * ranks, np.int32)
    mesh = jax.make_mesh((ranks,), ("ep",), devices=jax.devices()[:ranks])
    one = lambda x, q, s, g: quant.ragged_dot_reference(x, quant.QWeight(q, s, 4, "int8"), g)
    args = jax.device_put((x, q, scale, gs), jax.sharding.NamedSharding(mesh, P("ep")))
    sharded = jax.jit(jax.shard_map(one, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(*args)
    alone_fn = jit_as_eager(one)  # each rank's share alone: one program for both
    alone = [
        alone_fn(x[8 * r : 8 * (r + 1)], q[2 * r : 2 * (r + 1)], scale[2 * r : 2 * (r + 1)], gs[:2]) for r in (0, 1)
    ]
    want = np.concatenate([np.asarray(a, np.float32) for a in alone])
    np.testing.assert_array_equal(np.asarray(sharded, np.float32), want)


@pytest.mark.parametrize("bits, act", [(4, "bf16"), (4, "int8"), (8, "int8")])
def test_reference_lowers_for_gpu_without_batched_ragged_dots(bits, act):
    """The reference lowered for CUDA (on the CPU) uses only plain ragged dots, [M, K] x [E, K, N] with [E] group
    sizes. jax lowers ragged_dot through its own jnp expansion on the CPU but emits chlo.ragged_dot for the GPU,
    whose rewriter in XLA takes batch dimensions only with group sizes [b, E] (batch leading): the w4a8 reference
    with a K-group batch passed every CPU test and failed XLA GPU's HLO verifier on the H200."""

    s = jax.ShapeDtypeStruct
    e, m, k, n = 4, 64, 1024, 256
    g = quant.group_size(k, bits)
    q = s((e, n, k // 2), jnp.uint8) if bits == 4 else s((e, n, k), jnp.int8)
    w = quant.QWeight(q, s((e, k // g, n), jnp.float32), bits, act)
    f = jax.jit(quant.ragged_dot_reference).trace(s((m, k), jnp.bfloat16), w, s((e,), jnp.int32))
    text = f.lower(lowering_platforms=("cuda",)).as_text()
    dots = re.findall(r'"chlo.ragged_dot".*', text)
    assert dots
    for d in dots:
        assert "batching_dimensions" not in d and "lhs_ragged_dimensions = [0]" in d, d
        assert re.search(r": \(tensor<\d+x\d+x\w+>, tensor<\d+x\d+x\d+x\w+>, tensor<\d+xi32>\)", d), d


@pytest.mark.parametrize("bits, act", [(4, "bf16"), (8, "int8")])
def test_dense_matmul(bits, act):
    rng = np.random.default_rng(1)
    w = jnp.asarray(rng.standard_normal((256, 64), np.float32) / 16)
    x = rng.standard_normal((2, 3, 256), np.float32).astype(jnp.bfloat16)
    qw = quant.quantize(w, bits, act)
    # QWeight.__rmatmul__: model code runs `x @ p["gate"]` unchanged
    y = np.asarray(jit_as_eager(lambda x, qw: x @ qw)(jnp.asarray(x), qw), np.float32)
    assert y.shape == (2, 3, 64)
    ref = x.astype(np.float32) @ np.asarray(quant.dequantize(qw))
    np.testing.assert_allclose(y, ref, atol=0.05, rtol=0.05)


def test_quant_config_round_trip():
    q = QuantConfig.for_scheme("w4a8c8")
    assert (q.experts, q.linear, q.kv_cache_dtype) == ("w4a8", "w8a8", "int8")
    cfg = ModelConfig.from_json(hcfjax.DEFAULT_MODEL)
    d = json.loads(json.dumps(cfg.__class__.to_dict(cfg.__class__(**{**cfg.__dict__, "quantization": q}))))
    assert d["quantization_config"]["quant_method"] == "hcfjax"
    assert ModelConfig.from_dict(d).quantization == q
    with pytest.raises(ConfigError, match="w3a8"):
        QuantConfig.for_scheme("w3a8")
    with pytest.raises(ConfigError, match="quant_method='gptq' is not supported.*'fp8', 'hcfjax'"):
        ModelConfig.from_dict({**d, "quantization_config": {"quant_method": "gptq", "bits": 4}})


@functools.cache
def _w4a8_experts(f: int):
    """Six tokens routed top-2 over four w4a8 experts (hidden 256, width f): (params, x, ids, weights), and the
    routing as moe.experts sorts it (order, source token of each copy, group sizes). Drawn with numpy, once per f
    (the arrays are immutable): jax.random would compile a program per shape."""
    n, d, e, k = 6, 256, 4, 2
    rng = np.random.default_rng(5)
    p = {
        name: quant.quantize(jnp.asarray(rng.standard_normal(shape, np.float32) / 8), 4, "int8")
        for name, shape in (("gate", (e, d, f)), ("up", (e, d, f)), ("down", (e, f, d)))
    }
    x = jnp.asarray(rng.standard_normal((n, d), np.float32).astype(jnp.bfloat16))
    ids = np.array([[0, 2], [1, 2], [3, 0], [2, 1], [0, 3], [2, 3]], np.int32)
    weights = np.full((n, k), 0.5, np.float32)
    order = np.argsort(ids.reshape(-1), kind="stable").astype(np.int32)
    routing = order, order // k, np.bincount(ids.reshape(-1), minlength=e).astype(np.int32)
    return (p, x, jnp.asarray(ids), jnp.asarray(weights)), tuple(map(jnp.asarray, routing))


def _combine(y, weights, order, token, x):
    """The copies' outputs y [N*K, D] weighted and summed back per token, as moe.experts does."""
    y = y.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    return jnp.zeros(x.shape, jnp.float32).at[token].add(y).astype(x.dtype)


# moe.experts in one program per shape and options (the tests below patch nothing it calls)
_experts = jit_as_eager(moe.experts, static_argnames="opts")


def test_experts_quantise_tokens_before_gathering_their_copies():
    """w4a8 experts: moe.experts quantises the N tokens and gathers their top-k copies as int8 (x_q); per-row
    quantisation commutes with the gather, so the output is exactly that of gathering bf16 rows and quantising them."""
    (p, x, ids, weights), (order, token, gs) = _w4a8_experts(f=128)
    got = _experts(p, x, weights, ids)

    @jit_as_eager
    def gathered_then_quantised(p, x, weights, order, token, gs):
        h = quant.gated_ragged_dot(x[token], p["gate"], p["up"], gs)  # quantised after the gather
        return _combine(quant.ragged_dot(h, p["down"], gs), weights, order, token, x)

    want = gathered_then_quantised(p, x, weights, order, token, gs)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_grouped_down_input_is_the_group_quantised_product():
    """Options.grouped_down_input: the down projection takes the gate/up product quantised per row and 128 channels
    (quantize_int8_groups of the bf16 product, as the fused kernel writes it), exactly on the reference path, and
    within quantisation noise of the per-row path."""
    from hcfjax.options import Options

    (p, x, ids, weights), (order, token, gs) = _w4a8_experts(f=256)
    per_row = _experts(p, x, weights, ids, Options(grouped_down_input=False))
    e, f, d = p["down"].shape
    assert moe.grouped_down_input(p["down"]) and not moe.grouped_down_input(quant.quantize(jnp.ones((e, f, d)), 4))
    assert not moe.grouped_down_input(p["down"], Options(grouped_down_input=False))
    got = _experts(p, x, weights, ids)

    @jit_as_eager
    def group_quantised(p, x, weights, order, token, gs):
        xq = quantize_int8(x)
        h = quant.gated_ragged_dot(x[token], p["gate"], p["up"], gs, (xq[0][token], xq[1][token]))
        h_q = quant.quantize_int8_groups(h)
        return _combine(quant.ragged_dot(h, p["down"], gs, h_q), weights, order, token, x), h_q[1]

    want, h_scales = group_quantised(p, x, weights, order, token, gs)
    assert h_scales.shape == (f // 128, token.shape[0])
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert rel_err(got, per_row) < 0.02 and not np.array_equal(np.asarray(got), np.asarray(per_row))


@pytest.mark.parametrize("act, fused", [("bf16", True), ("int8", True), ("int8", False)])
def test_gated_ragged_dot_dispatch(monkeypatch, act, fused):
    """With the kernel on, gate/up + SiLU runs as one fused kernel for the activation modes in
    Options.fused_gate_up, else as two kernel calls."""
    from hcfjax.options import Options
    from pallas_kernels import moe_int4

    calls = []
    opts = Options(moe="kernel", fused_gate_up=(act,) if fused else (), int4_digits=False)

    # The caller's quantised rows (x_q) reach the kernel with int8 activations, and only then.
    def fused_fn(x, g, u, gs, act, interpret, x_q, quant_out, digits):
        calls.append(("fused", x_q is not None, quant_out))
        return (x[:, :128].astype(jnp.int8), jnp.ones((1, 8))) if quant_out else x[:, :128]

    def one_fn(x, q, s, gs, act, interpret, x_q, digits):
        calls.append(("one", x_q is not None))
        return x[:, :128]

    monkeypatch.setattr(moe_int4, "int4_gated_ragged_dot", fused_fn)
    monkeypatch.setattr(moe_int4, "int4_ragged_dot", one_fn)
    w = quant.quantize(jnp.ones((2, 128, 128)), 4, act)
    x = jnp.ones((8, 128), jnp.bfloat16)
    gs = jnp.array([3, 5], jnp.int32)
    quant.gated_ragged_dot(x, w, w, gs, x_q=quantize_int8(x), opts=opts)
    given = act == "int8"
    assert calls == ([("fused", given, False)] if fused else [("one", given), ("one", given)])
    # quant_out (a down projection's grouped input): written by the w4a8 kernel itself, else quantised after
    calls.clear()
    hq, hs = quant.gated_ragged_dot(x, w, w, gs, x_q=quantize_int8(x), quant_out=True, opts=opts)
    assert hq.dtype == jnp.int8 and hs.shape[0] == 1
    assert calls == ([("fused", given, given)] if fused else [("one", given), ("one", given)])
    if act == "int8" and fused:  # 200 rows per expert (prefill): the kernel's bf16 product, quantised after it
        calls.clear()
        xl = jnp.ones((400, 128), jnp.bfloat16)
        gl = jnp.array([200, 200], jnp.int32)
        hq, hs = quant.gated_ragged_dot(xl, w, w, gl, x_q=quantize_int8(xl), quant_out=True, opts=opts)
        assert calls == [("fused", True, False)] and hq.dtype == jnp.int8 and hs.shape[0] == 1


@pytest.mark.parametrize("mode", ["reference", "interpret", "rows past the groups hold NaN"])
def test_padding_tokens_skip_the_experts(mode, monkeypatch):
    """A batch's padding (moe.moe's real mask False: a prefill chunk's padded tokens, a decode step's inactive rows)
    is routed past the last expert: its copies are in no group, so the grouped products (the reference, and the
    int4 kernels run by their interpreter) skip them. The real tokens' outputs are exactly those of the real tokens
    alone; the padding's routed output is zero, whatever the products leave in rows past the groups (a GPU kernel
    leaves them unwritten: NaN here)."""
    from hcfjax.options import Options

    if mode.startswith("rows"):
        down = moe.ragged_dot

        def nan_past_groups(h, w, group_sizes, *args, **kwargs):
            y = down(h, w, group_sizes, *args, **kwargs)
            return jnp.where(jnp.arange(y.shape[0])[:, None] < group_sizes.sum(), y, jnp.nan)

        monkeypatch.setattr(moe, "ragged_dot", nan_past_groups)
        mode = "reference"
    (p, x, ids, weights), _ = _w4a8_experts(f=128)
    real = np.array([True, False, True, True, False, True])
    opts = Options(moe=mode)
    # one program per shape; a function of this test's own, traced here (with the patched ragged_dot, if patched)
    experts = jit_as_eager(lambda p, x, weights, ids: moe.experts(p, x, weights, ids, opts))
    got = np.asarray(experts(p, x, weights, jnp.where(real[:, None], ids, 4)), np.float32)
    alone = np.asarray(experts(p, x[real], weights[real], ids[real]), np.float32)
    np.testing.assert_array_equal(got[real], alone)
    np.testing.assert_array_equal(got[~real], 0.0)
    assert np.abs(alone).min(1).max() > 0  # (real rows are not zero themselves)
