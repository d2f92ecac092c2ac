"""The int4 MoE kernel's body (Mosaic GPU, Hopper) and its in-kernel helpers: one CTA's pipeline over the K groups,
the unpacking and wgmmas of each step, and the epilogue (SiLU, quantised output, split-K partials, row-pair sums).
moe_int4.py documents the layout and builds the pallas_call around `kernel_body`; moe_int4_tiling.py says how a call
is cut."""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax

from pallas_kernels.int4_unpack import bf16_halves, int8_halves
from pallas_kernels.int_sums import MAGIC, MAGIC_F  # a w4a8 K group's sum: 128 products of |16 q| <= 128 and |x| <= 127
from pallas_kernels.moe_int4_tiling import (
    BN,
    KC,
    QGROUP,
    ROW_ALIGN,
    Tiling,
    block_info,
    block_widths,
    xs_block,
)

MEMORY_REGS = 40  # registers per thread of a warp-specialised tiling's memory warpgroup (t.wgs > 1)


def smem_transforms(cols: int, itemsize: int):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    sw = cols * itemsize  # 64 or 128 bytes: one swizzle span per KC columns
    return (plgpu.TilingTransform((8, sw // itemsize)), plgpu.SwizzleTransform(sw))


def kernel_body(act, g, ksteps, nw, m, n_experts, t: Tiling, fast: bool, xgroups: bool, qout: bool, gs_ref, *refs):
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

        w_spec = plgpu.BlockSpec((t.bn, t.gps * half), lambda k: (ni, k0 + k), transforms=smem_transforms(KC, 1))
        s_spec = plgpu.BlockSpec((t.gps, t.bn), lambda k: (k0 + k, ni))
        # The token tile: bm rows of x (unpadded but for whole 8-row tiles) from row `tile` on (an element offset, a
        # multiple of 8, not a block index); rows outside this block's group are computed and never stored, rows past
        # M arrive as zeros.
        x_item = 2 if act == "bf16" else 1
        x_spec = plgpu.BlockSpec(
            (pl.Element(t.bm), t.gps * g), lambda k: (tile, k0 + k), transforms=smem_transforms(KC, x_item)
        )
        in_specs = [w_spec, s_spec] * nw + [x_spec]
        if xgroups:  # the step's K groups' scales for the token tile's rows (rounded up to 128 bytes per group)
            in_specs.append(plgpu.BlockSpec((t.gps, pl.Element(xs_block(t.bm))), lambda k: (k0 + k, tile)))
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
            block's (the others belong to the neighbouring groups' blocks): `store_rows`."""
            cols = [pl.ds(i * n_cols + ni * t.bn + row0, width) for i in range(o_smem.shape[0])]
            store_rows(o_smem, o_gmem, cols, tile, off, count, t.bm)

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
                accs = silu_mul(accs, t.tiles)
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


def store_rows(o_smem, o_gmem, cols, tile, off, count, bm: int):
    """Rows [off, off + count) of o_smem [n_out, bm, width] -> o_gmem's rows from tile + off, output i at the columns
    cols[i] (a pl.ds of width). A TMA box has a static size, so the rows go out as a ladder of power-of-two row counts
    (count's binary digits), each from the smem row after the last (rows of width x 2 >= 128 bytes, or width int8
    bytes: every start stays TMA-aligned)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    start, rows = off, 1 << (bm.bit_length() - 1)
    while rows:

        @pl.when(count & rows != 0)
        def _(start=start, rows=rows):
            for i in range(o_smem.shape[0]):
                dst = o_gmem.at[pl.ds(tile + start, rows), cols[i]]
                plgpu.copy_smem_to_gmem(o_smem.at[i, pl.ds(start, rows)], dst)

        start, rows = start + (count & rows), rows // 2
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


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


def silu_mul(accs, tiles: int) -> list:
    """silu(gate) * up in f32, over the gate tiles (the first `tiles` accumulators) and the up tiles after them."""
    return [gt * up / (1.0 + jnp.exp(-gt)) for gt, up in zip(accs[:tiles], accs[tiles:], strict=True)]
