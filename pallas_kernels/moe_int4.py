"""Int4 MoE grouped GEMM (w4a16, w4a8): a Mosaic GPU (Hopper) kernel, its wrapper, and the pure-jnp reference.

The function is `jax.lax.ragged_dot(x, W, group_sizes)` with W the int4 experts of a `hcfjax.quant.QWeight`:
x [M, K] rows sorted by expert, q [E, N, K/2] packed int4, scale [E, K/G, N] f32 (G = 128), group_sizes [E].
hcfjax/quant.py documents the layout; within each K group of G, byte j holds k = j (low nibble) and k = j + G/2
(high nibble), so one group's packed bytes unpack into two contiguous K halves without any shuffle.

Kernel layout (the product is computed transposed, out^T = W^T x^T, so the weight tile is wgmma's A operand and the
token tile, read K-major, its B operand, as int8 wgmma requires):
  grid (N/bn, token blocks); a CTA is one warpgroup (with Tiling.wgs = 2, the fused kernel's prefill default: two
  compute warpgroups with bn/2 weight rows each against one token tile, and a third that issues the pipeline's
  TMAs). x is not copied (only padded to whole 8-row tiles when M is not a multiple of 8): each CTA finds its
  token block from group_sizes (`block_info`, a few scalar ops per expert): its expert and a bm-row tile of x at a
  row offset (a multiple of 8); the block owns the rows of its tile that are its expert's (a tile may reach into the
  neighbouring groups, whose rows it computes and drops; past M the TMA loads zeros). Rows past sum(group_sizes)
  form one more group whose blocks store zeros; unused blocks exit at once. `Tiling` says how big a CTA's tile is
  and how deep its pipeline; with Tiling.narrow (w4a8 prefill) a block that needs fewer rows than bm (a group's
  last) runs the same code at the narrowest multiple of 16 that holds them (`block_widths`).
  A pipeline of `stages` steps over the K groups (`gps` groups a step) TMA-loads per step the packed tiles
  [bn, gps G/2], their scales [gps, bn] (contiguous: the scales are stored K-group-major) and the token tile
  [bm, gps G]. Each 64-row packed tile is loaded into registers in the layout of a wgmma A operand and unpacked there
  with integer and bf16x2 ops (int4_unpack.py: no conversion instructions, no smem round trip), then
    w4a16: two bf16 wgmmas (the group's K halves, weights scaled in bf16) accumulate into f32 accumulators that live
           across the pipeline;
    w4a8:  two int8 wgmmas (16 q x int8 tokens, pre-quantised per token) into int32 accumulators started at MAGIC,
           so that the int32 sum's bits read as the f32 1.5 * 2^23 + sum (no int -> float conversion), then added to
           the f32 accumulators times the group scales / 16; the token scales ([bm] f32, copied once into a buffer of
           their own) multiply the result at the end (per-group token scales, the down projection's in the model:
           each group's partial times both scales, in two FFMAs).
  Each step waits for its wgmmas (their A registers are then free; w4a8 still reads the step's scales from the slot
  in its fold, and fences before the slot's refill); a CTA's unpacking overlaps other CTAs' MMAs (2 to 4 CTAs per
  SM).
  int4_gated_ragged_dot runs the same loop over two weights (gate, up) with two sets of accumulators and one token
  tile, and writes silu(gate) * up (f32, rounded once): the expert MLP's first half in one kernel.
  Split-K (Tiling.splits > 1, decode calls with few output tiles): a third grid axis gives each CTA a slice of the
  K groups, and the CTA stores its f32 partials (gate and up side by side, before SiLU) to [splits, M, nw N], which
  the wrapper sums in one XLA fusion.
  The f32 tile out^T [bn, bm] is stored transposed into an untiled bf16 smem tile [bm, bn] that reuses the
  pipeline's buffers, and only the block's rows go to out [M, N] in x's row order, by TMA stores of power-of-two row
  counts (as jax's ragged_dot_mgpu.py does: a TMA box has a static size). No XLA pass after the kernel; before it
  only, for w4a8, the per-token int8 quantisation of x (one fused pass; in the kernel it would be
  redone by every one of the N/bn CTAs that share a token tile, and each needs the token's max over all of K first).
Shared memory per CTA is `smem_bytes`; docs/kernels.md has the configurations and the reasoning behind `default_tiling`.

w4a16 with few rows per expert (`digits_pay`) runs on the w4a8 kernel instead (`int4_ragged_dot_digits`): each row of
x becomes two rows of int8 digits, the row and its quantisation residual, both quantised per 128 channels, and each
pair's products are summed in the epilogue (Tiling.pairs, before gate/up's SiLU: the fused kernel runs w4a16's
gate/up too). Unpacking for the int8 MMAs costs a fraction of the bf16 one, and while the doubled rows still fit
16-row token blocks the MMAs take no more columns.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from hcfjax.cache import quantize_int8
from hcfjax.quant import QWeight, dequantize_int8_groups, quantize_int8_groups, ragged_dot_reference
from pallas_kernels.int4_unpack import bf16_halves, int8_halves
from pallas_kernels.int_sums import MAGIC, MAGIC_F  # a w4a8 K group's sum: 128 products of |16 q| <= 128 and |x| <= 127

BN = 64  # weight rows of one wgmma (its M dimension); a CTA takes 1, 2 or 4 such tiles
KC = 64  # K per wgmma call: one 64-byte packed column tile, one K half of a 128 group
ACTS = ("bf16", "int8")
QGROUP = 128  # channels per scale of the gate/up kernel's quantised output (qout), the down projection's K group
ROW_ALIGN = 8  # a token tile starts at a multiple of 8 rows: its smem copy is tiled in 8-row tiles, and the TMA of a
# tiled copy addresses x in whole tiles (Mosaic's layout inference rejects other dynamic row offsets)
HS_PAD = 256 + ROW_ALIGN  # rows past M in the quantised output's scales: enough for any down projection's block
SMEM_LIMIT = 227 * 1024  # bytes of shared memory a CTA may opt into on Hopper (H100, H200)
SMEM_PER_SM = 228 * 1024  # shared by the CTAs of an SM, each also holding 1 KiB for the system
REGS = 192  # registers per thread a default tiling may pin (`regs`; 2 CTAs per SM leave each thread 255)
MEMORY_REGS = 40  # registers per thread of a warp-specialised tiling's memory warpgroup (t.wgs > 1)
SMS = 132  # streaming multiprocessors of an H100 / H200 (default_tiling's split-K choice)
UNPACK_FIRST_REGS = 224  # `regs` up to which a w4a8 step unpacks all its tiles first (Tiling.unpack_first)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How a call is cut into CTAs and pipeline steps (`default_tiling`; `legacy_tiling`: the first version's)."""

    bm: int  # token rows per block: the wgmma N, a multiple of 16 in [16, 256]
    bn: int  # weight rows (output features) per CTA: 64, 128 or 256
    stages: int  # pipeline steps in flight
    gps: int = 1  # K groups per pipeline step (one TMA per operand per step)
    a_regs: bool = True  # unpacked weights go to wgmma from registers; False: through smem, as the first version did
    inline: bool = True  # unpack with int4_unpack's inline_mgpu bit tricks; False: the same values from int16 ops
    # (widening conversions, as the first version; the interpreter's only way)
    splits: int = 1  # K splits (split-K): CTAs per output tile, each over 1/splits of the K groups, writing an f32
    # partial that the wrapper sums (decode: more CTAs, so more loads in flight, where one K loop per tile is too few)
    unpack_first: bool = True  # w4a8: unpack every tile of a step before its first wgmma; False: each tile just before
    # its own wgmmas, the order before 2026-11-30, which ptxas serialised (kept for the bench's comparison)
    narrow: bool = False  # a block whose rows (its offset in the tile plus its count) fit a narrower multiple of 16
    # runs at that width (`block_widths`): a group's last block computes, loads and stores only what it needs
    wgs: int = 1  # w4a8: compute warpgroups per CTA, each taking bn / wgs of the weight rows against the same token
    # tile, their loads issued by one more warpgroup (a warp-specialised pipeline; one CTA per SM): where two CTAs of
    # bn / 2 rows would each load the token tile, this loads it once (`default_tiling` says where it pays)
    pairs: bool = False  # w4a8: token rows come in pairs (2i, 2i + 1: int8 digits of one row, `int8_digits`) whose
    # products are summed in the epilogue, the sum written to both rows (the caller keeps the even ones)

    @property
    def tiles(self) -> int:
        """64-row weight tiles per compute warpgroup."""
        return self.bn // self.wgs // BN


