"""The int4 MoE kernels (pallas_kernels/moe_int4.py) against the reference, run by Mosaic GPU's interpreter on the
CPU; and the kernels' register-level bit tricks run on numpy."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hcfjax import quant
from hcfjax.cache import quantize_int8
from tests.conftest import make_tiling

# The references jitted: one compiled program per shape, not one per op (w4a8's is ~40 ops, ~1 s a call op by op);
# the results are the op-by-op ones, bit for bit, at these shapes.
ragged_dot_reference = jax.jit(quant.ragged_dot_reference)


def gated_reference(x, gate, up, group_sizes, act="bf16", quant_out=False):
    from pallas_kernels.moe_int4 import int4_gated_reference

    return jax.jit(int4_gated_reference, static_argnames=("act", "quant_out"))(
        x, gate, up, group_sizes, act=act, quant_out=quant_out
    )


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


KERNEL_CASES = [  # k, n, sizes, tiling (bm, bn, stages[, extra])
    (256, 128, [5, 0, 20, 3], (16, 128, 2)),  # a group across two blocks, the last tile past M (zero-filled by the TMA)
    (128, 64, [0, 17, 0, 40], None),
    # two blocks of one group, groups starting off the 8-row grid, narrower blocks where they fit (48 rows, then 32,
    # the one-row group and the rows past the groups at 16)
    (128, 64, [70, 1, 0, 9], (48, 64, 3, {"narrow": True})),
    (128, 64, [3, 2], (16, 64, 2)),  # M < bm (x padded to one block)
    (512, 256, [9, 30, 0, 2], (32, 256, 2, {"gps": 2})),  # four 64-row tiles, two K groups per step
    (384, 128, [9, 30, 0, 2], (16, 128, 2, {"gps": 2})),  # three K groups in two steps: the last past K, zeros
    # A through smem, unpacked with int16 ops, each tile just before its wgmmas
    (256, 128, [5, 0, 20, 3], (16, 64, 4, {"a_regs": False, "inline": False, "unpack_first": False})),
    (256, 128, [5, 0, 20, 3], (16, 128, 1, {"splits": 2})),  # split-K: f32 partials of two K halves, summed after
    (128, 64, [0, 1, 0, 0, 2, 0, 0, 9, 1] + [0] * 7, (16, 64, 2)),  # more experts than rows: the grid's tighter bound
]


@pytest.mark.usefixtures("reset_interpreter")
@pytest.mark.parametrize("act", ["bf16", "int8"])
@pytest.mark.parametrize("k, n, sizes, tiling", KERNEL_CASES)
def test_kernel_matches_reference_interpret(k, n, sizes, tiling, act):
    """The Mosaic GPU kernel, run by its interpreter: empty groups, sizes not multiples of the token block, rows past
    sum(group_sizes), several K/N and tilings; x unpadded, the output written in x's row order. Equal to the reference
    up to the weights' bf16 scale and one bf16 rounding of the output (w4a16), exact sums (w4a8)."""
    from pallas_kernels.moe_int4 import int4_ragged_dot

    e, m = len(sizes), sum(sizes) + 3
    rng = np.random.default_rng(k + n)  # (numpy: no program to compile per shape)
    w = jnp.asarray(rng.standard_normal((e, k, n), np.float32) / 16)
    x = jnp.asarray(rng.standard_normal((m, k), np.float32).astype(jnp.bfloat16))
    gs = jnp.array(sizes, jnp.int32)
    qw = quant.quantize(w, 4, act)
    t = make_tiling(tiling)
    ref = np.asarray(ragged_dot_reference(x, qw, gs), np.float32)
    y = np.asarray(int4_ragged_dot(x, qw.q, qw.scale, gs, act=act, interpret=True, tiling=t), np.float32)
    np.testing.assert_allclose(y, ref, atol=1e-2 * np.abs(ref).max(), rtol=1e-2)
    assert not y[sum(sizes) :].any()


@pytest.mark.usefixtures("reset_interpreter")
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


@pytest.mark.usefixtures("reset_interpreter")
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
    ref = np.asarray(ragged_dot_reference(x, qw, gs), np.float32)
    t = Tiling(32, 64, 2, gps=2)
    y = np.asarray(int4_ragged_dot(x, qw.q, qw.scale, gs, act=act, interpret=True, tiling=t), np.float32)
    np.testing.assert_allclose(y, ref, atol=1e-2 * np.abs(ref).max(), rtol=1e-2)


