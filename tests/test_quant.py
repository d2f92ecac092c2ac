"""Quantised weights (hcfjax/quant.py), quantised checkpoints (hcfjax/quantize.py, `hcfjax quantize`, `hcfjax.load`)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import json.decoder
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hcfjax
from hcfjax import quant
from hcfjax.cache import quantize_int8
from hcfjax.cli import main as cli_main
from hcfjax.config import ConfigError, ModelConfig, QuantConfig
from hcfjax.quantize import default_cache_dtype, quantize_model
from tests.conftest import rel_err


def test_int4_pack_round_trip():
    q = jnp.array(np.random.default_rng(0).integers(-8, 8, (3, 5, 64)), jnp.int8)
    packed = quant.pack_int4(q, 32)
    assert packed.dtype == jnp.uint8 and packed.shape == (3, 5, 32)
    np.testing.assert_array_equal(quant.unpack_int4(packed, 32), q)
    # The documented layout: per group, byte j holds k = j (low nibble) and k = j + G/2 (high nibble).
    assert int(quant.pack_int4(jnp.array([[-1, 5, 3, 2]], jnp.int8), 4)[0, 0]) == 0x3F


@pytest.mark.parametrize("bits, k, n", [(4, 256, 96), (4, 48, 40), (8, 256, 96), (8, 48, 40)])
def test_quantize_round_trip_error_bound(bits, k, n):
    w = jax.random.normal(jax.random.key(bits + k), (2, k, n)) * jnp.linspace(0.1, 3.0, n)
    qw = quant.quantize(w, bits)
    assert qw.shape == w.shape and qw.k == k and qw.n == n
    assert qw.group == (min(quant.GROUP, k) if bits == 4 else k)
    assert qw.scale.shape == (2, k // qw.group, n)  # K-group-major, like W
    err = jnp.abs(quant.dequantize(qw) - w)  # [2, K, N]
    half_step = jnp.repeat(qw.scale, qw.group, axis=-2) / 2  # [2, K, N]
    assert bool(jnp.all(err <= half_step * (1 + 1e-5)))
    rel = float(jnp.linalg.norm(err) / jnp.linalg.norm(w))
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
    kw, kx = jax.random.split(jax.random.key(k * n))
    w = jax.random.normal(kw, (e, k, n)) / np.sqrt(k)
    x = jax.random.normal(kx, (m, k)).astype(jnp.bfloat16)
    gs = jnp.array(sizes, jnp.int32)
    qw = quant.quantize(w, bits, act)
    y = jax.jit(quant.ragged_dot_reference)(x, qw, gs).astype(jnp.float32)
    assert y.shape == (m, n) and not bool(jnp.any(y[sum(sizes) :]))
    # Exactly the quantised function: dequantised weights (and activations) through a float32 ragged_dot.
    xe = x.astype(jnp.float32)
    if act == "int8":
        xq, xs = quant.quantize_int8(x)
        xe = xq.astype(jnp.float32) * xs[:, None]
    exact = jax.lax.ragged_dot(xe, quant.dequantize(qw), gs, precision="highest")
    np.testing.assert_allclose(y, exact, atol=0.02 * float(jnp.abs(exact).max()), rtol=0.02)
    # And close to the unquantised product.
    full = jax.lax.ragged_dot(x.astype(jnp.float32), w, gs, precision="highest")
    rel = float(jnp.linalg.norm(y - full) / jnp.linalg.norm(full))
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
    assert bool(jnp.all(qw.scale == 1)) and bool(jnp.all(quant.int_values(qw) == jnp.swapaxes(w, -1, -2)))
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
    w = jax.random.normal(jax.random.key(0), (2 * ranks, k, n)) / np.sqrt(k)
    x = jax.random.normal(jax.random.key(1), (8 * ranks, k)).astype(jnp.bfloat16)
    qw = quant.quantize(w, 4, "int8")
    gs = jnp.array([3, 5] * ranks, jnp.int32)
    mesh = jax.make_mesh((ranks,), ("ep",), devices=jax.devices()[:ranks])
    one = lambda x, q, s, g: quant.ragged_dot_reference(x, quant.QWeight(q, s, 4, "int8"), g)
    args = jax.device_put((x, qw.q, qw.scale, gs), jax.sharding.NamedSharding(mesh, P("ep")))
    sharded = jax.jit(jax.shard_map(one, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(*args)
    alone = [
        one(x[8 * r : 8 * (r + 1)], qw.q[2 * r : 2 * (r + 1)], qw.scale[2 * r : 2 * (r + 1)], gs[:2]) for r in (0, 1)
    ]
    np.testing.assert_array_equal(np.asarray(sharded, np.float32), np.asarray(jnp.concatenate(alone), np.float32))


@pytest.mark.parametrize("bits, act", [(4, "bf16"), (4, "int8"), (8, "int8")])
def test_reference_lowers_for_gpu_without_batched_ragged_dots(bits, act):
    """The reference lowered for CUDA (on the CPU) uses only plain ragged dots, [M, K] x [E, K, N] with [E] group
    sizes. jax lowers ragged_dot through its own jnp expansion on the CPU but emits chlo.ragged_dot for the GPU,
    whose rewriter in XLA takes batch dimensions only with group sizes [b, E] (batch leading): the w4a8 reference
    with a K-group batch passed every CPU test and failed XLA GPU's HLO verifier on the H200."""
    import re

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
    w = jax.random.normal(jax.random.key(1), (256, 64)) / 16
    x = jax.random.normal(jax.random.key(2), (2, 3, 256)).astype(jnp.bfloat16)
    qw = quant.quantize(w, bits, act)
    y = (x @ qw).astype(jnp.float32)  # QWeight.__rmatmul__: model code runs `x @ p["gate"]` unchanged
    assert y.shape == (2, 3, 64)
    ref = x.astype(jnp.float32) @ quant.dequantize(qw)
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
    with pytest.raises(ConfigError, match="fp8"):
        ModelConfig.from_dict({**d, "quantization_config": {"quant_method": "fp8"}})


@pytest.fixture(scope="module")
def embedded():
    model = hcfjax.load()
    tokens = model.tokenizer.encode(inspect.getsource(json.decoder)).ids[:256]
    return model, [tokens], np.asarray(hcfjax.forward(model, [tokens]))


# Measured on this window (json/decoder.py, 256 tokens): relative RMS logit error vs bf16 about 0.050 (w4a16),
# 0.052 (w4a8c8), 0.017 (w8a8); bf16 vs f32 weights is 0.006. Top-1 agreement 0.91-0.93 (int4), 0.98 (w8a8).
@pytest.mark.parametrize("scheme, tol, agree", [("w4a16", 0.08, 0.85)])
def test_quantized_embedded_model_logits(embedded, scheme, tol, agree):
    model, tokens, ref = embedded
    q = quantize_model(model, scheme)
    experts = q.params["segments"][1]["mlp"]["experts"]
    assert isinstance(experts["gate"], quant.QWeight) and experts["gate"].bits == (4 if scheme[1] == "4" else 8)
    lg = np.asarray(hcfjax.forward(q, tokens))
    rel = float(np.sqrt(((lg - ref) ** 2).mean() / (ref**2).mean()))
    assert rel < tol, rel
    assert (lg.argmax(-1) == ref.argmax(-1)).mean() > agree