def int4_ragged_dot_reference(x, q, scale, group_sizes, act="bf16"):
    """The kernel's function in plain jnp (hcfjax.quant's reference): x [M, K] -> [M, N] in x's dtype."""
    return ragged_dot_reference(x, QWeight(q, scale, 4, act), group_sizes)


def supports(x, q, scale) -> bool:
    """Whether the kernel takes these operands (else callers use the reference): bf16 x, N a multiple of 64, the
    int4 group a multiple of 128."""
    k = x.shape[-1]
    return x.dtype == jnp.bfloat16 and q.shape[-2] % BN == 0 and (k // scale.shape[-2]) % (2 * KC) == 0


def _transforms(cols: int, itemsize: int):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    sw = cols * itemsize  # 64 or 128 bytes: one swizzle span per KC columns
    return (plgpu.TilingTransform((8, sw // itemsize)), plgpu.SwizzleTransform(sw))


def _kernel(act, g, ksteps, nw, m, n_experts, t: Tiling, fast: bool, xgroups: bool, qout: bool, gs_ref, *refs):
    """nw = 1: out^T = W^T x^T; nw = 2 (gate, up): out^T = silu(Wg^T x^T) * (Wu^T x^T), both from one token tile. gs_ref
    [E] int32: the group sizes, from which the CTA finds its block (`block_info`). fast: the GPU's unpacking and
    accumulator start (False: int16 ops and an added MAGIC, as GPU interpret mode needs). ksteps: pipeline steps of
    one K split. With t.splits > 1 the CTA's K split is its third grid index, and it writes f32 partials [splits, M,
    nw N] (gate and up side by side, no SiLU: the wrapper sums the splits first). xgroups (w4a8): x's scales are per
    row and K group, [K/G, M'] (a block of them per pipeline step, applied to each group's partial) instead of per
    row. qout (gate/up): the output is the SiLU product quantised per row and 128 channels, int8 [M, N] and its
    scales [N/128, M'] (`store_quantized`)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    w_refs, s_refs = refs[0 : 2 * nw : 2], refs[1 : 2 * nw : 2]
    x_ref, *rest = refs[2 * nw :]
    xs_ref, o_ref, *rest = rest if act == "int8" else (None, *rest)
    hs_ref, *rest = rest if qout else (None, *rest)
    xs_smem, xs_bar, *rest = rest if act == "int8" and not xgroups else (None, None, *rest)
    a_smem = None if t.a_regs else rest[0]  # [one K chunk's wgmmas, 64, KC]: A operands through smem
    sizes = [gs_ref[i] for i in range(n_experts)]
    ni, mi, k0 = lax.axis_index("n"), lax.axis_index("m"), lax.axis_index("k") * ksteps
    e, tile, off, count = block_info(sizes, mi, m, t.bm)
    tile = pl.multiple_of(tile, ROW_ALIGN)

    def body(t: Tiling):
        """The CTA's work with token blocks of t.bm rows (the grid's, or a narrower one for a block that needs
        fewer: `block_widths`)."""
        half, chunks = g // 2, g // 2 // KC
        row, col = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
        accs_n = nw * t.tiles  # accumulators: per weight, per 64-row tile (of this warpgroup's)
        # With t.wgs > 1 this warpgroup's weight rows of the CTA's tile start at row0 (the memory warpgroup, index
        # t.wgs, has none; it runs the pipeline's loads only).
        wg = lax.axis_index("wg") if t.wgs > 1 else 0
        wg_rows = t.bn // t.wgs
        row0 = pl.multiple_of(wg * wg_rows, BN) if t.wgs > 1 else 0

        def steps(x_smem, w_smems, s_smems):
            """Per wgmma pair of a step: (accumulator, K group j, packed tile [64, KC], scales ref [64], token
            halves)."""
            for j in range(t.gps):
                for c in range(chunks):
                    xh = [x_smem.at[:, pl.ds(j * g + hh * half + c * KC, KC)].transpose((1, 0)) for hh in range(2)]
                    for i in range(nw):
                        for h in range(t.tiles):
                            p = w_smems[i].at[pl.ds(row0 + h * BN, BN), pl.ds(j * half + c * KC, KC)]
                            yield i * t.tiles + h, j, c, p, s_smems[i].at[j, pl.ds(row0 + h * BN, BN)], xh

        def mma(acc, a, b, n_mma, hh):  # n_mma: the wgmma pair's index in the step; hh: the K half
            if t.a_regs:
                plgpu.wgmma(acc, a, b)
                return
            if n_mma and n_mma % accs_n == 0 and hh == 0:
                plgpu.wgmma_wait(0)  # the previous K chunk's wgmmas still read the slots (one chunk's worth)
            slot = 2 * (wg * accs_n + n_mma % accs_n) + hh
            a_smem[slot] = a
            plgpu.commit_smem()
            plgpu.wgmma(acc, a_smem.at[slot], b)

        def split(smems):  # the pipeline's step refs: (w, s) per weight, the token tile
            return smems[2 * nw], smems[0 : 2 * nw : 2], smems[1 : 2 * nw : 2]

        def bf16_step(acc_refs, idx, *smems):
            for n_mma, (a, _, _, p, s, xh) in enumerate(steps(*split(smems))):
                halves = bf16_halves(plgpu.load(p, layout=plgpu.Layout.WGMMA), plgpu.load(s, layout=row), fast)
                for hh in range(2):
                    mma(acc_refs[a], halves[hh], xh[hh], n_mma, hh)
            plgpu.wgmma_wait(0)  # frees the A registers and this step's slot (refilled after the body)

        def int8_step(idx, *smems_and_carry):
            *smems, accs = smems_and_carry
            accs, work = list(accs), list(steps(*split(smems)))

            def partials(*rs):  # one int32 partial per K chunk and accumulator, all issued before the one wait
                # With t.unpack_first every tile is unpacked (and every accumulator started) before the first wgmma:
                # unpacking between them let ptxas reuse an in-flight wgmma's A registers for the next tile, and it then
                # waited for that wgmma before each accumulator's MMAs (C7517 "wgmma.wait_group is injected"),
                # serialising the step's eight (fused) or four accumulator chains (docs/kernels.md).
                # Without it (registers too few), each tile is unpacked just before its own wgmmas.
                def unpack(r, p):
                    if fast:  # start at MAGIC (the interpreter cannot store to an accumulator: it adds MAGIC below)
                        r[...] = plgpu.layout_cast(jnp.full((BN, t.bm), MAGIC, jnp.int32), plgpu.Layout.WGMMA)
                    return int8_halves(plgpu.load(p, layout=plgpu.Layout.WGMMA_8BIT), fast)

                halves = (
                    [unpack(r, w[3]) for r, w in zip(rs, work, strict=True)] if t.unpack_first else [None] * len(rs)
                )
                for n_mma, (r, h, (*_, p, _, xh)) in enumerate(zip(rs, halves, work, strict=True)):
                    h = h or unpack(r, p)
                    for hh in range(2):
                        mma(r, h[hh], xh[hh], n_mma, hh)
                return tuple(r[...] for r in rs)

            parts = pl.run_scoped(partials, *[plgpu.ACC((BN, t.bm), jnp.int32)] * len(work))
            x_scales = {}  # xgroups: per K group of the step, its rows' scales as a [BN, bm] column broadcast
            by_row = functools.partial(lax.broadcast_in_dim, shape=(BN, t.bm), broadcast_dimensions=[0])
            for v, (a, j, _, _, s, _) in zip(parts, work, strict=True):
                bits = lax.bitcast_convert_type(v if fast else v + MAGIC, jnp.float32)  # 1.5 * 2^23 + the int32 sum
                s16 = plgpu.load(s, layout=row) * (1 / 16)  # [64]: this tile's rows' group scales
                if not xgroups:  # the exact sum (one FADD), then one FFMA with the group's scales
                    accs[a] = accs[a] + (bits - MAGIC_F) * by_row(s16)
                    continue
                if j not in x_scales:
                    sx = plgpu.load(smems[2 * nw + 1].at[j, pl.ds(0, t.bm)], layout=col)
                    x_scales[j] = lax.broadcast_in_dim(sx, (BN, t.bm), [1])
                # Per-group token scales make the scale a product per element (a row's times a column's). The magic
                # offset comes out in the FFMA that applies the weight's scale (bits * s16 - MAGIC_F * s16, the
                # constant per row), so two FFMAs do what the exact sum, the scales' product and an FFMA did
                # (docs/kernels.md). MAGIC_F * s16 is rounded to f32: an error below 0.9 units
                # of the group's integer sum where the compiler fuses the FMA (it may), 1.5 where it does not.
                accs[a] = accs[a] + (bits * by_row(s16) + by_row(s16 * -MAGIC_F)) * x_scales[j]
            # The fold's reads of the step's scales must be done before the slot is refilled: by this warpgroup's TMA
            # right after the body, behind a bar.sync alone, or with several warpgroups by the memory warpgroup's once
            # the consumed barrier's mbarrier arrivals are in. Neither orders the TMA's (async proxy) write after these
            # generic reads; PTX asks for a proxy fence. Without it the H200 gave wrong rows, different on every run,
            # once the fold above was rescheduled (docs/kernels.md; inferred from
            # the fix, not observed directly). One warpgroup: the fence and a warpgroup barrier. Several: the fence
            # alone (the arrivals follow it; the barrier had cost 2.6% there, the fence alone is level).
            if t.wgs == 1:
                plgpu.commit_smem()
            elif fast:  # (GPU interpret mode runs no inline_mgpu, and has no proxies to order)
                _proxy_fence()
            return tuple(accs)

        w_spec = plgpu.BlockSpec((t.bn, t.gps * half), lambda k: (ni, k0 + k), transforms=_transforms(KC, 1))
        s_spec = plgpu.BlockSpec((t.gps, t.bn), lambda k: (k0 + k, ni))
        # The token tile: bm rows of x (unpadded but for whole 8-row tiles) from row `tile` on (an element offset, a
        # multiple of 8, not a block index); rows outside this block's group are computed and never stored, rows past
        # M arrive as zeros.
        x_item = 2 if act == "bf16" else 1
        x_spec = plgpu.BlockSpec(
            (pl.Element(t.bm), t.gps * g), lambda k: (tile, k0 + k), transforms=_transforms(KC, x_item)
        )
        in_specs = [w_spec, s_spec] * nw + [x_spec]
        if xgroups:  # the step's K groups' scales for the token tile's rows (rounded up to 128 bytes per group)
            in_specs.append(plgpu.BlockSpec((t.gps, pl.Element(_xs_block(t.bm))), lambda k: (k0 + k, tile)))
        operands = [r.at[e] for pair in zip(w_refs, s_refs, strict=True) for r in pair] + [x_ref]
        operands += [xs_ref] if xgroups else []
        pipeline = functools.partial(
            plgpu.emit_pipeline, grid=(ksteps,), in_specs=in_specs, max_concurrent_steps=t.stages
        )

        partial = t.splits > 1
        n_out, o_dtype = (nw, jnp.float32) if partial else (1, jnp.bfloat16)
        o_gmem = o_ref.at[lax.axis_index("k")] if partial else o_ref
        n_cols = o_gmem.shape[1] // n_out  # N

        def rows_out(o_smem, ni, tile, off, count, width=t.bn):
            """The block's rows of o_smem [n_out, bm, bn] -> out. Only rows [off, off + count) of the tile are this
            block's (the others belong to the neighbouring groups' blocks). A TMA box has a static size, so they go out
            as a ladder of power-of-two row counts (count's binary digits), each from the smem row after the last (rows
            of bn x 2 >= 128 bytes, or bn int8 bytes: every start stays TMA-aligned)."""
            start, rows = off, 1 << (t.bm.bit_length() - 1)
            while rows:

                @pl.when(count & rows != 0)
                def _(start=start, rows=rows):
                    for i in range(o_smem.shape[0]):
                        dst = o_gmem.at[pl.ds(tile + start, rows), pl.ds(i * n_cols + ni * t.bn + row0, width)]
                        plgpu.copy_smem_to_gmem(o_smem.at[i, pl.ds(start, rows)], dst)

                start, rows = start + (count & rows), rows // 2
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        def store_quantized(accs, ni, tile, off, count):
            """qout: per row, each 128 channels of the SiLU product (bf16-rounded, as the reference quantises its bf16
            output) as int8 with one f32 scale (quantize_int8's arithmetic). The integers go through a bf16 tile (a
            transposed store, which Mosaic lays out for 16-bit values) into an int8 tile and out by `rows_out`; the
            scales, [count] f32 per group (below a TMA box's 16-byte minimum for short blocks), by one scalar store per
            row and group into hs [N/128, M']."""
            per, groups = QGROUP // BN, t.bn // QGROUP

            def scope(b_smem, q_smem, s_smem):  # [bm, bn] bf16, [1, bm, bn] int8, [groups, bm] f32
                # Layouts spelled out: Mosaic's layout search runs short of fuel in this kernel (the int8 pass runs
                # outside it, `_to_int8`).
                wg = lambda v: plgpu.layout_cast(v, plgpu.Layout.WGMMA)  # noqa: E731
                for j in range(groups):
                    vals = [wg(a.astype(jnp.bfloat16).astype(jnp.float32)) for a in accs[j * per : (j + 1) * per]]
                    amax = functools.reduce(
                        jnp.maximum, [plgpu.layout_cast(wg(jnp.abs(v)).max(axis=0), col) for v in vals]
                    )
                    scale = plgpu.layout_cast(jnp.maximum(amax, 1e-8) / 127.0, col)  # [bm]: per row
                    s_smem.at[j][...] = scale
                    sb = wg(lax.broadcast_in_dim(scale, (BN, t.bm), [1]))
                    for h, v in enumerate(vals):
                        # integers: exact in bf16
                        qv = wg(jnp.clip(jnp.round(v / sb), -127.0, 127.0).astype(jnp.bfloat16))
                        b_smem.at[:, pl.ds((j * per + h) * BN, BN)].transpose((1, 0))[...] = qv
                plgpu.commit_smem()
                _to_int8(b_smem, q_smem.at[0], fast)
                plgpu.commit_smem()
                rows_out(q_smem, ni, tile, off, count)

                @pl.loop(0, count)
                def _(i):
                    for j in range(groups):
                        hs_ref[ni * groups + j, tile + off + i] = s_smem[j, off + i]

            pl.run_scoped(
                scope,
                plgpu.SMEM((t.bm, t.bn), jnp.bfloat16),
                plgpu.SMEM((1, t.bm, t.bn), jnp.int8),
                plgpu.SMEM((groups, t.bm), jnp.float32),
            )

        def store(accs, ni, tile, off, count, o_tile=None):
            """out^T [64, bm] f32 per 64-row tile and output -> the block's rows of out [M, n_out N], through o_tile
            (a compute warpgroup's, t.wgs > 1) or a tile allocated after the pipeline, in its buffers."""

            def scope(o_smem):  # [n_out, bm, bn] bf16 (f32 partials), untiled
                for i in range(n_out):
                    for h, out in enumerate(accs[i * t.tiles : (i + 1) * t.tiles]):
                        if partial:  # Mosaic infers a transposed store's layout for 16-bit values only; f32 is cast
                            out = plgpu.layout_cast(out, plgpu.Layout.WGMMA_TRANSPOSED)
                        o_smem.at[i, :, pl.ds(h * BN, BN)].transpose((1, 0))[...] = out.astype(o_dtype)
                plgpu.commit_smem()
                rows_out(o_smem, ni, tile, off, count, wg_rows)

            if o_tile is not None:
                scope(o_tile)
            else:
                pl.run_scoped(scope, plgpu.SMEM((n_out, t.bm, t.bn), o_dtype))

        def finish(accs, o_tile=None):
            if nw == 2 and not partial:
                accs = _silu_mul(accs, t.tiles)
            if qout:
                store_quantized(accs, ni, tile, off, count)
            else:
                store(accs, ni, tile, off, count, o_tile)

        def blocks(o_ws=None):
            """The block's pipeline and epilogue; o_ws [wgs, n_out, bm, bn / wgs]: with t.wgs > 1 each compute
            warpgroup's output tile, allocated by all warpgroups (Mosaic's scoped allocations are collective)."""

            @pl.when(jnp.logical_and(e >= 0, e < n_experts))
            def _():
                if act == "bf16":

                    def scope(*acc_refs):
                        pipeline(functools.partial(bf16_step, acc_refs))(*operands)
                        return tuple(r[...] for r in acc_refs)

                    finish(pl.run_scoped(scope, *[plgpu.ACC((BN, t.bm), jnp.float32)] * accs_n))
                    return
                # The token scales [bm] f32, the same for every K group: one copy into their own buffer. (Pipelined
                # as a [bm] block they sat at bm x 4 B strides, and a TMA into smem needs 128-byte alignment: at
                # bm = 16 every other stage was misaligned, CUDA_ERROR_MISALIGNED_ADDRESS on the H200.) Per-group
                # scales come with each pipeline step instead (xgroups). With t.wgs > 1 the memory warpgroup issues
                # the copy and the compute warpgroups wait for it.
                if not xgroups:

                    @pl.when(wg == t.wgs if t.wgs > 1 else True)
                    def _():
                        plgpu.copy_gmem_to_smem(xs_ref.at[pl.ds(tile, t.bm)], xs_smem.at[pl.ds(0, t.bm)], xs_bar)

                def epilogue(accs, o_tile=None):
                    if not xgroups:
                        plgpu.barrier_wait(xs_bar)
                        xs = plgpu.load(xs_smem.at[pl.ds(0, t.bm)], layout=col)
                        xs = lax.broadcast_in_dim(xs, (BN, t.bm), [1])
                        accs = tuple(a * xs for a in accs)
                    if t.pairs:  # (before gate/up's SiLU: the digits' products add up to the row's)
                        accs = tuple(_pair_sum(a, fast) for a in accs)
                    finish(accs, o_tile)

                zero = lambda: plgpu.layout_cast(jnp.zeros((BN, t.bm), jnp.float32), plgpu.Layout.WGMMA)  # noqa: E731
                if t.wgs == 1:
                    epilogue(pipeline(int8_step, init_carry=(zero(),) * accs_n)(*operands))
                    return

                def compute(run):  # the compute warpgroups: the pipeline's steps, then their epilogue
                    epilogue(run((zero(),) * accs_n), o_ws.at[wg])

                plgpu.emit_pipeline_warp_specialized(
                    int8_step,
                    grid=(ksteps,),
                    memory_registers=MEMORY_REGS,
                    in_specs=in_specs,
                    max_concurrent_steps=t.stages,
                    wg_axis="wg",
                    num_compute_wgs=t.wgs,
                    compute_context=compute,
                )(*operands)

            @pl.when(e == n_experts)  # rows past sum(group_sizes): zeros
            def _():
                zero = plgpu.layout_cast(jnp.zeros((BN, t.bm), jnp.float32), plgpu.Layout.WGMMA)
                if t.wgs == 1:
                    (store_quantized if qout else store)([zero] * t.tiles * n_out, ni, tile, off, count)
                    return

                @pl.when(wg < t.wgs)
                def _():
                    store([zero] * t.tiles * n_out, ni, tile, off, count, o_ws.at[wg])

        if t.wgs == 1:
            blocks()
        else:
            pl.run_scoped(blocks, plgpu.SMEM((t.wgs, n_out, t.bm, wg_rows), o_dtype), collective_axes="wg")

    # The narrowest of the tiling's block widths that holds the rows of the tile this block uses: its MMAs, token
    # loads and epilogue then cover those rows instead of the grid's bm (a group's last block is mostly partial).
    need, lo = off + count, 0
    for nb in block_widths(t):

        @pl.when(jnp.logical_and(need > lo, need <= nb))
        def _(nb=nb):
            body(dataclasses.replace(t, bm=nb))

        lo = nb


NARROW_WIDTHS = 5  # block widths of a narrow tiling at most: each is a copy of the kernel's pipeline and epilogue


def block_widths(t: Tiling) -> tuple[int, ...]:
    """The token block widths a CTA may run at, ascending (the last is the grid's bm): with t.narrow the multiples of
    16 up to bm, the NARROW_WIDTHS largest of them (blocks of 80 rows: 16 to 80), else bm alone. Each width is a copy
    of the pipeline in the kernel's code: ten of them (w4a8, 160-row blocks) took the H200 run past its time limit
    while compiling."""
    if not t.narrow:
        return (t.bm,)
    return tuple(range(max(16, t.bm - 16 * (NARROW_WIDTHS - 1)), t.bm + 1, 16))


def _to_int8(src, dst, fast: bool):
    """dst[...] = src[...] as int8, for a [rows, cols] smem tile of bf16 integers in [-127, 127]. On the GPU through
    inline Mosaic GPU code: written in Pallas, this conversion ran Mosaic's layout search out of fuel in the gate/up
    kernel (docs/kernels.md). The interpreter (fast=False) runs the same as jnp."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if not fast:
        dst[...] = src[...].astype(jnp.int8)
        return

    from jax.experimental.mosaic.gpu import fragmented_array as fa
    from jaxlib.mlir import ir

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()))
    def run(ctx, src_ref, dst_ref):
        x = fa.FragmentedArray.load_strided(src_ref, vec_size=8)
        x.astype(ir.IntegerType.get_signless(8), is_signed=True).store_untiled(dst_ref)

    run(src, dst)


def _proxy_fence():
    """This thread's generic shared-memory accesses ordered before later async-proxy (TMA) ones: fence.proxy.async,
    without the warpgroup barrier of plgpu.commit_smem."""
    import jax.experimental.pallas.mosaic_gpu as plgpu
    from jaxlib.mlir.dialects import nvvm

    @plgpu.inline_mgpu()
    def _(ctx):
        nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)


def _pair_sum(a, fast: bool):
    """a f32 [64, bm] (WGMMA layout) -> each column pair's sum (2i, 2i + 1) in both columns. In the WGMMA layout a
    pair is one thread's register of two values: one add per register, no data between threads."""
    if not fast:
        s = a.reshape(a.shape[0], -1, 2).sum(-1)
        return jnp.repeat(s, 2, axis=1)
    import jax.experimental.pallas.mosaic_gpu as plgpu

    out = plgpu.ShapeDtypeStruct(a.shape, jnp.float32, layout=plgpu.Layout.WGMMA)

    @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,), return_type=out)
    def run(ctx, a):
        import numpy as np
        from jax.experimental.mosaic.gpu import fragmented_array as fa
        from jaxlib.mlir import ir
        from jaxlib.mlir.dialects import arith, vector

        regs = np.empty_like(a.registers)
        for idx, reg in np.ndenumerate(a.registers):
            vt = ir.VectorType(reg.type)
            if vt.shape != [2]:
                raise NotImplementedError(f"a WGMMA register of {vt}")
            total = arith.addf(vector.extract(reg, [], [0]), vector.extract(reg, [], [1]))
            regs[idx] = vector.broadcast(vt, total)
        return fa.FragmentedArray(_registers=regs, _layout=a.layout, _is_signed=None)

    return run(a)


def _silu_mul(accs, tiles: int) -> list:
    """silu(gate) * up in f32, over the gate tiles (the first `tiles` accumulators) and the up tiles after them."""
    return [gt * up / (1.0 + jnp.exp(-gt)) for gt, up in zip(accs[:tiles], accs[tiles:], strict=True)]


def block_info(sizes, b, m: int, bm: int):
    """Token block b of a call (a scalar in the kernel, an array for `block_table`) from the group sizes (E scalars):
    its expert (E for the rows past sum(group_sizes), which get zeros; -1 for an unused block), the first row of x its
    TMA tile loads (tile, a multiple of 8; rows past M load as zeros), the first row of the tile that is the block's
    (off) and how many are (count, 1..bm). A group's blocks tile its rows from its first row rounded down to a multiple
    of 8, so a group of g rows has at most ceil((g + 7) / bm) blocks; `num_blocks` bounds their sum statically.
    A loop over the E + 1 groups with selects (about 15 scalar ops each): every CTA computes its own block in a
    fraction of a microsecond, so no XLA pass runs before the kernel."""
    expert = tile = first_row = end_row = jnp.zeros_like(b) - 1
    for i, first, end, base, nb, bend in _group_blocks(sizes, m, bm):
        hit = (bend <= b) & (b < bend + nb)
        expert = jnp.where(hit, i, expert)
        tile = jnp.where(hit, base + (b - bend) * bm, tile)
        first_row, end_row = jnp.where(hit, first, first_row), jnp.where(hit, end, end_row)
    lo, hi = jnp.maximum(tile, first_row), jnp.minimum(tile + bm, end_row)
    expert = jnp.where(hi > lo, expert, -1)
    return expert, jnp.maximum(tile, 0), lo - tile, jnp.maximum(hi - lo, 0)


def _group_blocks(sizes, m: int, bm: int):
    """Per group (the E experts, then the rows past their sum): (group, first row, end row, the 8-aligned row its
    blocks start from, its blocks, the blocks of the groups before it)."""
    cs = bend = jnp.int32(0)
    for i in range(len(sizes) + 1):
        size = jnp.maximum(sizes[i], 0) if i < len(sizes) else jnp.maximum(m - cs, 0)  # group E: rows past the sum
        first, end = jnp.minimum(cs, m), jnp.minimum(cs + size, m)  # the group's rows, clipped to x's
        base = lax.div(first, jnp.int32(ROW_ALIGN)) * ROW_ALIGN
        nb = jnp.where(end > first, lax.div(end - base + bm - 1, jnp.int32(bm)), 0)
        yield i, first, end, base, nb, bend
        cs, bend = cs + size, bend + nb


def blocks_used(sizes, m: int, bm: int):
    """How many token blocks the group sizes use: blocks [0, blocks_used) are the groups' (`block_info`), the rest
    unused."""
    return sum(nb for *_, nb, _ in _group_blocks(sizes, m, bm))


def num_blocks(m: int, e: int, bm: int) -> int:
    """A static bound on the token blocks of any group_sizes [e] over m rows (the grid's second dimension). A group
    with rows has at most ceil((rows + 7) / bm) blocks (`block_info`), and at most min(m, e + 1) groups have rows (the
    E experts and the rows past their sum, one row each at least): in decode with many experts (64 experts, 6 routed
    rows at batch 1) that is 9 blocks where a bound over all E + 1 groups launched 94, each CTA scanning the sizes
    before it exits."""
    groups = max(min(m, e + 1), 1)  # (1 with m = 0: a grid dimension of 0 may not launch)
    return -(-(m + (ROW_ALIGN - 1) * groups) // bm) + groups


def block_table(group_sizes, m: int, bm: int):
    """All blocks' `block_info` as int32 [4, num_blocks] (expert, tile, off, count): the kernel's view, for tests."""
    b = jnp.arange(num_blocks(m, group_sizes.shape[0], bm), dtype=jnp.int32)
    sizes = [group_sizes[i].astype(jnp.int32) for i in range(group_sizes.shape[0])]
    return jnp.stack(block_info(sizes, b, m, bm)).astype(jnp.int32)


def _stage_blocks(act: str, t: Tiling, g: int, nw: int, xgroups: bool = False) -> list[int]:
    """The bytes of one pipeline step's blocks, one per pipelined operand: per weight the packed tile [bn, gps G/2]
    and its scales [gps, bn] f32; the token tile [bm, gps G] (bf16 or int8); with xgroups the token tile's scales
    [gps, bm rounded up to 32] f32. Each is a multiple of 128 bytes (a TMA's smem destination must be 128-byte
    aligned, and a pipeline buffer holds its stages' blocks back to back)."""
    weights = [t.bn * t.gps * g // 2, t.gps * t.bn * 4] * nw
    x_scales = [t.gps * _xs_block(t.bm) * 4] if xgroups else []
    return weights + [t.bm * t.gps * g * (2 if act == "bf16" else 1)] + x_scales


def _pipe_bytes(act: str, t: Tiling, g: int, nw: int, xgroups: bool = False, stages: int | None = None) -> int:
    """The pipeline's buffers: one per operand, its stages' blocks back to back, each buffer rounded up to the 1 KiB
    Mosaic aligns it to (the scales' buffers are far from a multiple of it)."""
    return sum(_kib((stages or t.stages) * b) for b in _stage_blocks(act, t, g, nw, xgroups))


def smem_bytes(act: str, t: Tiling, g: int = 128, nw: int = 1, xgroups: bool = False, qout: bool = False) -> int:
    """Shared memory of one CTA, an upper bound on what Mosaic allocates (tests/test_quant.py checks it): the
    pipeline's buffers, which the output tile [bm, bn] bf16 reuses after the last step; w4a8's token scales [bm] f32
    (a buffer of its own, which Mosaic aligns to 1 KiB); without a_regs, the A tiles of one K chunk; barriers. The
    output tile is [bm, bn] bf16, or with split-K one [bm, bn] f32 per weight; with qout a bf16, an int8 and a
    scales tile (1 KiB-aligned each). xgroups: the token scales come with each pipeline step."""
    out = t.bm * t.bn * (2 if t.splits == 1 else 4 * nw)
    if qout:
        out = _kib(t.bm * t.bn * 2) + _kib(t.bm * t.bn) + _kib(t.bn // QGROUP * t.bm * 4)
    pipe = _pipe_bytes(act, t, g, nw, xgroups)
    if t.wgs > 1:  # the output tiles are allocated beside the pipeline (by every warpgroup, before it runs)
        return _kib(out) + pipe + _fixed_bytes(act, t, g, nw, xgroups)
    return max(pipe, out) + _fixed_bytes(act, t, g, nw, xgroups)


def _xs_block(bm: int) -> int:
    """Token scales per row of a pipeline step's K group (xgroups): [bm] f32 rounded up to 128 bytes (each stage's TMA
    destination must be 128-byte aligned)."""
    return -(-bm // 32) * 32


def _kib(nbytes: int) -> int:
    """A buffer's bytes as Mosaic allocates them: rounded up to 1 KiB."""
    return -(-nbytes // 1024) * 1024


def _fixed_bytes(act: str, t: Tiling, g: int, nw: int, xgroups: bool = False) -> int:
    token_scales = _kib(t.bm * 4) if act == "int8" and not xgroups else 0
    return token_scales + _a_bytes(act, t, g, nw) + 1024  # + barriers (Mosaic adds < 600 B)


def _a_bytes(act: str, t: Tiling, g: int, nw: int) -> int:
    """The smem for A operands without a_regs: one K chunk's tiles."""
    return 0 if t.a_regs else _a_tiles(t, g, nw) * BN * KC * (2 if act == "bf16" else 1)


def _a_tiles(t: Tiling, g: int, nw: int) -> int:
    return t.wgs * nw * t.tiles * 2  # one K chunk's A operands (K halves x 64-row tiles x weights, per warpgroup)


def regs(act: str, bm: int, bn: int, nw: int = 1, gps: int = 1) -> int:
    """Registers per thread the tiling pins: the accumulators (f32 [64, bm] per 64-row tile and weight; w4a8 an int32
    partial per K group of the step too) and one step's unpacked A operands, which stay live until the step's wgmmas
    are waited for (bf16 [64, 64]: 16 registers, int8: 8, two K halves per tile, weight and group)."""
    per_tile = bm // 2 + gps * ((bm // 2 if act == "int8" else 0) + 2 * (16 if act == "bf16" else 8))
    return nw * (bn // BN) * per_tile


def default_tiling(
    act: str,
    m: int,
    n: int,
    k_groups: int,
    e: int,
    nw: int = 1,
    g: int = 128,
    *,
    bm=None,
    bn=None,
    gps=None,
    splits=None,
    ctas=None,
    wgs=None,
    sms: int = SMS,
) -> Tiling:
    """The tiling by regime (docs/kernels.md has the reasoning); bm, bn, gps override the choices (the bench's sweep):
    - bm: decode (<= 25 rows per expert on average) takes 16 or 32, about one block per expert (each block streams
      its expert's weights again). Otherwise the smallest multiple of 16 that fits an expert's rows with two standard
      deviations of uniform routing's spread (Poisson) and the 8-row alignment in as few blocks as the register
      budget (REGS) allows: power-of-two blocks wasted up to half the MMAs (128 +- 11 rows took two 128-row blocks).
    - bn: 128 (two wgmma M tiles share each token tile: half the token bytes per MMA) unless the registers would
      then force token blocks below 64 rows.
    - stages: as deep as fits the CTAs per SM that the registers allow (4 in decode: 4 stages keep ~30 KiB of weights
      in flight per CTA; 2 in prefill, one CTA's MMAs overlapping the other's unpacking).
    - ctas: the CTAs per SM the stages are sized for (default: as many as the registers allow, see below).
    - wgs: compute warpgroups per CTA (Tiling.wgs), each with bn rows (so the CTA has wgs x bn), one CTA per SM. By
      default 2 for the fused w4a8 kernel in prefill blocks of 80 rows (the most its registers allow) over long K
      loops (H200, 32 experts at V3's gate/up shape, 56 K groups: 4096 rows 441 -> 421 us, 16384 rows 1557 ->
      1411; smaller blocks were not timed), else 1: the single-weight kernel was level at K = 7168 and slower at
      K = 2048 (255 -> 299 us: with one CTA per SM, each CTA's pipeline fill and epilogue run with nothing beside
      them), and so was every decode kernel timed.
    - narrow (w4a8 with blocks of more than 32 rows): a group's last block runs at the narrowest multiple of 16 that
      holds its rows (H200, 32 experts, fused gate/up with the tokens quantised by the caller: 4096 rows 469 -> 427
      us, 16384 rows 1589 -> 1467; single weight 280 -> 268 and 946 -> 916). Not for w4a16: 3-4% there, and eight
      copies of its pipeline (blocks of 128 rows) took ptxas past 42 s.
    - gps: 2 K groups per step in decode (one wait for both groups' MMAs: the per-step chain of loads, unpacking,
      MMAs and the wait is what bounds a decode CTA; 1.3-1.5x on the H200, docs/kernels.md), else 1.
    - splits (split-K): in decode, as many (1, 2 or 4) as keep the CTAs within one wave of the SMs' CTA slots, with
      at least 8 K steps per split: one K loop per output tile leaves each SM only about two CTAs there."""
    mu = m / max(e, 1)
    auto_wgs, wgs = wgs is None, wgs or 1
    bn_ = bn or (128 if n % (128 * wgs) == 0 else BN)  # per compute warpgroup

    def cap(bn):  # the largest block the register budget allows
        return min(256, max(b for b in range(16, 257, 16) if b == 16 or regs(act, b, bn, nw) <= REGS))

    if bm:
        pass
    elif 1.25 * mu <= 32:
        bm = 16 if 1.25 * mu <= 16 else 32
    else:
        need = mu + 2 * math.sqrt(mu) + ROW_ALIGN
        if bn is None and bn_ > BN and cap(bn_) < min(need, 64):
            bn_ = BN
        nb = math.ceil(need / cap(bn_))
        bm = min(cap(bn_), -(-math.ceil(need / nb) // 16) * 16)
    if gps is None:
        gps = 2 if bm <= 32 and k_groups % 2 == 0 else 1
    if auto_wgs and act == "int8" and nw == 2 and bm >= 80 and k_groups >= 32 and n % (2 * bn_) == 0:
        wgs = 2
    # w4a8 unpacks a step's tiles before its wgmmas where all their A operands fit in registers beside the
    # accumulators (`regs` counts exactly that; ptxas measured ~20 more): fused decode at bm = 16 needs 224 (246 per
    # ptxas), at bm = 32 it would need 320 and spill, so there each tile is unpacked before its own wgmmas.
    first = act == "bf16" or regs(act, bm, bn_, nw, gps) <= UNPACK_FIRST_REGS  # (w4a16 steps ignore it)
    narrow = act == "int8" and bm > 32
    t = Tiling(bm=bm, bn=bn_ * wgs, stages=1, gps=gps, unpack_first=first, narrow=narrow, wgs=wgs)
    total = regs(act, bm, bn_, nw, gps) + 40  # + addresses, indices, temporaries
    out_tile = _kib(bm * bn_ * wgs * 2) if wgs > 1 else 0  # allocated beside the pipeline (smem_bytes)

    def stages(ctas):  # the deepest pipeline that fits ctas CTAs per SM (1 KiB per CTA is the system's, 1 KiB slack)
        budget = SMEM_PER_SM // ctas - 2048 - _fixed_bytes(act, t, g, nw) - out_tile
        return max(
            [1] + [s for s in range(1, min(8, k_groups // gps) + 1) if _pipe_bytes(act, t, g, nw, stages=s) <= budget]
        )

    # As many CTAs per SM as the registers allow, with at least 3 stages (2 if even 2 CTAs leave no room for 3);
    # a CTA of several compute warpgroups has the SM to itself.
    ctas = ctas or (
        1 if wgs > 1 else next(c for c in (4, 3, 2) if c == 2 or (c * 128 * total <= 65536 and stages(c) >= 3))
    )
    if wgs > 1:  # (split-K is one-warpgroup CTAs' only)
        splits = 1
    if splits is None:  # the token blocks of uniform routing: each expert's rows plus its alignment, in bm blocks
        tiles = (n // bn_) * e * math.ceil((mu + ROW_ALIGN - 1) / bm)
        fits = [
            s for s in (1, 2, 4) if s == 1 or (bm <= 32 and k_groups % (s * gps) == 0 and k_groups // (s * gps) >= 8)
        ]
        splits = max(s for s in fits if s == 1 or tiles * s <= ctas * sms)
    return dataclasses.replace(t, stages=max(2, min(stages(ctas), k_groups // (gps * splits))), splits=splits)


def quant_out_pays(act: str, m: int, n: int, k_groups: int, e: int, g: int = 128) -> bool:
    """Whether the fused gate/up kernel should quantise its output itself (quant_out) for this call: when the tiling
    quant_out needs (bn = QGROUP, whole 128-channel groups per CTA) still takes an average expert's rows in one token
    block. quant_out's bn = 128 leaves the registers room for 32-row blocks only (fused: two weights, two 64-row
    tiles each); with more rows per expert than that, every expert's weights go through several small blocks, and
    quantising the bf16 product after the kernel (one XLA pass) costs less. H200, fused w4a8 with the tokens
    quantised by the caller, quant_out against the bf16 product (docs/kernels.md, 2026-11-30): 32 experts x 1024 rows
    220.6 against 229.2 us (32 rows per expert: in the kernel), x 4096 483.6 against 472.6, x 16384 1736.9
    against 1600.7 (after it). In decode the default tiling has bn = 128 already."""
    t = default_tiling(act, m, n, k_groups, e, nw=2, g=g, bn=QGROUP, wgs=1)
    return t.bm * max(e, 1) >= m


def legacy_tiling(act: str, m: int, e: int, nw: int = 1, g: int = 128) -> Tiling:
    """The first version's tiling (H200 runs of 2026-11-29): power-of-two token blocks >= 1.25 x rows per expert,
    64 weight rows per CTA, one K group per step, 4 stages (fewer where smem runs out), A through smem, unpacked with
    int16 ops. Kept for the bench's old-against-new rows (and as the fallback should the inline unpacking fail on a
    GPU). What differs from the first version: w4a16 scales in bf16 after a magic-number conversion instead of f32
    (no I2F), w4a8 without I2F of the partials, one smem slot with a wait per step instead of two."""
    per_expert = 1.25 * m / max(e, 1)
    bm = next((b for b in (16, 32, 64) if per_expert <= b), 128)
    t = Tiling(bm=bm, bn=BN, stages=4, a_regs=False, inline=False, unpack_first=False)
    while t.stages > 2 and smem_bytes(act, t, g, nw) > SMEM_LIMIT:
        t = dataclasses.replace(t, stages=t.stages - 1)
    return t


def _check(x, q, scale, group_sizes, act):
    m, k = x.shape
    e, n, k2 = q.shape
    if act not in ACTS:
        raise ValueError(f"act must be one of {ACTS}, got {act!r}")
    if x.dtype != jnp.bfloat16:
        raise ValueError(f"x must be bfloat16, got {x.dtype}")
    if q.dtype not in (jnp.uint8, jnp.int8) or k2 * 2 != k:
        raise ValueError(f"q must be packed int4 [E, N, K/2] uint8 with K={k}, got {q.dtype} {q.shape}")
    if scale.ndim != 3 or scale.shape[0] != e or scale.shape[2] != n or k % scale.shape[1]:
        raise ValueError(f"scale must be [E={e}, K/G, N={n}], got {scale.shape}")
    g = k // scale.shape[1]
    if g % (2 * KC) or n % BN:
        raise ValueError(f"the kernel needs the int4 group (={g}) a multiple of {2 * KC} and N (={n}) of {BN}")
    if group_sizes.shape != (e,):
        raise ValueError(f"group_sizes must be [E={e}], got {group_sizes.shape}")


def _check_tiling(t: Tiling, act, n, k_groups, g, nw, interpret, xgroups=False, qout=False):
    if t.bm % 16 or not 16 <= t.bm <= 256:
        raise ValueError(f"bm must be a multiple of 16 in [16, 256], got {t.bm}")
    if t.bn not in (64, 128, 256) or n % t.bn:
        raise ValueError(f"bn must be 64, 128 or 256 and divide N={n}, got {t.bn}")
    if k_groups % (t.gps * t.splits) or t.stages < 1:
        raise ValueError(f"gps={t.gps} x splits={t.splits} must divide the {k_groups} K groups; stages={t.stages} >= 1")
    if interpret and t.a_regs:
        raise ValueError("GPU interpret mode has no wgmma with A in registers: use a_regs=False")
    if (xgroups or qout) and (t.splits != 1 or act != "int8"):
        raise ValueError(f"{t}: per-group activation scales (in or out) are w4a8's, without split-K")
    if qout and (nw != 2 or t.bn % QGROUP):
        raise ValueError(f"{t}: a quantised output is gate/up's, with bn a multiple of {QGROUP}")
    if t.pairs and (act != "int8" or qout):
        raise ValueError(f"{t}: row pairs (int8 digits) are w4a8's, with a bf16 output")
    if t.wgs > 1 and (act != "int8" or t.splits != 1 or qout or t.bn % (t.wgs * BN)):
        raise ValueError(f"{t}: compute warpgroups sharing a token tile are w4a8's, with bn / wgs a multiple of {BN}")
    smem = smem_bytes(act, t, g, nw, xgroups, qout)
    if smem > SMEM_LIMIT:
        raise ValueError(f"{t}: {smem} B of smem > {SMEM_LIMIT}")


def _run(x, weights, group_sizes, act, interpret, tiling, x_q=None, quant_out=False):
    """The kernel over weights = ((q, scale),) or ((q_gate, s_gate), (q_up, s_up)) -> [M, N] bf16, or with quant_out
    (int8 [M, N], scales [N/128, M'] with M' >= M + HS_PAD)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    for q, scale in weights:
        _check(x, q, scale, group_sizes, act)
    if len(weights) == 2 and weights[0][0].shape != weights[1][0].shape:
        raise ValueError(f"gate and up differ: {weights[0][0].shape} vs {weights[1][0].shape}")
    nw = len(weights)
    m, k = x.shape
    n = weights[0][0].shape[1]
    g = k // weights[0][1].shape[1]
    e = group_sizes.shape[0]
    xgroups = act == "int8" and x_q is not None and x_q[1].ndim == 2
    if xgroups and (g != QGROUP or x_q[1].shape[0] != k // g):
        raise ValueError(f"per-group x scales {x_q[1].shape} need K groups of {QGROUP} ({k // QGROUP} of them)")
    t = tiling or default_tiling(act, m, n, k // g, e, nw, g, splits=1 if xgroups else None)  # (no split-K there)
    if quant_out and tiling is None and (t.bn < QGROUP or t.wgs > 1):  # a CTA's N tile: whole 128-channel groups
        t = default_tiling(act, m, n, k // g, e, nw, g, bn=QGROUP, wgs=1)
    if interpret:
        t = dataclasses.replace(t, a_regs=False, inline=False)
    _check_tiling(t, act, n, k // g, g, nw, interpret, xgroups, quant_out)
    args = kernel_operands(x, weights, group_sizes, act, t.bm, x_q)
    a_dtype = jnp.bfloat16 if act == "bf16" else jnp.int8
    a_smem = plgpu.SMEM((_a_tiles(t, g, nw), BN, KC), a_dtype, transforms=_transforms(KC, jnp.dtype(a_dtype).itemsize))
    rows = max(m, t.bm)
    out_type = (
        jax.ShapeDtypeStruct((rows, n), jnp.bfloat16)
        if t.splits == 1
        else jax.ShapeDtypeStruct((t.splits, rows, nw * n), jnp.float32)
    )
    if quant_out:
        out_type = (
            jax.ShapeDtypeStruct((rows, n), jnp.int8),
            jax.ShapeDtypeStruct((n // QGROUP, _hs_rows(m)), jnp.float32),
        )
    grid, names = (n // t.bn, num_blocks(m, e, t.bm), t.splits), ("n", "m", "k")
    fixed = [plgpu.SMEM((t.bm,), jnp.float32), plgpu.Barrier()] if act == "int8" and not xgroups else []
    kern = plgpu.kernel(
        functools.partial(_kernel, act, g, k // g // t.gps // t.splits, nw, m, e, t, t.inline, xgroups, quant_out),
        out_type=out_type,
        grid=grid,
        grid_names=names,
        scratch_types=(*fixed, *([] if t.a_regs else [a_smem])),
        **(dict(num_threads=t.wgs + 1, thread_name="wg") if t.wgs > 1 else {}),
        kernel_name=f"moe_{'w4a8' if act == 'int8' else 'w4a16'}{'_gated' if nw == 2 else ''}",  # in profiles, ncu
    )
    if interpret:
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(num_tma_threads_per_device=4)):
            out = kern(*args)
    else:
        out = kern(*args)
    if t.splits > 1:  # the K splits' f32 partials summed (and gate/up's SiLU product formed) in one XLA fusion
        out = out.sum(0)
        out = (jax.nn.silu(out[:, :n]) * out[:, n:] if nw == 2 else out).astype(jnp.bfloat16)
    if quant_out:
        return out[0][:m], out[1]  # the scales keep their padding rows: the down projection's blocks read past M
    return out[:m]  # [M, N] (a slice only when M < bm)


def kernel_operands(x, weights, group_sizes, act: str, bm: int, x_q=None):
    """The wrapper's XLA work before the kernel, all of it: q bitcast to int8 (free), and w4a8's per-token
    quantisation of x (one fused pass: [M, K] int8 and [M] f32 scales) unless the caller gives it as x_q (the
    model quantises its tokens before gathering their top-k copies: 1/k of the rows, fused with the gather). A
    token tile past x's last row is zero-filled by the TMA, so x goes in as it is when M is a multiple of 8 (V3's
    top-8 always is); otherwise it is padded to whole 8-row tiles, one copy of x (the tiled TMA's row count must be
    a multiple of its 8-row tile), and to one block when M < bm. The weight scales are used as stored
    ([E, K/G, N]); each CTA finds its token block from group_sizes itself. The token scales are padded by bm (a few
    bytes: their copy into smem is a plain [bm] slice, which must stay in bounds); per-group scales [K/G, M'] (x_q
    from a producer that quantised in groups) are padded only if M' is short of that (the gate/up kernel's quantised
    output leaves HS_PAD rows)."""
    m = x.shape[0]
    pad = ((0, max(bm, -(-m // ROW_ALIGN) * ROW_ALIGN) - m), (0, 0))
    args = [group_sizes.astype(jnp.int32)]
    for q, scale in weights:
        args += [lax.bitcast_convert_type(q, jnp.int8), scale]
    if act == "int8":
        xq, xs = quantize_int8(x) if x_q is None else x_q  # [M, K] int8, [M] f32 or [K/G, M'] f32
        need = m + _xs_block(bm) + ROW_ALIGN
        xs = jnp.pad(xs, (0, _xs_block(bm) + ROW_ALIGN)) if xs.ndim == 1 else _pad_rows(xs, need)
        args += [jnp.pad(xq, pad), xs]
    else:
        args.append(jnp.pad(x, pad))
    return args


def _hs_rows(m: int) -> int:
    """Columns of the per-group scales the gate/up kernel writes for m rows: m + HS_PAD, rounded up to a multiple of
    32 floats. A TMA source's row stride needs only 16 bytes (4 floats); 32 matches the per-step scale blocks the
    down projection reads (`_xs_block`), and was what the H200 runs used."""
    return -(-(m + HS_PAD) // 32) * 32


def _pad_rows(xs, rows: int):
    """Per-group scales [K/G, M'] with at least `rows` columns and a 16-byte row stride."""
    want = -(-max(rows, xs.shape[1]) // 4) * 4
    return xs if xs.shape[1] == want else jnp.pad(xs, ((0, 0), (0, want - xs.shape[1])))


@functools.partial(jax.jit, static_argnames=("act", "interpret", "tiling", "digits"))
def int4_ragged_dot(
    x,
    q,
    scale,
    group_sizes,
    act: str = "bf16",
    interpret: bool = False,
    tiling: Tiling | None = None,
    x_q=None,
    digits: bool = True,
):
    """ragged_dot(x [M, K] bf16, int4 experts (q [E, N, K/2] uint8, scale [E, K/G, N] f32), group_sizes [E]) ->
    [M, N] bf16, on the Mosaic GPU kernel (`interpret`: Mosaic GPU's interpreter, on any backend). `tiling` defaults
    by the regime (`default_tiling`). w4a8: x_q = quantize_int8(x) when the caller has it (x is then only a shape),
    or (int8 [M, K], scales [K/128, M' >= M]) quantised per row and 128 channels (hcfjax.quant.quantize_int8_groups;
    int4_gated_ragged_dot(..., quant_out=True) writes it): each K group's partial is then scaled by its own.
    w4a16 without a tiling runs as int8 digits on the w4a8 kernel where that pays (`digits_pay`) unless not digits."""
    (e, n, _), (m, k), k_groups = q.shape, x.shape, scale.shape[1]
    if act == "bf16" and tiling is None and digits and digits_pay(m, n, k // k_groups, k_groups, e):
        return int4_ragged_dot_digits(x, q, scale, group_sizes, interpret)
    return _run(x, ((q, scale),), group_sizes, act, interpret, tiling, x_q)


def digits_pay(m: int, n: int, g: int, k_groups: int, e: int) -> bool:
    """Whether w4a16 runs faster as int8 digits on the w4a8 kernel (`int4_ragged_dot_digits`) than on its own
    kernel: where the doubled rows still take 16-row token blocks (about 6 rows per expert or fewer, the decode of
    wide expert parallelism), so the w4a8 kernel's cheaper unpacking comes with no more MMA columns. On the H200
    (docs/kernels.md): 32 experts x 128 rows at 2048 x 7168, 85.2 against 115.8 us; at 8 rows per expert (16 x 128)
    the digits need 32-row blocks and were level to 13% slower."""
    return g == QGROUP and default_tiling("int8", 2 * m, n, k_groups, e).bm == 16


def int8_digits(x):
    """x [M, K] -> two int8 digits per value, interleaved by row: (int8 [2M, K], scales [K/128, 2M] f32), rows 2i and
    2i + 1 x's row i quantised per 128 channels and the residual of that quantised the same way: x = d0 s0 + d1 s1 up
    to s1 / 2 <= s0 / 508 (about 1 / 64,500 of each group's largest value, against bf16's 1 / 512 of each value)."""
    m, k = x.shape
    d0, s0 = quantize_int8_groups(x, QGROUP)
    d1, s1 = quantize_int8_groups(x.astype(jnp.float32) - dequantize_int8_groups(d0, s0), QGROUP)
    return jnp.stack([d0, d1], 1).reshape(2 * m, k), jnp.stack([s0, s1], 2).reshape(k // QGROUP, 2 * m)


@functools.partial(jax.jit, static_argnames=("interpret", "tiling"))
def int4_ragged_dot_digits(x, q, scale, group_sizes, interpret: bool = False, tiling: Tiling | None = None):
    """w4a16 on the w4a8 kernel: each row of x as two int8 digits (`int8_digits`, one XLA pass), both through the
    int8 tensor cores with w4a8's cheap unpacking (no bf16 weights formed: q times the group scales in f32, exactly),
    and each row pair's products summed in the kernel's epilogue (Tiling.pairs; the output's odd rows dropped). The
    result differs from the bf16 product by the digits' residual, below 1 / 64,500 of each 128-channel group's
    largest value: closer to the exact product than the w4a16 kernel (bf16 weights) for values within 1/126 of their
    group's largest, further for smaller ones, all well inside bf16's tolerance of the output (tests/test_quant.py)."""
    return _run_digits(x, ((q, scale),), group_sizes, interpret, tiling)


def _run_digits(x, weights, group_sizes, interpret, tiling):
    """The w4a8 kernel over x's int8 digits with Tiling.pairs (each row pair's products summed in the epilogue,
    before gate/up's SiLU): the even rows of its output are the product."""
    (m, k), (e, n, _) = x.shape, weights[0][0].shape
    t = tiling or default_tiling("int8", 2 * m, n, weights[0][1].shape[1], e, len(weights), splits=1)
    x2 = jnp.broadcast_to(jnp.zeros((), x.dtype), (2 * m, k))  # (a shape only: the kernel reads the digits)
    y = _run(x2, weights, 2 * group_sizes, "int8", interpret, dataclasses.replace(t, pairs=True), int8_digits(x))
    return y[::2]


@functools.partial(jax.jit, static_argnames=("act", "interpret", "tiling", "quant_out", "digits"))
def int4_gated_ragged_dot(
    x,
    gate,
    up,
    group_sizes,
    act: str = "bf16",
    interpret: bool = False,
    tiling: Tiling | None = None,
    x_q=None,
    quant_out: bool = False,
    digits: bool = True,
):
    """silu(ragged_dot(x, Wg)) * ragged_dot(x, Wu) in one kernel (an expert's gate/up projection): gate and up are
    (q, scale) pairs as in int4_ragged_dot; the product is formed in f32 and rounded to bf16 once. x_q as in
    int4_ragged_dot. quant_out (w4a8): the product is written quantised per row and 128 channels, as
    (int8 [M, N], scales [N/128, M' >= M + HS_PAD] f32) = quantize_int8_groups of the bf16 product (the scales'
    columns past M are padding), which the down projection takes as its x_q: no XLA pass between the kernels. w4a16
    without a tiling runs as int8 digits on the w4a8 kernel where that pays (`digits_pay`) unless not digits."""
    (e, n, _), (m, k), k_groups = gate[0].shape, x.shape, gate[1].shape[1]
    if act == "bf16" and tiling is None and not quant_out and digits and digits_pay(m, n, k // k_groups, k_groups, e):
        return _run_digits(x, (tuple(gate), tuple(up)), group_sizes, interpret, None)
    return _run(x, (tuple(gate), tuple(up)), group_sizes, act, interpret, tiling, x_q, quant_out)


@functools.partial(jax.jit, static_argnames=("interpret", "tiling"))
def int4_gated_ragged_dot_digits(x, gate, up, group_sizes, interpret: bool = False, tiling: Tiling | None = None):
    """int4_gated_ragged_dot in w4a16 as `int4_ragged_dot_digits` runs it: x's int8 digits through the fused w4a8
    kernel, each row pair's gate and up products summed before the SiLU."""
    return _run_digits(x, (tuple(gate), tuple(up)), group_sizes, interpret, tiling)


def int4_gated_reference(x, gate, up, group_sizes, act="bf16", quant_out=False):
    """The gated kernel's function in plain jnp: the two projections as in int4_ragged_dot_reference (bf16 outputs),
    then silu(gate) * up in f32; quant_out: that product quantised per row and 128 channels (the scales unpadded)."""
    yg = int4_ragged_dot_reference(x, *gate, group_sizes, act).astype(jnp.float32)
    yu = int4_ragged_dot_reference(x, *up, group_sizes, act).astype(jnp.float32)
    h = (jax.nn.silu(yg) * yu).astype(x.dtype)
    return quantize_int8_groups(h, QGROUP) if quant_out else h
