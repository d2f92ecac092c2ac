"""The int4 MoE kernels' tiling (pallas_kernels/moe_int4_tiling.py): block tables, default tilings and their
register and shared-memory bounds; and the kernels lowered for sm_90 on the CPU."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.conftest import make_tiling


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
    # A few groups as one compiled program (XLA compiles each op anew for each table width, ~0.4 s a case); many
    # groups op by op, since the program unrolls a loop over the groups and compiles slower than the ops do.
    table = jax.jit(block_table, static_argnums=(1, 2)) if e <= 16 else block_table
    t = np.asarray(table(jnp.array(sizes, jnp.int32), m, bm))
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
            # except where one block holds an average expert's rows but not the spread (one compute warpgroup)
            one_block = m / e + 8 <= t.bm < m / e + 2 * (m / e) ** 0.5 + 8
            long_k = act == "int8" and nw == 2 and t.bm >= 80 and k // 128 >= 32
            assert (t.wgs == 2) == (long_k and not one_block), (e, m, k, n, nw, t)
    assert block_widths(Tiling(80, 128, 2, narrow=True)) == (16, 32, 48, 64, 80)
    assert block_widths(Tiling(160, 64, 2, narrow=True)) == (96, 112, 128, 144, 160)
    assert block_widths(Tiling(80, 128, 2)) == (80,)


def test_fused_kernel_takes_one_block_where_the_mean_fits():
    """At 64 rows per expert (V3's gate/up shape) the fused w4a8 kernel takes each expert's rows in one 80-row block
    on one compute warpgroup, the few experts past 72 rows a second, narrow one, where blocks sized for the spread
    (48 rows) took two per expert; the single-weight kernel (128 weight rows per CTA: half the CTAs) keeps them, and
    so do more rows per expert."""
    from pallas_kernels.moe_int4_tiling import default_tiling

    for e in (8, 32, 256):
        fused = default_tiling("int8", 64 * e, 2048, 56, e, nw=2)
        assert (fused.bm, fused.wgs, fused.narrow) == (80, 1, True)
        assert default_tiling("int8", 64 * e, 2048, 56, e, nw=1).bm == 48
    assert default_tiling("int8", 80 * 8, 2048, 56, 8, nw=2).bm == 64  # 80 + 8 rows: two blocks of the spread's size


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

    t = make_tiling(tiling)
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

    from jax.experimental.mosaic.gpu import core

    from pallas_kernels.cross_lower import lower_for_hopper
    from pallas_kernels.moe_int4 import int4_gated_ragged_dot, int4_ragged_dot
    from pallas_kernels.moe_int4_tiling import smem_bytes

    monkeypatch.setattr(core, "_SMEM_SIZE_BOUND", 1)  # Mosaic then reports its smem count in the error
    t = make_tiling(tiling)
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