@pytest.mark.usefixtures("reset_interpreter")
@pytest.mark.parametrize("act", ["bf16", "int8"])
def test_gated_kernel_matches_reference_interpret(act):
    """silu(x @ Wg) * (x @ Wu) in one kernel (two weights, one token tile), with an empty group and a partial block."""
    from pallas_kernels.moe_int4 import int4_gated_ragged_dot
    from pallas_kernels.moe_int4_tiling import Tiling

    k, n, sizes = 256, 128, [9, 0, 30]
    e, m = len(sizes), sum(sizes) + 2
    kg, ku = jax.random.split(jax.random.key(7))
    qg, qu = (quant.quantize(jax.random.normal(kk, (e, k, n)) / 4, 4, act) for kk in (kg, ku))
    x = jax.random.normal(jax.random.key(2), (m, k)).astype(jnp.bfloat16)
    gs = jnp.array(sizes, jnp.int32)
    gate, up = (qg.q, qg.scale), (qu.q, qu.scale)
    ref = np.asarray(gated_reference(x, gate, up, gs, act), np.float32)
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


@pytest.mark.usefixtures("reset_interpreter")
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
    exact = np.asarray(ragged_dot_reference(x, qw, gs), np.float32)
    np.testing.assert_allclose(y, exact, atol=1e-2 * np.abs(exact).max(), rtol=1e-2)
    assert not y[sum(sizes) :].any()
    gated = lambda t: np.asarray(  # noqa: E731
        int4_gated_ragged_dot(x, (qg.q, qg.scale), (qu.q, qu.scale), gs, act="int8", interpret=True, tiling=t)
    )
    np.testing.assert_array_equal(gated(dataclasses.replace(ws, narrow=False)), gated(one))


@pytest.mark.usefixtures("reset_interpreter")
def test_gated_kernel_quantises_its_output_for_the_down_projection_interpret():
    """w4a8 gate/up with quant_out: the kernel writes the SiLU product as int8 per row and 128 channels with its
    scales (no XLA pass before the down projection), exactly quantize_int8_groups of its own bf16 product (an empty
    group, a partial block, rows past the groups, two groups per N tile); the down projection takes those per-group
    scales and matches the reference given the same operands, also over an odd number of K groups two per step."""
    from hcfjax.quant import quantize_int8_groups
    from pallas_kernels.moe_int4 import HS_PAD, int4_gated_ragged_dot, int4_ragged_dot
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
    ref_q, ref_s = gated_reference(x, gate, up, gs, "int8", quant_out=True)  # bf16-rounding away from it
    got, want = (np.asarray(quant.dequantize_int8_groups(*pair)) for pair in ((hq, hs), (ref_q, ref_s)))
    np.testing.assert_allclose(got, want, atol=0.02 * np.abs(want).max())
    y = int4_ragged_dot(h, qd.q, qd.scale, gs, act="int8", interpret=True, tiling=Tiling(16, 128, 2), x_q=(hq, hs))
    ref = np.asarray(ragged_dot_reference(h, qd, gs, x_q=(hq, hs)), np.float32)
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, atol=1e-2 * np.abs(ref).max(), rtol=1e-2)
    assert not np.asarray(y, np.float32)[sum(sizes) :].any()
    per_token = np.asarray(ragged_dot_reference(h, qd, gs), np.float32)  # finer scales, the same product
    np.testing.assert_allclose(ref, per_token, atol=0.03 * np.abs(per_token).max())
    # three K groups in two pipeline steps (V2-Lite's down projection is eleven): the last step's TMAs run past K
    # for the weights, their scales, the tokens and the tokens' per-group scales, and must add nothing
    h3 = jnp.concatenate([h, h[:, :128]], axis=1)
    hq3, hs3 = quantize_int8_groups(h3)
    hs3 = jnp.pad(hs3, ((0, 0), (0, HS_PAD)))
    qd3 = quant.quantize(jax.random.normal(kd, (e, 3 * 128, k)) / 4, 4, "int8")
    t3 = Tiling(16, 128, 2, gps=2)
    y3 = int4_ragged_dot(h3, qd3.q, qd3.scale, gs, act="int8", interpret=True, tiling=t3, x_q=(hq3, hs3))
    ref3 = np.asarray(ragged_dot_reference(h3, qd3, gs, x_q=(hq3, hs3)), np.float32)
    np.testing.assert_allclose(np.asarray(y3, np.float32), ref3, atol=1e-2 * np.abs(ref3).max(), rtol=1e-2)