def test_quantize_cli_load_round_trip(embedded, tmp_path, capsys):
    model, tokens, ref = embedded
    out = tmp_path / "w4a8c8"
    assert cli_main(["quantize", "--out", str(out), "--scheme", "w4a8c8"]) == 0
    assert "w4a8c8" in capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["scheme"] == "w4a8c8"
    loaded = hcfjax.load(out)
    assert loaded.cfg.quantization.kv_cache_dtype == "int8" and default_cache_dtype(loaded) == jnp.int8
    direct = quantize_model(model, "w4a8c8")
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(direct.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # On disk the scales keep the checkpoint's output-major [N, K/G]; in params they are [K/G, N] (quant.py).
    from safetensors.numpy import load_file

    gate = loaded.params["segments"][1]["mlp"]["experts"]["gate"]
    disk = load_file(str(out / "model.safetensors"))
    name = f"model.layers.{loaded.cfg.first_k_dense_replace}.mlp.experts.0.gate_proj.weight_scale"
    np.testing.assert_array_equal(disk[name].T, np.asarray(gate.scale[0, 0]))
    attn = loaded.params["segments"][0]["attn"]
    assert isinstance(attn["q_a"], quant.QWeight) and attn["q_a"].bits == 8 and attn["q_a"].act == "int8"
    assert not isinstance(attn["kv_b"], quant.QWeight)  # per-head einsum weights stay bf16
    lg = np.asarray(hcfjax.forward(loaded, tokens))
    rel = float(np.sqrt(((lg - ref) ** 2).mean() / (ref**2).mean()))
    assert rel < 0.08, rel
    assert cli_main(["quantize", "--model", str(out), "--out", str(tmp_path / "again"), "--scheme", "w4a16"]) == 2


@pytest.fixture
def _reset_interpreter():
    yield
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state

    reset_gpu_interpret_mode_state()  # a failed interpreted kernel leaves state behind


@pytest.mark.parametrize("bm", [16, 128])
@pytest.mark.parametrize(
    "sizes, m",
    [
        ([5, 0, 20, 3], 31),
        ([0, 17, 0, 40], 57),
        ([3, 2], 5),
        ([9] * 12, 130),
        ([0, 1] * 20 + [0] * 4, 27),  # fewer rows than experts (decode): the bound counts the groups with rows
        ([0] * 9 + [7] + [0] * 20 + [9] + [0] * 33, 16),
    ],
)
def test_block_table_covers_each_row_once(sizes, m, bm):
    """The kernel stores, per block, rows [tile + off, tile + off + count) of its expert's product (zeros for expert
    E, rows past the groups); so every row must belong to exactly one block, of its own group, within the block's
    bm-row tile, and each tile must start at a multiple of 8 rows (the TMA of an 8-row-tiled smem buffer)."""
    from pallas_kernels.moe_int4_tiling import ROW_ALIGN, block_table, blocks_used

    e = len(sizes)
    t = np.asarray(block_table(jnp.array(sizes, jnp.int32), m, bm))
    expert, tile, off, count = t
    used = expert >= 0
    assert (tile[used] % ROW_ALIGN == 0).all() and (count[used] >= 1).all() and (off + count <= bm)[used].all()
    owner = np.concatenate([np.repeat(np.arange(e), sizes), np.full(m - sum(sizes), e)])  # each row's group
    seen = np.zeros(m, int)
    for b in np.flatnonzero(used):
        rows = np.arange(tile[b] + off[b], tile[b] + off[b] + count[b])
        assert (owner[rows] == expert[b]).all()
        seen[rows] += 1
    assert (seen == 1).all()
    used_n = int(blocks_used([jnp.int32(v) for v in sizes], m, bm))  # the groups' blocks: [0, n)
    assert used[:used_n].all() and not used[used_n:].any()


def test_block_bound_holds_with_more_experts_than_rows():
    """num_blocks bounds blocks_used for any sizes; with few rows over many experts it counts only the groups that
    can have rows. Random sizes, and every row its own group (the most groups with rows)."""
    from pallas_kernels.moe_int4_tiling import blocks_used, num_blocks

    rng = np.random.default_rng(0)
    for _ in range(40):
        e, m, bm = int(rng.choice([16, 64, 256])), int(rng.integers(1, 40)), int(rng.choice([16, 32]))
        sizes = np.bincount(rng.integers(0, e, int(rng.integers(0, m + 1))), minlength=e)
        assert int(blocks_used([jnp.int32(v) for v in sizes], m, bm)) <= num_blocks(m, e, bm)
    e, m, bm = 64, 12, 16
    sizes = np.zeros(e, int)
    sizes[::5][:m] = 1
    assert int(blocks_used([jnp.int32(v) for v in sizes], m, bm)) <= num_blocks(m, e, bm) < 94
    assert num_blocks(128, 16, 16) == -(-(128 + 7 * 17) // 16) + 17  # decode at 16 experts: as before


def test_unpack_bit_tricks_give_the_nibbles():
    """The kernel's register-level unpacking (pallas_kernels/int4_unpack.py), run on numpy through the same code the
    kernel emits as MLIR: every pair of packed bytes gives bf16 bit patterns 136 + q (w4a16), every byte 16 q as int8
    (w4a8), for both nibbles, equal to quant.unpack_int4's values."""
    from pallas_kernels.int4_unpack import HIGH_NIBBLES, NumpyOps, bf16_bits, int8_lo_bits

    b = np.arange(1 << 16, dtype=np.uint32)  # b0 | b1 << 8, every pair
    nib = quant.unpack_int4(jnp.asarray(b.astype(np.uint16).view(np.uint8).reshape(-1, 2)), 4)  # [pairs, 4]
    nib = np.asarray(nib).astype(np.float32)  # per pair: lo(b0), lo(b1), hi(b0), hi(b1)
    for half, bits in enumerate(bf16_bits(b, NumpyOps)):
        for lane in range(2):
            v = ((bits >> (16 * lane)) & 0xFFFF).astype(np.uint16).view(jnp.bfloat16).astype(np.float32) - 136
            np.testing.assert_array_equal(v, nib[:, 2 * half + lane])
    rand = np.random.default_rng(0).integers(0, 2**32, 4096, np.uint32)
    r = np.concatenate([np.arange(256, dtype=np.uint32) * 0x01010101, rand])  # every byte, then random words
    lo, hi = int8_lo_bits(r, NumpyOps), r & np.uint32(HIGH_NIBBLES)
    vals = np.asarray(quant.unpack_int4(jnp.asarray(r.view(np.uint8).reshape(-1, 4)), 8)).astype(np.int32)  # [.., 8]
    np.testing.assert_array_equal(lo.view(np.int8).reshape(-1, 4), 16 * vals[:, :4])
    np.testing.assert_array_equal(hi.view(np.int8).reshape(-1, 4), 16 * vals[:, 4:])


def test_int8_to_f16_bit_trick_is_exact():
    """The MLA kernel's int8 -> fp16 conversion (pallas_kernels/int8_f16.py), run on numpy through the same code the
    kernel emits as MLIR: every int8 value, in every byte of a word, comes out as the fp16 bits of 1152 + v, so the
    kernel's fp16x2 subtract of 1152 gives v exactly."""
    from pallas_kernels.int4_unpack import NumpyOps
    from pallas_kernels.int8_f16 import OFFSET, f16_bits

    rand = np.random.default_rng(1).integers(0, 2**32, 4096, np.uint32)
    r = np.concatenate([np.arange(256, dtype=np.uint32) * 0x01010101, rand])  # every byte, then random words
    words = f16_bits(r, NumpyOps)
    halves = np.stack([w.view(np.uint16).reshape(-1, 2) for w in words], axis=1).reshape(-1, 4)  # bytes 0..3
    got = halves.view(np.float16).astype(np.float64) - OFFSET
    np.testing.assert_array_equal(got, r.view(np.int8).reshape(-1, 4).astype(np.float64))


def _tiling(spec):
    """A test case's tiling: None (the default) or Tiling's fields."""
    from pallas_kernels.moe_int4_tiling import Tiling

    return spec if spec is None else Tiling(*spec[:3], **spec[3] if len(spec) > 3 else {})


KERNEL_CASES = [  # k, n, sizes, tiling (bm, bn, stages[, extra])
    (256, 128, [5, 0, 20, 3], (16, 128, 2)),  # a group across two blocks, the last tile past M (zero-filled by the TMA)
    (128, 64, [0, 17, 0, 40], None),
    # two blocks of one group, groups starting off the 8-row grid, narrower blocks where they fit (48 rows, then 32,
    # the one-row group and the rows past the groups at 16)
    (128, 64, [70, 1, 0, 9], (48, 64, 3, {"narrow": True})),
    (128, 64, [3, 2], (16, 64, 2)),  # M < bm (x padded to one block)
    (512, 256, [9, 30, 0, 2], (32, 256, 2, {"gps": 2})),  # four 64-row tiles, two K groups per step
    # A through smem, unpacked with int16 ops, each tile just before its wgmmas
    (256, 128, [5, 0, 20, 3], (16, 64, 4, {"a_regs": False, "inline": False, "unpack_first": False})),
    (256, 128, [5, 0, 20, 3], (16, 128, 1, {"splits": 2})),  # split-K: f32 partials of two K halves, summed after
    (128, 64, [0, 1, 0, 0, 2, 0, 0, 9, 1] + [0] * 7, (16, 64, 2)),  # more experts than rows: the grid's tighter bound
]


@pytest.mark.usefixtures("_reset_interpreter")
@pytest.mark.parametrize("act", ["bf16", "int8"])
@pytest.mark.parametrize("k, n, sizes, tiling", KERNEL_CASES)
def test_kernel_matches_reference_interpret(k, n, sizes, tiling, act):
    """The Mosaic GPU kernel, run by its interpreter: empty groups, sizes not multiples of the token block, rows past
    sum(group_sizes), several K/N and tilings; x unpadded, the output written in x's row order. Equal to the reference
    up to the weights' bf16 scale and one bf16 rounding of the output (w4a16), exact sums (w4a8)."""
    from pallas_kernels.moe_int4 import int4_ragged_dot

    e, m = len(sizes), sum(sizes) + 3
    w = jax.random.normal(jax.random.key(k + n), (e, k, n)) / 16
    x = jax.random.normal(jax.random.key(1), (m, k)).astype(jnp.bfloat16)
    gs = jnp.array(sizes, jnp.int32)
    qw = quant.quantize(w, 4, act)
    t = _tiling(tiling)
    ref = np.asarray(quant.ragged_dot_reference(x, qw, gs), np.float32)
    y = np.asarray(int4_ragged_dot(x, qw.q, qw.scale, gs, act=act, interpret=True, tiling=t), np.float32)
    np.testing.assert_allclose(y, ref, atol=1e-2 * np.abs(ref).max(), rtol=1e-2)
    assert not y[sum(sizes) :].any()


@pytest.mark.usefixtures("_reset_interpreter")
def test_w4a16_as_int8_digits_interpret(monkeypatch):
    """w4a16 with few rows per expert runs as two int8 digits a value on the w4a8 kernel (moe_int4.digits_pay): the
    default at 3 rows per expert (not at 20, nor with K groups of 256). The digits give x back within their bound
    (heavy-tailed x, an all-zero row); the product is as close to the exact one as the w4a16 kernel's, with the row
    pairs summed in the epilogue (Tiling.pairs) and the rows past the groups zero; the same for the fused gate/up
    kernel, whose pairs are summed before the SiLU."""
    from pallas_kernels.moe_int4 import (
        int4_gated_ragged_dot,
        int4_gated_ragged_dot_digits,
        int4_ragged_dot,
        int4_ragged_dot_digits,
        int8_digits,
    )
    from pallas_kernels.moe_int4_tiling import Tiling, digits_pay

    e, k, n, sizes = 8, 256, 128, [3, 0, 5, 2, 4, 1, 0, 6]
    m = sum(sizes) + 3
    assert digits_pay(m, n, 128, 2, e) and not digits_pay(20 * e, n, 128, 2, e) and not digits_pay(m, n, 256, 1, e)
    kx, kw, ks = jax.random.split(jax.random.key(7), 3)
    x = (jax.random.normal(kx, (m, k)) * jnp.exp(jax.random.normal(ks, (m, k)))).at[1].set(0).astype(jnp.bfloat16)
    xf = np.asarray(x, np.float32)
    d, sc = (np.asarray(a, np.float32) for a in int8_digits(x))
    back = (d.reshape(m, 2, k // 128, 128) * sc.T.reshape(m, 2, k // 128)[..., None]).sum(1).reshape(m, k)
    group_max = np.abs(xf).reshape(m, k // 128, 128).max(-1, keepdims=True)
    assert (np.abs(back - xf).reshape(m, k // 128, 128) <= group_max / 64_000).all() and not back[1].any()
    w = jax.random.normal(kw, (e, k, n)) / 16
    gs = jnp.array(sizes, jnp.int32)
    qw = quant.quantize(w, 4, "bf16")
    exact = np.asarray(jax.lax.ragged_dot(xf, quant.dequantize(qw, jnp.float32), gs, precision="highest"))
    y = np.asarray(int4_ragged_dot(x, qw.q, qw.scale, gs, interpret=True), np.float32)
    np.testing.assert_array_equal(y, np.asarray(int4_ragged_dot_digits(x, qw.q, qw.scale, gs, True), np.float32))
    y16 = np.asarray(int4_ragged_dot(x, qw.q, qw.scale, gs, interpret=True, tiling=Tiling(16, 128, 2)), np.float32)
    err = [np.linalg.norm(v[: sum(sizes)] - exact[: sum(sizes)]) / np.linalg.norm(exact) for v in (y, y16)]
    assert 0 < err[0] <= 1.1 * err[1] < 5e-3, err
    assert not y[sum(sizes) :].any() and not (y16 == y).all()
    # gate/up: the fused kernel over the digits, each row pair's gate and up summed before the SiLU
    u = quant.quantize(jax.random.normal(ks, (e, k, n)) / 16, 4, "bf16")
    gate, up = (qw.q, qw.scale), (u.q, u.scale)
    h = np.asarray(int4_gated_ragged_dot(x, gate, up, gs, interpret=True), np.float32)
    np.testing.assert_array_equal(h, np.asarray(int4_gated_ragged_dot_digits(x, gate, up, gs, True), np.float32))
    exact_up = np.asarray(jax.lax.ragged_dot(xf, quant.dequantize(u, jnp.float32), gs, precision="highest"))
    want = exact / (1 + np.exp(-exact)) * exact_up
    assert np.linalg.norm(h - want) / np.linalg.norm(want) < 5e-3 and not h[sum(sizes) :].any()


@pytest.mark.usefixtures("_reset_interpreter")
@pytest.mark.parametrize("act", ["bf16", "int8"])
def test_kernel_group_256_interpret(act):
    """A K group of 256: two 64-byte packed chunks per group and row tile (each K half of the group is two wgmma K
    chunks), with two groups per pipeline step."""
    from pallas_kernels.moe_int4 import int4_ragged_dot
    from pallas_kernels.moe_int4_tiling import Tiling

    e, k, n, sizes = 4, 512, 128, [9, 30, 0, 2]
    w = jax.random.normal(jax.random.key(3), (e, k, n)) / 16
    x = jax.random.normal(jax.random.key(1), (sum(sizes) + 3, k)).astype(jnp.bfloat16)
    gs = jnp.array(sizes, jnp.int32)
    qw = quant.quantize(w, 4, act, group=256)
    ref = np.asarray(quant.ragged_dot_reference(x, qw, gs), np.float32)
    t = Tiling(32, 64, 2, gps=2)
    y = np.asarray(int4_ragged_dot(x, qw.q, qw.scale, gs, act=act, interpret=True, tiling=t), np.float32)
    np.testing.assert_allclose(y, ref, atol=1e-2 * np.abs(ref).max(), rtol=1e-2)


@pytest.mark.usefixtures("_reset_interpreter")
@pytest.mark.parametrize("act", ["bf16", "int8"])
def test_gated_kernel_matches_reference_interpret(act):
    """silu(x @ Wg) * (x @ Wu) in one kernel (two weights, one token tile), with an empty group and a partial block."""
    from pallas_kernels.moe_int4 import int4_gated_ragged_dot, int4_gated_reference
    from pallas_kernels.moe_int4_tiling import Tiling

    k, n, sizes = 256, 128, [9, 0, 30]
    e, m = len(sizes), sum(sizes) + 2
    kg, ku = jax.random.split(jax.random.key(7))
    qg, qu = (quant.quantize(jax.random.normal(kk, (e, k, n)) / 4, 4, act) for kk in (kg, ku))
    x = jax.random.normal(jax.random.key(2), (m, k)).astype(jnp.bfloat16)
    gs = jnp.array(sizes, jnp.int32)
    gate, up = (qg.q, qg.scale), (qu.q, qu.scale)
    ref = np.asarray(int4_gated_reference(x, gate, up, gs, act), np.float32)
    # w4a8 (the fused path the model runs) also split-K (gate and up partials side by side, SiLU after the sum) and
    # with each tile unpacked just before its wgmmas (the order the bench compares against)
    tilings = [Tiling(16, 128, 2)] + [Tiling(16, 128, 1, splits=2), Tiling(16, 128, 2, unpack_first=False)] * (
        act == "int8"
    )
    for t in tilings:
        y = np.asarray(int4_gated_ragged_dot(x, gate, up, gs, act=act, interpret=True, tiling=t), np.float32)
        np.testing.assert_allclose(y, ref, atol=1e-2 * np.abs(ref).max(), rtol=2e-2)
        assert not y[sum(sizes) :].any()
    if act == "int8":  # the rows quantised by the caller (x then only gives the shape): the same kernel result
        x_q = quantize_int8(x)
        yq = int4_gated_ragged_dot(jnp.zeros_like(x), gate, up, gs, act=act, interpret=True, tiling=t, x_q=x_q)
        np.testing.assert_array_equal(np.asarray(yq, np.float32), y)


@pytest.mark.usefixtures("_reset_interpreter")
def test_warpgroups_sharing_token_tiles_interpret():
    """w4a8 with two compute warpgroups per CTA (Tiling.wgs, a warp-specialised pipeline): each takes half of the
    CTA's weight rows against the same token tile. Bit for bit the one-warpgroup kernel's result, with narrow blocks
    (widths 16 and 32) and rows past the groups (zeros), and for the gated kernel (the prefill default)."""
    from pallas_kernels.moe_int4 import int4_gated_ragged_dot, int4_ragged_dot
    from pallas_kernels.moe_int4_tiling import Tiling

    k, n, sizes = 256, 256, [40, 1, 0, 9]  # two N tiles of 128 rows: each warpgroup's columns of each tile
    e, m = len(sizes), sum(sizes) + 3
    kw, kg, ku = jax.random.split(jax.random.key(11), 3)
    qw, qg, qu = (quant.quantize(jax.random.normal(kk, (e, k, n)) / 8, 4, "int8") for kk in (kw, kg, ku))
    x = jax.random.normal(jax.random.key(1), (m, k)).astype(jnp.bfloat16)
    gs = jnp.array(sizes, jnp.int32)
    ws, one = Tiling(32, 128, 2, wgs=2, narrow=True), Tiling(32, 128, 2, narrow=True)
    single = lambda t: np.asarray(  # noqa: E731
        int4_ragged_dot(x, qw.q, qw.scale, gs, act="int8", interpret=True, tiling=t), np.float32
    )
    y = single(ws)
    np.testing.assert_array_equal(y, single(one))
    exact = np.asarray(quant.ragged_dot_reference(x, qw, gs), np.float32)
    np.testing.assert_allclose(y, exact, atol=1e-2 * np.abs(exact).max(), rtol=1e-2)
    assert not y[sum(sizes) :].any()
    gated = lambda t: np.asarray(  # noqa: E731
        int4_gated_ragged_dot(x, (qg.q, qg.scale), (qu.q, qu.scale), gs, act="int8", interpret=True, tiling=t)
    )
    np.testing.assert_array_equal(gated(dataclasses.replace(ws, narrow=False)), gated(one))


def _w4a8_experts(f: int):
    """Six tokens routed top-2 over four w4a8 experts (hidden 256, width f): (params, x, ids, weights), and the
    routing as moe.experts sorts it (order, source token of each copy, group sizes)."""
    n, d, e, k = 6, 256, 4, 2
    keys = jax.random.split(jax.random.key(5), 4)
    p = {
        name: quant.quantize(jax.random.normal(kk, shape) / 8, 4, "int8")
        for name, kk, shape in (("gate", keys[0], (e, d, f)), ("up", keys[1], (e, d, f)), ("down", keys[2], (e, f, d)))
    }
    x = jax.random.normal(keys[3], (n, d)).astype(jnp.bfloat16)
    ids = jnp.array([[0, 2], [1, 2], [3, 0], [2, 1], [0, 3], [2, 3]], jnp.int32)
    weights = jnp.full((n, k), 0.5, jnp.float32)
    order = jnp.argsort(ids.reshape(-1), stable=True)
    routing = order, order // k, jnp.bincount(ids.reshape(-1), length=e).astype(jnp.int32)
    return (p, x, ids, weights), routing


def _combine(y, weights, order, token, x):
    """The copies' outputs y [N*K, D] weighted and summed back per token, as moe.experts does."""
    y = y.astype(jnp.float32) * weights.reshape(-1)[order][:, None]
    return jnp.zeros(x.shape, jnp.float32).at[token].add(y).astype(x.dtype)


def test_experts_quantise_tokens_before_gathering_their_copies():
    """w4a8 experts: moe.experts quantises the N tokens and gathers their top-k copies as int8 (x_q); per-row
    quantisation commutes with the gather, so the output is exactly that of gathering bf16 rows and quantising them."""
    from hcfjax import moe

    (p, x, ids, weights), (order, token, gs) = _w4a8_experts(f=128)
    got = moe.experts(p, x, weights, ids)
    h = quant.gated_ragged_dot(x[token], p["gate"], p["up"], gs)  # quantised after the gather
    want = _combine(quant.ragged_dot(h, p["down"], gs), weights, order, token, x)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_grouped_down_input_is_the_group_quantised_product():
    """Options.grouped_down_input: the down projection takes the gate/up product quantised per row and 128 channels
    (quantize_int8_groups of the bf16 product, as the fused kernel writes it), exactly on the reference path, and
    within quantisation noise of the per-row path."""
    from hcfjax import moe
    from hcfjax.options import Options

    (p, x, ids, weights), (order, token, gs) = _w4a8_experts(f=256)
    per_row = moe.experts(p, x, weights, ids, Options(grouped_down_input=False))
    e, f, d = p["down"].shape
    assert moe.grouped_down_input(p["down"]) and not moe.grouped_down_input(quant.quantize(jnp.ones((e, f, d)), 4))
    assert not moe.grouped_down_input(p["down"], Options(grouped_down_input=False))
    got = moe.experts(p, x, weights, ids)
    xq = quantize_int8(x)
    h = quant.gated_ragged_dot(x[token], p["gate"], p["up"], gs, (xq[0][token], xq[1][token]))
    h_q = quant.quantize_int8_groups(h)
    assert h_q[1].shape == (f // 128, token.shape[0])
    want = _combine(quant.ragged_dot(h, p["down"], gs, h_q), weights, order, token, x)
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


def test_quant_out_where_it_pays():
    """The fused w4a8 kernel quantises its own output up to about 32 rows per expert (the blocks quant_out's tiling
    allows), at the bench shapes where the H200 measured it faster or level, and not beyond."""
    from pallas_kernels.moe_int4_tiling import quant_out_pays

    pays = {(e, m): quant_out_pays("int8", m, 2048, 56, e) for e in (16, 32) for m in (128, 1024, 4096, 16384)}
    assert [k for k, v in pays.items() if v] == [(16, 128), (32, 128), (32, 1024)]
    assert quant_out_pays("int8", 6, 1408, 16, 64) and not quant_out_pays("int8", 4096 * 6, 1408, 16, 64)  # V2-Lite


BENCH_SHAPES = [  # pallas_kernels.bench.moe: E x M x K x N, gate/up (K = hidden, N = expert width) and down
    (e, m, k, n) for e in (16, 32) for m in (128, 1024, 4096, 16384) for k, n in ((7168, 2048), (2048, 7168))
]


@pytest.mark.parametrize("act", ["bf16", "int8"])
def test_default_tilings_fit_the_sm(act):
    """At every bench shape the default tiling's registers stay within REGS and at least two CTAs fit an SM's shared
    memory (one overlaps the other's unpacking), or one CTA of two compute warpgroups, with a pipeline of at least
    two steps; w4a8 prefill runs narrow tails, and its fused kernel two compute warpgroups over long K loops."""
    from pallas_kernels.moe_int4_tiling import REGS, SMEM_PER_SM, Tiling, block_widths, default_tiling, regs, smem_bytes

    for e, m, k, n in BENCH_SHAPES:
        for nw in (1, 2):
            t = default_tiling(act, m, n, k // 128, e, nw)
            assert t.stages >= 2 and n % t.bn == 0 and t.bm % 16 == 0, (e, m, k, n, nw, t)
            assert t.bm == 16 or regs(act, t.bm, t.bn // t.wgs, nw) <= REGS, (e, m, k, n, nw, t)
            ctas = 1 if t.wgs > 1 else 2
            assert ctas * (smem_bytes(act, t, 128, nw) + 1024) <= SMEM_PER_SM, (e, m, k, n, nw, t)
            # w4a8 prefill: a group's last block at the narrowest width that holds it, in at most five widths
            assert t.narrow == (act == "int8" and t.bm > 32), (e, m, k, n, nw, t)
            assert (t.wgs == 2) == (act == "int8" and nw == 2 and t.bm >= 80 and k // 128 >= 32), (e, m, k, n, nw, t)
    assert block_widths(Tiling(80, 128, 2, narrow=True)) == (16, 32, 48, 64, 80)
    assert block_widths(Tiling(160, 64, 2, narrow=True)) == (96, 112, 128, 144, 160)
    assert block_widths(Tiling(80, 128, 2)) == (80,)


def test_w4a8_unpacks_a_step_first_only_where_registers_allow():
    """A w4a8 step unpacks all its tiles before its wgmmas (so ptxas need not serialise them) only where every A
    operand fits beside the accumulators: the fused decode kernel at 16 experts x 128 rows (bm = 16) does, at 8
    experts (bm = 32, 320 registers by `regs`) it unpacks each tile before its own wgmmas."""
    from pallas_kernels.moe_int4_tiling import UNPACK_FIRST_REGS, default_tiling, regs

    assert default_tiling("int8", 128, 2048, 56, 16, nw=2).unpack_first
    t = default_tiling("int8", 128, 2048, 56, 8, nw=2)
    assert (t.bm, t.gps, t.unpack_first) == (32, 2, False)
    for e, m, k, n in BENCH_SHAPES:
        for nw in (1, 2):
            t = default_tiling("int8", m, n, k // 128, e, nw)
            assert t.unpack_first == (regs("int8", t.bm, t.bn // t.wgs, nw, t.gps) <= UNPACK_FIRST_REGS), (
                e,
                m,
                k,
                n,
                nw,
            )


# DeepSeek-V3 expert shapes, decode and prefill (every bench row: `python -m pallas_kernels.bench.moe --lower`)
LOWER_CASES = [
    (16, 128, 7168, 2048, None),
    (16, 1024, 2048, 7168, None),
    (32, 4096, 7168, 2048, None),
    (32, 4096, 7168, 2048, (128, 64, 4, {"a_regs": False, "inline": False, "unpack_first": False})),  # A through smem
    # M = 21 tokens x top-6 (V2-Lite): not whole 8-row tiles, which the tiled TMA of x needs (the wrapper pads)
    (16, 126, 7168, 2048, (16, 256, 2, {"gps": 2})),
]


@pytest.fixture
def _two_narrow_widths(monkeypatch):
    """Lowering tests lower two of a narrow tiling's block widths (w4a8 prefill): each width is the same code at
    another static block width, and all five of the 32 x 4096 default took 25 s in CI (`bench.moe --lower` lowers
    every one)."""
    from pallas_kernels import moe_int4_tiling

    monkeypatch.setattr(moe_int4_tiling, "NARROW_WIDTHS", 2)


@pytest.mark.usefixtures("_two_narrow_widths")
@pytest.mark.parametrize("act", ["bf16", "int8"])
@pytest.mark.parametrize("e, m, k, n, tiling", LOWER_CASES)
def test_kernel_lowers_for_hopper(e, m, k, n, tiling, act):
    """Mosaic GPU's lowering for sm_90 on the CPU, with the GPU's own path (unpacking through inline_mgpu, wgmma with
    A in registers): layout inference, supported ops and smem (227 KiB) are checked here, where the H200 first
    reported "Shaped arrays must be represented by ir.Values" and 8-bit shifts."""
    from pallas_kernels.cross_lower import lower_for_hopper
    from pallas_kernels.moe_int4 import int4_ragged_dot

    t = _tiling(tiling)
    s = jax.ShapeDtypeStruct
    args = (s((m, k), jnp.bfloat16), s((e, n, k // 2), jnp.uint8), s((e, k // 128, n), jnp.float32), s((e,), jnp.int32))
    assert "mosaic_gpu" in lower_for_hopper(lambda *a: int4_ragged_dot(*a, act=act, tiling=t), *args)


@pytest.mark.usefixtures("_two_narrow_widths")
@pytest.mark.parametrize("act", ["bf16", "int8"])
def test_gated_kernel_lowers_for_hopper(act):
    """The fused gate/up kernel's prefill default at 32 experts x 4096 rows: w4a8's has two compute warpgroups per
    CTA (the warp-specialised pipeline, its register split, the output tiles beside the pipeline)."""
    from pallas_kernels.cross_lower import lower_for_hopper
    from pallas_kernels.moe_int4 import int4_gated_ragged_dot
    from pallas_kernels.moe_int4_tiling import default_tiling

    e, m, k, n = 32, 4096, 7168, 2048
    assert default_tiling(act, m, n, k // 128, e, nw=2).wgs == (2 if act == "int8" else 1)
    s = jax.ShapeDtypeStruct
    w = (s((e, n, k // 2), jnp.uint8), s((e, k // 128, n), jnp.float32))
    f = lambda x, g, u, gs: int4_gated_ragged_dot(x, g, u, gs, act=act)  # noqa: E731
    assert "mosaic_gpu" in lower_for_hopper(f, s((m, k), jnp.bfloat16), w, w, s((e,), jnp.int32))


def test_two_warpgroup_single_kernel_lowers_for_hopper():
    """Two compute warpgroups per CTA (Tiling.wgs) for the single-weight kernel given per-group token scales (a
    pipeline input the fused default does not have) lower for sm_90; the gated test lowers the fused default."""
    from pallas_kernels.cross_lower import lower_for_hopper
    from pallas_kernels.moe_int4 import int4_ragged_dot
    from pallas_kernels.moe_int4_tiling import default_tiling

    e, m, k, n = 32, 4096, 2048, 7168
    s = jax.ShapeDtypeStruct
    x, gs = s((m, k), jnp.bfloat16), s((e,), jnp.int32)
    w = (s((e, n, k // 2), jnp.uint8), s((e, k // 128, n), jnp.float32))
    t = dataclasses.replace(default_tiling("int8", m, n, k // 128, e, wgs=2), narrow=False)
    xg = (s((m, k), jnp.int8), s((k // 128, m + 264), jnp.float32))
    f = lambda x, w, gs, xg: int4_ragged_dot(x, *w, gs, act="int8", tiling=t, x_q=xg)  # noqa: E731
    assert "mosaic_gpu" in lower_for_hopper(f, x, w, gs, xg)


@pytest.mark.parametrize("act", ["bf16", "int8"])
@pytest.mark.parametrize("nw", [1, 2])
def test_pipelined_blocks_are_tma_aligned(monkeypatch, act, nw):
    """Every block the kernel pipelines is a multiple of 128 bytes: a pipeline buffer holds its stages' blocks back to
    back and a TMA's smem destination must be 128-byte aligned. w4a8 at BM = 16 once pipelined its token scales as a
    64-byte block: CUDA_ERROR_MISALIGNED_ADDRESS on the H200 (neither the interpreter nor the lowering checks this)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    from pallas_kernels.cross_lower import trace_for_hopper
    from pallas_kernels.moe_int4 import int4_gated_ragged_dot, int4_ragged_dot
    from pallas_kernels.moe_int4_tiling import Tiling

    seen, emit = [], plgpu.emit_pipeline

    def recording(body, *, in_specs, **kw):
        run = emit(body, in_specs=in_specs, **kw)

        def call(*operands):
            seen.extend((spec.block_shape, op.dtype) for spec, op in zip(in_specs, operands, strict=True))
            return run(*operands)

        return call

    monkeypatch.setattr(plgpu, "emit_pipeline", recording)
    e, m, k, n = 4, 64, 1024, 256
    s = jax.ShapeDtypeStruct
    x, gs = s((m, k), jnp.bfloat16), s((e,), jnp.int32)
    w = (s((e, n, k // 2), jnp.uint8), s((e, k // 128, n), jnp.float32))
    shapes = [(16, 64, 1), (32, 128, 2), (48, 128, 1), (80, 64, 1), (128, 256, 1)]
    for bm, bn, gps in shapes:
        t = Tiling(bm, bn, 2, gps)
        if nw == 1:  # (tracing builds the pipelines; lowering them is other tests' business)
            trace_for_hopper(lambda x, w, gs, t=t: int4_ragged_dot(x, *w, gs, act=act, tiling=t), x, w, gs)
        else:
            trace_for_hopper(lambda x, w, gs, t=t: int4_gated_ragged_dot(x, w, w, gs, act=act, tiling=t), x, w, gs)
    assert seen
    for shape, dtype in seen:
        rows = [getattr(d, "block_size", d) or 1 for d in shape]  # pl.Element(bm): a tile at a row offset
        assert np.prod(rows) * jnp.dtype(dtype).itemsize % 128 == 0, (shape, dtype)


@pytest.mark.parametrize(
    "act, tiling, nw",
    [
        ("bf16", (128, 64, 4, {"a_regs": False}), 1),
        ("int8", (32, 128, 3), 1),
        ("int8", (64, 64, 4), 2),
        ("bf16", (80, 128, 3), 1),
        ("int8", (256, 256, 2), 1),
        ("int8", (128, 128, 2, {"splits": 2}), 2),  # split-K: the f32 partials of gate and up outgrow the stages
        ("int8", (16, 128, 4, {"gps": 2}), 1),
        ("int8", (32, 64, 3, {"a_regs": False}), 1),
        ("int8", (80, 256, 3, {"wgs": 2}), 1),  # two compute warpgroups: their output tiles beside the pipeline
        ("int8", (80, 128, 7, {"wgs": 2}), 2),  # the fused prefill default's: seven stages of 1 KiB-aligned buffers
        ("int8", (80, 64, 5), 2),
    ],
)
def test_smem_bytes_bounds_what_mosaic_allocates(monkeypatch, act, tiling, nw):
    """smem_bytes is an upper bound within 2 KiB of Mosaic's own count, which includes the output tile reusing the
    pipeline's buffers (the last case: the output tile [256, 256], 128 KiB, is larger than the two stages, 100 KiB)."""
    import re

    from jax.experimental.mosaic.gpu import core

    from pallas_kernels.cross_lower import lower_for_hopper
    from pallas_kernels.moe_int4 import int4_gated_ragged_dot, int4_ragged_dot
    from pallas_kernels.moe_int4_tiling import smem_bytes

    monkeypatch.setattr(core, "_SMEM_SIZE_BOUND", 1)  # Mosaic then reports its smem count in the error
    t = _tiling(tiling)
    e, m, k, n = 4, 256, 1024, 256
    s = jax.ShapeDtypeStruct
    args = (s((m, k), jnp.bfloat16), s((e, n, k // 2), jnp.uint8), s((e, k // 128, n), jnp.float32), s((e,), jnp.int32))
    if nw == 1:
        f = lambda x, q, sc, gs: int4_ragged_dot(x, q, sc, gs, act=act, tiling=t)  # noqa: E731
    else:
        f = lambda x, q, sc, gs: int4_gated_ragged_dot(x, (q, sc), (q, sc), gs, act=act, tiling=t)  # noqa: E731
    with pytest.raises(ValueError, match="shared memory") as err:
        lower_for_hopper(f, *args)
    used = int(re.search(r"smem_bytes=(\d+)", str(err.value)).group(1))
    assert used <= smem_bytes(act, t, nw=nw) < used + 2048


def test_ptx_report_parsing():
    """bench.ptx's summary of a ptxas -v report and a SASS listing (the numbers the offline analysis rests on)."""
    from pallas_kernels.bench.ptx import ptxas_report, sass_counts, tiling_overrides

    text = """ptxas info    : (C7517) wgmma.wait_group is injected in around line 1220 by compiler
ptxas info    : (C7517) wgmma.wait_group is injected in around line 1300 by compiler
ptxas info    : (C7519) warpgroup.arrive is injected in around line 642 by compiler
    112 bytes stack frame, 136 bytes spill stores, 156 bytes spill loads
ptxas info    : Used 168 registers, used 16 barriers, 112 bytes cumulative stack size, 1 bytes smem"""
    assert ptxas_report(text) == dict(
        registers=168, spill_stores=136, spill_loads=156, injected_waits=2, injected_arrives=1
    )
    assert ptxas_report("")["registers"] is None
    sass = """/*3510*/ IGMMA.64x16x32.S8.S8 R72, R24, gdesc[UR44], R72 ;
/*3550*/ IGMMA.64x16x32.S8.S8 R72, R28, gdesc[UR24], R72, gsb0 ;
/*36b0*/ WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
/*47d0*/ HGMMA.64x256x16.F32.BF16 R24, gdesc[UR56].tnspB, R24 ;
/*47a0*/ WARPGROUP.ARRIVE ;"""
    assert sass_counts(sass) == dict(wgmma=3, wgmma_waits=1)
    assert tiling_overrides("wgs=1+bm=64") == dict(wgs=1, bm=64)  # a moe spec's fifth field
    with pytest.raises(ValueError, match="override"):
        tiling_overrides("stages=4")


def test_ncu_raw_parsing():
    """bench.ncu's summary of Nsight Compute's raw CSV page: units converted, short launches dropped, the largest
    stall reasons first, metrics missing from the report left blank."""
    from pallas_kernels.bench.ncu import parse_raw

    names = [
        "ID",
        "Kernel Name",
        "gpu__time_duration.sum",
        "dram__throughput.avg.pct_of_peak_sustained_elapsed",
        "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
        "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
        "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio",
        "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
        "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
        "sm__pipe_tensor_op_imma_cycles_active.avg.pct_of_peak_sustained_active",
    ]
    text = "\n".join(
        [
            '"==PROF== Connected to process"',
            ",".join(f'"{n}"' for n in names),
            '"","","usecond","%","ratio","ratio","ratio","%","%","%"',
            '"0","mosaic_gpu_kernel","84.20","71.5","0.50","3.25","1,250.00","0","61.25","72.50"',
            '"1","convert_fusion","2.10","10.0","0","0","0","0","0","0"',
        ]
    )
    (row,) = parse_raw(text, min_us=5.0, top=2)
    assert row["kernel"] == "mosaic_gpu_kernel" and row["us"] == 84.2 and row["DRAM %"] == 71.5
    assert row["tensor %"] == 72.5  # the busiest tensor sub-pipe (int8 wgmmas count as "imma" on the H200)
    assert row["SM %"] == "" and row["top stalls (warps per issue)"] == "wait 1250.00, long_scoreboard 3.25"
    assert parse_raw("no table here") == []
    odd = text.replace('"usecond","%"', '"usecond","%"').replace(
        "dram__throughput.avg.pct_of_peak_sustained_elapsed", "dram__bytes.sum.per_second"
    )
    odd = odd.replace('"","","usecond","%"', '"","","usecond","Kbyte/second"')
    (row,) = parse_raw(odd, min_us=5.0)
    assert row["DRAM TB/s"] == "? 71.5 Kbyte/second"  # a unit it does not know is shown, not scaled as TB/s


def test_repeats_exactly_tells_a_changing_output():
    """The benches' race check: outputs (any pytree) equal bit for bit over further runs, or not; a changed leaf of
    one run, or a different tree, is a difference."""
    from hcfjax.bench.common import repeats_exactly

    x = jnp.arange(6.0).reshape(2, 3)
    same = lambda x: (x * 2, {"s": x.sum()})  # noqa: E731
    assert repeats_exactly(same, (x,), same(x))
    runs = iter(range(1, 10))
    drifting = lambda x: (x * 2, {"s": x.sum() + (next(runs) == 2) * 1e-6})  # noqa: E731 - the second rerun differs
    assert not repeats_exactly(drifting, (x,), same(x))
    assert not repeats_exactly(lambda x: x * 2, (x,), same(x))
    nan = lambda x: x.at[0, 0].set(jnp.nan)  # noqa: E731 - the same NaN every run is not a race
    assert repeats_exactly(nan, (x,), nan(x))
    assert not repeats_exactly(lambda x: -0.0 * x, (x,), 0.0 * x)  # -0 and 0 differ in their bits


def test_kernel_seconds_from_trace_planes():
    """bench.moe --kernel-time's reading of a profiler trace: the GPU plane's stream lines summed per kernel name and
    call; the "XLA Ops" line (the same time under the ops' names), host planes, copies and memsets left out. And
    kernel_times is empty on a backend without a GPU."""
    from types import SimpleNamespace as NS

    import jax
    import jax.numpy as jnp

    from hcfjax.bench.common import kernel_seconds, kernel_time, kernel_times

    ev = lambda name, us: NS(name=name, duration_ns=us * 1e3)  # noqa: E731
    gpu = NS(
        name="/device:GPU:0",
        lines=[
            NS(name="Stream #14(Compute)", events=[ev("fused_gemm", 70), ev("fused_gemm", 74), ev("MemcpyD2D", 9)]),
            NS(name="Stream #15(Compute)", events=[ev("quantize_fusion", 4), ev("memset32", 1)]),
            NS(name="XLA Ops", events=[ev("custom-call.1", 144)]),
        ],
    )
    host = NS(name="/host:CPU", lines=[NS(name="python", events=[ev("fused_gemm", 1000)])])
    per = kernel_seconds([gpu, host], reps=2)
    assert per == pytest.approx({"fused_gemm": 72e-6, "quantize_fusion": 2e-6})
    # Another device's plane with less kernel time is not added in (one call's time is one device's); a plane
    # without stream lines gives nothing (its other lines repeat kernel time under op names)
    other = NS(name="/device:GPU:1", lines=[NS(name="Stream #3(Compute)", events=[ev("fused_gemm", 20)])])
    assert kernel_seconds([other, gpu, host], reps=2) == pytest.approx(per)
    bare = NS(
        name="/device:GPU:0",
        lines=[NS(name="XLA Modules", events=[ev("jit_f", 9)]), NS(name="Framework Ops", events=[ev("k", 3)])],
    )
    assert kernel_seconds([bare]) == {}
    if jax.default_backend() == "cpu":
        assert kernel_times(jax.jit(lambda x: x * 2), jnp.ones(8), reps=2) == {}
        with pytest.raises(RuntimeError, match="no GPU kernels"):
            kernel_time(jax.jit(lambda x: x * 2), jnp.ones(8), reps=2)


def test_hlo_names_finds_a_fusions_source(tmp_path):
    """bench.hlo_names resolves a profile's kernel name (`loop_..._fusion_N`, HLO's `%..fusion.N`) in an XLA dump to the
    jax op at its root, the source line that made it (through the module's stack-frame tables) and the ops inside."""
    import subprocess
    import sys

    from hcfjax.bench.hlo_names import describe, fusion_sources

    script = tmp_path / "make_fusion.py"
    script.write_text(
        "import jax, jax.numpy as jnp\n"
        "def scaled_max(x):\n"
        "    return jnp.max(jnp.exp(x) * 2, axis=1) + 1\n"
        "jax.jit(scaled_max)(jnp.ones((4, 8)))\n"
    )
    env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={tmp_path / 'dump'} --xla_dump_hlo_as_text", JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, str(script)], env=env, check=True, timeout=120)
    text = "\n".join(p.read_text() for p in (tmp_path / "dump").glob("*jit_scaled_max*after_optimizations.txt"))
    (name,) = {m.replace(".", "_") for m in re.findall(r"%(\w*fusion[\w.]*) = ", text)}
    (hit,) = fusion_sources(tmp_path / "dump", [name])[name]
    assert hit.startswith("jit_scaled_max: f32[4]")
    assert "make_fusion.py:3 (scaled_max)" in hit
    assert "ops: add, exp, mul, reduce_max" in hit
    assert describe(tmp_path / "dump", ["no_such_fusion"]) == [
        "no_such_fusion:",
        "  (not in any *after_optimizations.txt)",
    ]


def test_ncu_keeps_what_it_did_not_write(tmp_path):
    """bench.ncu works in a fresh folder of its own under --out and removes only that: files already there stay
    (an --out of the repository once would have been packed and deleted), and the archive holds its logs."""
    import tarfile

    from pallas_kernels.bench.ncu import main

    (tmp_path / "keep.txt").write_text("mine")
    main(["--out", str(tmp_path), "--ncu", "false", "--kernels", "mla:bf16"])  # an ncu that fails at once
    assert (tmp_path / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt", "ncu.tar.gz"]
    with tarfile.open(tmp_path / "ncu.tar.gz") as tar:
        assert tar.getnames() == ["ncu/mla_bf16.log"]


@pytest.mark.usefixtures("_reset_interpreter")
def test_gated_kernel_quantises_its_output_for_the_down_projection_interpret():
    """w4a8 gate/up with quant_out: the kernel writes the SiLU product as int8 per row and 128 channels with its
    scales (no XLA pass before the down projection), exactly quantize_int8_groups of its own bf16 product (an empty
    group, a partial block, rows past the groups, two groups per N tile); the down projection takes those per-group
    scales and matches the reference given the same operands."""
    from hcfjax.quant import quantize_int8_groups
    from pallas_kernels.moe_int4 import HS_PAD, int4_gated_ragged_dot, int4_gated_reference, int4_ragged_dot
    from pallas_kernels.moe_int4_tiling import Tiling

    k, n, sizes = 256, 256, [9, 0, 30]
    e, m = len(sizes), sum(sizes) + 2
    kg, ku, kd = jax.random.split(jax.random.key(7), 3)
    qg, qu = (quant.quantize(jax.random.normal(kk, (e, k, n)) / 4, 4, "int8") for kk in (kg, ku))
    qd = quant.quantize(jax.random.normal(kd, (e, n, k)) / 4, 4, "int8")
    x = jax.random.normal(jax.random.key(2), (m, k)).astype(jnp.bfloat16)
    gs = jnp.array(sizes, jnp.int32)
    gate, up = (qg.q, qg.scale), (qu.q, qu.scale)
    t = Tiling(16, 256, 2)
    h = int4_gated_ragged_dot(x, gate, up, gs, act="int8", interpret=True, tiling=t)
    hq, hs = int4_gated_ragged_dot(x, gate, up, gs, act="int8", interpret=True, tiling=t, quant_out=True)
    assert hq.shape == (m, n) and hq.dtype == jnp.int8 and hs.shape[0] == n // 128 and hs.shape[1] >= m + HS_PAD
    want_q, want_s = quantize_int8_groups(h)
    np.testing.assert_array_equal(np.asarray(hq), np.asarray(want_q))
    np.testing.assert_array_equal(np.asarray(hs[:, :m]), np.asarray(want_s))
    ref_q, ref_s = int4_gated_reference(x, gate, up, gs, "int8", quant_out=True)  # bf16-rounding away from it
    got, want = (np.asarray(quant.dequantize_int8_groups(*pair)) for pair in ((hq, hs), (ref_q, ref_s)))
    np.testing.assert_allclose(got, want, atol=0.02 * np.abs(want).max())
    y = int4_ragged_dot(h, qd.q, qd.scale, gs, act="int8", interpret=True, tiling=Tiling(16, 128, 2), x_q=(hq, hs))
    ref = np.asarray(quant.ragged_dot_reference(h, qd, gs, x_q=(hq, hs)), np.float32)
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, atol=1e-2 * np.abs(ref).max(), rtol=1e-2)
    assert not np.asarray(y, np.float32)[sum(sizes) :].any()
    per_token = np.asarray(quant.ragged_dot_reference(h, qd, gs), np.float32)  # finer scales, the same product
    np.testing.assert_allclose(ref, per_token, atol=0.03 * np.abs(per_token).max())


@pytest.mark.parametrize("e, m, k, n", [(16, 128, 7168, 2048), (64, 126, 2048, 1408)])  # V2-Lite: 21 x top-6
def test_quantised_output_and_group_scales_lower_for_hopper(e, m, k, n):
    """The GPU path of quant_out (the int8 pass through inline Mosaic GPU code, the scales' scalar stores) and of
    the down projection's per-group scales lower for sm_90 at V3's and V2-Lite's decode shapes."""
    from pallas_kernels.cross_lower import lower_for_hopper
    from pallas_kernels.moe_int4 import _hs_rows, int4_gated_ragged_dot, int4_ragged_dot

    s = jax.ShapeDtypeStruct
    w = (s((e, n, k // 2), jnp.uint8), s((e, k // 128, n), jnp.float32))
    gs = s((e,), jnp.int32)
    f = lambda x, g, u, gs: int4_gated_ragged_dot(x, g, u, gs, act="int8", quant_out=True)  # noqa: E731
    assert "mosaic_gpu" in lower_for_hopper(f, s((m, k), jnp.bfloat16), w, w, gs)
    wd = (s((e, k, n // 2), jnp.uint8), s((e, n // 128, k), jnp.float32))
    x_q = (s((m, n), jnp.int8), s((n // 128, _hs_rows(m)), jnp.float32))
    f2 = lambda x, q, sc, gs, x_q: int4_ragged_dot(x, q, sc, gs, act="int8", x_q=x_q)  # noqa: E731
    assert "mosaic_gpu" in lower_for_hopper(f2, s((m, n), jnp.bfloat16), *wd, gs, x_q)
