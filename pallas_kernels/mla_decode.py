"""Absorbed-MLA decode attention over the paged latent cache: a Mosaic GPU (Hopper) kernel, its wrapper, a pure-jnp
reference, and the one place that picks between them (`decode_attention`).

Per query token the heads attend in the latent space: scores = q_lat . c_kv + q_pe . k_pe over the cached tokens,
out = softmax(scores * sm_scale) @ c_kv, with q_lat = q_nope @ W_UK already folded in by the caller.

Kernel layout (one CTA = 64 heads of one query token of one sequence, over one split of its cache):
  WG2 (producer)  TMA-loads 64-token blocks of the pages ([64, C+R] each, page table read per block) into a ring of
                  smem slots; for an int8 cache it loads int8 blocks and converts them to bf16 slots itself.
  WG0 (leader)    S = Q [64, C+R] @ K^T (wgmma), mask, online softmax; writes P (bf16) into the block's k_pe
                  columns (dead after Q.K; hence R must be 64) and the row rescale per slot, then
                  O[:, :C/2] += P @ V[:, :C/2].
  WG1             waits for that slot's P, rescales and accumulates O[:, C/2:].
smem (bf16, C+R=576): Q 72 KiB + 2 slots x 72 KiB; int8: Q + 1 bf16 slot + 2 int8 slots of 36 KiB.
The f32 accumulator [64, C] does not fit one warpgroup's registers for C=512, hence the two column halves; scores are
computed once (no redundant Q.K work).

Flash-decoding: the grid is (head tile x query token, work unit). `split_schedule` builds the work list from the actual
lengths on the device (row, block range, output slot per unit; about one wave of CTAs, long units first), so short
rows and small batches do not leave CTAs idle over the page table's unused width. Each unit writes its normalized
bf16 partial output and log-sum-exp to its slot; `_combine` merges each row's real units in jnp.

int8 caches: per-token scales of c_kv and k_pe are applied to the score columns (S = cs * Q_c.K_c + ps * Q_r.K_r) and
to P before P @ V, so the in-kernel conversion is a plain int8 -> bf16 cast (exact).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
from jax import lax

BLOCK = 64  # query heads per CTA (the wgmma M dimension)
BLOCK_KV = 64  # cache tokens per pipeline step (P [64, 64] and V must share wgmma's 128-byte swizzle)
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def visible_keys(lengths: jax.Array, t: int, positions: jax.Array | None = None) -> jax.Array:
    """[B, T] number of cache positions each query sees: query t of row b sits at lengths[b]-T+t (or at
    positions[b, t] when given, for ragged chunks) and sees keys at positions <= its own and < lengths[b]."""
    own = lengths[:, None] - t + jnp.arange(t)[None, :] if positions is None else positions
    return jnp.minimum(own + 1, lengths[:, None]).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------------------------
# Reference


def mla_decode_reference(
    q_nope,
    q_pe,
    kv_pages,
    page_table,
    lengths,
    sm_scale,
    *,
    scales=None,
    kv_lora_rank=None,
    blocks_per_split=None,
    return_lse=False,
    positions=None,
    layer=None,
    interpret=False,
    num_sms=None,
    min_blocks_per_split=None,
):
    """The same function as `mla_decode`, in plain jnp over the gathered cache (the XLA baseline)."""
    del blocks_per_split, interpret, num_sms, min_blocks_per_split
    c = q_nope.shape[-1] if kv_lora_rank is None else kv_lora_rank
    b, t = q_nope.shape[:2]
    if layer is not None:
        kv_pages = kv_pages[layer]
        scales = None if scales is None else scales[layer]
    n, ps = page_table.shape[1], kv_pages.shape[1]
    entry = kv_pages[page_table].reshape(b, n * ps, -1)  # [B, S, C+R]
    dt = q_nope.dtype
    if scales is None:
        ckv, kpe = entry[..., :c].astype(dt), entry[..., c:].astype(dt)
    else:
        sc = scales if scales.shape[-1] == 2 else jnp.swapaxes(scales, -1, -2)  # token-minor [P, 2, page] too
        sc = sc[page_table].reshape(b, n * ps, 2)
        ef = entry.astype(jnp.float32)
        ckv, kpe = (ef[..., :c] * sc[..., :1]).astype(dt), (ef[..., c:] * sc[..., 1:]).astype(dt)
    s = jnp.einsum("BTHC,BSC->BTHS", q_nope, ckv, preferred_element_type=jnp.float32)
    s = (s + jnp.einsum("BTHR,BSR->BTHS", q_pe, kpe, preferred_element_type=jnp.float32)) * sm_scale
    vis = visible_keys(lengths, t, positions)  # [B, T]
    mask = jnp.arange(n * ps)[None, None, None, :] < vis[:, :, None, None]  # [B, T, 1, S]
    m = jnp.max(jnp.where(mask, s, -jnp.inf), axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # rows with no visible key: all-zero output, lse -inf
    p = jnp.where(mask, jnp.exp(s - m), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    probs = (p / jnp.where(denom > 0, denom, 1.0)).astype(ckv.dtype)
    out = jnp.einsum("BTHS,BSC->BTHC", probs, ckv, preferred_element_type=jnp.float32).astype(dt)
    if not return_lse:
        return out
    lse = jnp.where(denom[..., 0] > 0, m[..., 0] + jnp.log(jnp.maximum(denom[..., 0], 1e-37)), -jnp.inf)
    return out, lse


# ---------------------------------------------------------------------------------------------------------------
# Kernel


@dataclasses.dataclass(frozen=True)
class _Spec:
    c: int  # kv_lora_rank
    r: int  # rope dim
    t: int  # query tokens per row
    heads: int  # padded to a multiple of BLOCK
    page_size: int
    units: int  # work units (row, block range) in the grid, padding included
    quant: bool
    stages: int  # smem slots of bf16 K blocks
    stages8: int  # smem slots of int8 blocks (int8 caches)
    sm_scale: float
    interpret: bool

    @property
    def k(self) -> int:
        return self.c + self.r


def _pv(acc, p_smem, v_smem, interpret: bool):
    """acc + P @ V with P, V in smem. On the GPU the accumulator is fed to wgmma in place (pl.run_state); GPU interpret
    mode has no run_state, so there it is a fresh accumulator added in registers (the same arithmetic)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if interpret:

        def fresh(r):
            plgpu.wgmma(r, p_smem, v_smem)
            return r[...]

        return acc + pl.run_scoped(fresh, plgpu.ACC(acc.shape, jnp.float32))
    return pl.run_state(lambda r: plgpu.wgmma(r, p_smem, v_smem))(plgpu.ACC.init(acc))


def _kernel(spec: _Spec, *refs):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if spec.quant:
        q_ref, kv_ref, sc_ref, pt_ref, pts_ref, vis_ref, work_ref, o_ref, lse_ref, *scratch = refs
    else:
        q_ref, kv_ref, pt_ref, vis_ref, work_ref, o_ref, lse_ref, *scratch = refs
        sc_ref = pts_ref = None
    ((q_smem, o_smem), kv_smem, alpha_smem, fin_smem, lse_smem, i8_smem, sc_smem), bars = scratch[0], scratch[1]
    q_bar, full, consumed, p_ready, done, i8_full, sc_full = bars

    c, half, ns = spec.c, spec.c // 2, spec.stages
    n_ht = spec.heads // BLOCK
    qt, unit = lax.axis_index("qt"), lax.axis_index("unit")
    wg = lax.axis_index("wg")
    t = lax.div(qt, n_ht)
    h0 = lax.rem(qt, n_ht) * BLOCK
    # This CTA's work unit (split_schedule): row b, its blocks [blk0, blk0 + n_blk), output slot. Padding units
    # (n_blk = 0) do nothing at all; the combine never reads their slots.
    b, blk0, n_blk, slot_out = work_ref[0, unit], work_ref[1, unit], work_ref[2, unit], work_ref[3, unit]
    active = n_blk > 0
    vis = vis_ref[b, t]
    start = blk0 * BLOCK_KV
    n_steps = jnp.minimum(lax.div(jnp.maximum(vis - start, 0) + (BLOCK_KV - 1), BLOCK_KV), n_blk)
    row = plgpu.Layout.WGMMA.reduce(1)
    col = plgpu.Layout.WGMMA.reduce(0)

    def block_page(i, table):
        tok = start + i * BLOCK_KV
        return table[b, lax.div(tok, spec.page_size)], lax.rem(tok, spec.page_size)

    def store_out(acc, inv_l, w):
        # o_smem aliases Q's smem (RefUnion): both halves are written only after the leader's last Q.K.
        o_smem[w] = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])).astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem.at[w], o_ref.at[slot_out, t, pl.ds(h0, BLOCK), pl.ds(w * half, half)])

    @pl.when(jnp.logical_and(wg == 0, active))
    def _leader():
        # 232 + 232 + 40 (int8: 232 + 176 + 96) = 504 per thread slot: 504 x 128 fits what the CTA holds at launch;
        # asking for the whole 512 can leave setmaxnreg waiting forever (suspected cause of the hang seen on the H200).
        plgpu.set_max_registers(232, action="increase")
        plgpu.copy_gmem_to_smem(q_ref.at[b, t, pl.ds(h0, BLOCK)], q_smem, q_bar.at[0])
        plgpu.barrier_wait(q_bar.at[0])
        m0 = plgpu.layout_cast(jnp.full((BLOCK,), -1e30, jnp.float32), row)
        l0 = plgpu.layout_cast(jnp.zeros((BLOCK,), jnp.float32), row)
        acc0 = plgpu.layout_cast(jnp.zeros((BLOCK, half), jnp.float32), plgpu.Layout.WGMMA)

        def step(i, carry):
            acc, m, den = carry
            slot = lax.rem(i, ns)
            plgpu.barrier_wait(full.at[slot])
            k_blk = kv_smem.at[slot]
            if spec.quant:
                plgpu.barrier_wait(sc_full.at[slot])

                def qk(s_ref, r_ref):
                    plgpu.wgmma(s_ref, q_smem.at[:, pl.ds(0, c)], k_blk.at[:, pl.ds(0, c)].transpose((1, 0)))
                    plgpu.wgmma(r_ref, q_smem.at[:, pl.ds(c, spec.r)], k_blk.at[:, pl.ds(c, spec.r)].transpose((1, 0)))
                    return s_ref[...], r_ref[...]

                s_c, s_r = pl.run_scoped(qk, plgpu.ACC((BLOCK, BLOCK_KV)), plgpu.ACC((BLOCK, BLOCK_KV)))
                cs = plgpu.load(sc_smem.at[slot, 0], layout=col)
                ps = plgpu.load(sc_smem.at[slot, 1], layout=col)
                cs_b = lax.broadcast_in_dim(cs, (BLOCK, BLOCK_KV), [1])
                s = s_c * cs_b + s_r * lax.broadcast_in_dim(ps, (BLOCK, BLOCK_KV), [1])
            else:

                def qk(s_ref):
                    plgpu.wgmma(s_ref, q_smem, k_blk.transpose((1, 0)))
                    return s_ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((BLOCK, BLOCK_KV)))
            key = plgpu.broadcasted_iota(jnp.int32, (BLOCK, BLOCK_KV), 1, layout=plgpu.Layout.WGMMA)
            key = key + (start + i * BLOCK_KV)
            s = jnp.where(key < vis, s * (spec.sm_scale * _LOG2E), -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1))
            alpha = jnp.exp2(m - m_new)
            p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
            den = den * alpha + p.sum(axis=1)
            if spec.quant:
                p = p * cs_b  # c_kv's per-token scale folded into P

            # P goes into this slot's k_pe columns, dead after Q.K; alpha per slot. The slot is not refilled before
            # both warpgroups release it, so WG1 needs no separate 'P consumed' signal.
            p_smem = k_blk.at[:, pl.ds(c, BLOCK_KV)]
            p_smem[...] = p.astype(p_smem.dtype)
            alpha_smem[slot] = alpha
            plgpu.commit_smem()
            plgpu.barrier_arrive(p_ready.at[slot])
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            acc = _pv(acc, p_smem, k_blk.at[:, pl.ds(0, half)], spec.interpret)
            plgpu.barrier_arrive(consumed.at[slot])
            return acc, m_new, den

        acc, m, den = lax.fori_loop(0, n_steps, step, (acc0, m0, l0))

        inv_l = jnp.where(den > 0, 1.0 / jnp.maximum(den, 1e-30), 0.0)
        fin_smem[...] = inv_l
        lse_smem[...] = jnp.where(den > 0, (m + jnp.log2(jnp.maximum(den, 1e-30))) * _LN2, -jnp.inf)
        plgpu.commit_smem()
        plgpu.barrier_arrive(done.at[0])

        plgpu.copy_smem_to_gmem(lse_smem, lse_ref.at[slot_out, t, pl.ds(h0, BLOCK)])
        store_out(acc, inv_l, 0)
        plgpu.wait_smem_to_gmem(0)

    @pl.when(jnp.logical_and(wg == 1, active))
    def _second():
        plgpu.set_max_registers(176 if spec.quant else 232, action="increase")
        acc0 = plgpu.layout_cast(jnp.zeros((BLOCK, half), jnp.float32), plgpu.Layout.WGMMA)

        def step(i, acc):
            slot = lax.rem(i, ns)
            plgpu.barrier_wait(full.at[slot])
            plgpu.barrier_wait(p_ready.at[slot])
            alpha = plgpu.load(alpha_smem.at[slot], layout=row)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            k_blk = kv_smem.at[slot]
            acc = _pv(acc, k_blk.at[:, pl.ds(c, BLOCK_KV)], k_blk.at[:, pl.ds(half, half)], spec.interpret)
            plgpu.barrier_arrive(consumed.at[slot])
            return acc

        acc = lax.fori_loop(0, n_steps, step, acc0)
        plgpu.barrier_wait(done.at[0])
        inv_l = plgpu.load(fin_smem, layout=row)
        store_out(acc, inv_l, 1)
        plgpu.wait_smem_to_gmem(0)

    def drain_consumed():
        # Observe the last slots' releases too: a waiter must see every phase of its barriers (the interpreter checks).
        @pl.loop(jnp.maximum(n_steps - ns, 0), n_steps)
        def _(i):
            plgpu.barrier_wait(consumed.at[lax.rem(i, ns)])

    @pl.when(jnp.logical_and(wg == 2, active))
    def _producer():
        if not spec.quant:
            plgpu.set_max_registers(40, action="decrease")

            @pl.loop(0, n_steps)
            def _(i):
                slot = lax.rem(i, ns)

                @pl.when(i >= ns)
                def _():
                    plgpu.barrier_wait(consumed.at[slot])

                page, off = block_page(i, pt_ref)
                plgpu.copy_gmem_to_smem(kv_ref.at[page, pl.ds(off, BLOCK_KV)], kv_smem.at[slot], full.at[slot])

            drain_consumed()
            return

        plgpu.set_max_registers(96, action="decrease")
        ns8 = spec.stages8

        def issue8(i):
            page, off = block_page(i, pt_ref)
            s8 = lax.rem(i, ns8)
            plgpu.copy_gmem_to_smem(kv_ref.at[page, pl.ds(off, BLOCK_KV)], i8_smem.at[s8], i8_full.at[s8])

        for j in range(ns8):
            pl.when(j < n_steps)(functools.partial(issue8, j))

        @pl.loop(0, n_steps)
        def _(i):
            slot, s8 = lax.rem(i, ns), lax.rem(i, ns8)

            @pl.when(i >= ns)
            def _():
                plgpu.barrier_wait(consumed.at[slot])

            page, off = block_page(i, pts_ref)
            plgpu.copy_gmem_to_smem(sc_ref.at[page, :, pl.ds(off, BLOCK_KV)], sc_smem.at[slot], sc_full.at[slot])
            plgpu.barrier_wait(i8_full.at[s8])
            for j in range(spec.k // 64):  # int8 -> bf16, exact; 64 columns at a time to bound registers
                cols = pl.ds(j * 64, 64)
                x = plgpu.load(i8_smem.at[s8, :, cols], layout=plgpu.Layout.WGMMA)
                kv_smem.at[slot, :, cols][...] = x.astype(kv_smem.dtype)
            plgpu.commit_smem()
            plgpu.barrier_arrive(full.at[slot])

            @pl.when(i + ns8 < n_steps)
            def _():
                issue8(i + ns8)

        drain_consumed()


def _call_kernel(spec: _Spec, q, kv, sc, pt, pts, vis, work):
    import jax.experimental.pallas as pl  # noqa: F401
    import jax.experimental.pallas.mosaic_gpu as plgpu

    bf16 = jnp.bfloat16
    t128 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    smem = [
        plgpu.RefUnion(  # Q, then (after the last Q.K) the two output halves
            plgpu.SMEM((BLOCK, spec.k), bf16, transforms=t128),
            plgpu.SMEM((2, BLOCK, spec.c // 2), bf16, transforms=t128),
        ),
        plgpu.SMEM((spec.stages, BLOCK_KV, spec.k), bf16, transforms=t128),  # K blocks (bf16)
        plgpu.SMEM((spec.stages, BLOCK), jnp.float32),  # alpha (row rescale) per slot
        plgpu.SMEM((BLOCK,), jnp.float32),  # 1/l at the end
        plgpu.SMEM((BLOCK,), jnp.float32),  # lse staging
        None,
        None,
    ]
    bars = [
        plgpu.Barrier(num_barriers=1),
        plgpu.Barrier(num_barriers=spec.stages),
        plgpu.Barrier(num_arrivals=2, num_barriers=spec.stages),
        plgpu.Barrier(num_barriers=spec.stages),  # p_ready per slot
        plgpu.Barrier(num_barriers=1),  # done: 1/l published
        None,
        None,
    ]
    if spec.quant:
        smem[5] = plgpu.SMEM(
            (spec.stages8, BLOCK_KV, spec.k),
            jnp.int8,
            transforms=(plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(64)),
        )
        smem[6] = plgpu.SMEM((spec.stages, 2, BLOCK_KV), jnp.float32)
        bars[5] = plgpu.Barrier(num_barriers=spec.stages8)
        bars[6] = plgpu.Barrier(num_barriers=spec.stages)
    out_type = (
        jax.ShapeDtypeStruct((spec.units, spec.t, spec.heads, spec.c), bf16),
        jax.ShapeDtypeStruct((spec.units, spec.t, spec.heads), jnp.float32),
    )
    kern = plgpu.kernel(
        lambda *refs: _kernel(spec, *refs),
        out_type=out_type,
        scratch_types=(tuple(smem), tuple(bars)),
        grid=(spec.t * (spec.heads // BLOCK), spec.units),
        grid_names=("qt", "unit"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )
    args = (q, kv, sc, pt, pts, vis, work) if spec.quant else (q, kv, pt, vis, work)
    if spec.interpret:
        # Enough simulated TMA engines for every copy the kernel keeps in flight (Q, the int8 ring and the scales).
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(num_tma_threads_per_device=16)):
            return kern(*args)
    return kern(*args)


def split_schedule(vis, max_blocks: int, q_tiles: int, num_sms: int = 132, min_blocks: int = 4, blocks_per_split=None):
    """The flash-decoding work list, from the actual lengths (a few tiny XLA ops on [B] arrays).

    vis [B, T] visible keys per query. Row b reads nb = ceil(max_t vis / 64) blocks, cut into units of bps blocks (the
    last one shorter); bps = max(min_blocks, ceil(sum(nb) / target)) with target = num_sms // q_tiles units, so the
    CTAs (q_tiles per unit) come to about one wave of the chip whatever the spread of lengths; rows with nothing to
    read get no unit. Since sum(ceil(nb / bps)) <= sum(nb) / bps + B <= target + B, that is the grid's static size
    (or B * ceil(max_blocks / bps) when smaller, or when `blocks_per_split` fixes bps).

    -> (work [4, U] int32 in grid order: row, first block, blocks (0 for padding units), output slot;
        first [B] slot of each row's first unit, count [B] units per row, max_units: a static bound on count).
    Slots are row-major (row b owns slots first[b] .. first[b] + count[b] - 1); the grid runs the units longest
    first, so the short ones fill the chip's last gaps (longest-first list scheduling).
    """
    b = vis.shape[0]
    nb = jnp.minimum(lax.div(jnp.max(vis, axis=1) + (BLOCK_KV - 1), BLOCK_KV), max_blocks).astype(jnp.int32)
    nb = jnp.maximum(nb, 0)
    target = max(1, num_sms // q_tiles)
    if blocks_per_split is None:
        min_blocks = max(1, min(min_blocks, max_blocks))
        bps = jnp.maximum(min_blocks, lax.div(jnp.sum(nb) + (target - 1), target))
        max_units = min(target, -(-max_blocks // min_blocks))
        units = min(target + b, b * max_units)
    else:
        bps = jnp.int32(max(1, blocks_per_split))
        max_units = -(-max_blocks // max(1, blocks_per_split))
        units = b * max_units
    count = lax.div(nb + (bps - 1), bps)  # [B]
    incl = jnp.cumsum(count)
    first = incl - count
    u = jnp.arange(units, dtype=jnp.int32)
    row = jnp.sum(incl[None, :] <= u[:, None], axis=1).astype(jnp.int32)  # [U]; B for unused slots
    used = row < b
    row = jnp.minimum(row, b - 1)
    blk0 = (u - first[row]) * bps
    n_blk = jnp.where(used, jnp.minimum(bps, nb[row] - blk0), 0)
    # Grid order: longest units first (list scheduling by the CTA dispatcher then leaves the short ones for the end),
    # padding last. One sort of U <= B + num_sms keys.
    order = jnp.argsort(-n_blk, stable=True)
    work = jnp.stack([jnp.where(used, row, 0), jnp.where(used, blk0, 0), n_blk, u])[:, order]
    return work.astype(jnp.int32), first.astype(jnp.int32), count.astype(jnp.int32), max_units


def _combine(o, lse, first, count, max_units: int):
    """Merges each row's unit partials (each normalized, with its log-sum-exp) into [B, T, H, C] f32 and lse [B, T, H].
    o [U, T, H, C], lse [U, T, H]; row b's units are slots first[b] .. first[b] + count[b] - 1. Slots outside every
    row are never read (padding units do not write them). Rows with no unit or no visible key: zeros and -inf."""
    n_slots, b = o.shape[0], first.shape[0]
    if b * max_units <= 2 * n_slots:
        # Few rows: gather each row's (at most max_units) slots densely.
        j = jnp.arange(max_units)
        ok = j[None, :] < count[:, None]  # [B, S]
        idx = jnp.minimum(first[:, None] + j[None, :], n_slots - 1)
        lse_g = jnp.where(ok[..., None, None], lse[idx], -jnp.inf)  # [B, S, T, H]
        o_g = jnp.where(ok[..., None, None, None], o[idx].astype(jnp.float32), 0.0)  # [B, S, T, H, C]
        m = jnp.max(lse_g, axis=1)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        w = jnp.exp(lse_g - m[:, None])  # 0 for unused and empty slots
        tot = jnp.sum(w, axis=1)
        out = jnp.einsum("BSTH,BSTHC->BTHC", w, o_g)
    else:
        # Many rows: segment reductions over the slots (about one unit per row); unused slots get segment B (dropped).
        slot = jnp.arange(n_slots)
        seg = jnp.sum((first + count)[None, :] <= slot[:, None], axis=1)  # [U]
        ok = seg < b
        rowc = jnp.minimum(seg, b - 1)
        lse_s = jnp.where(ok[:, None, None], lse, -jnp.inf)
        m = jax.ops.segment_max(lse_s, seg, num_segments=b)
        m = jnp.where(jnp.isfinite(m), m, 0.0)
        w = jnp.exp(lse_s - m[rowc])
        tot = jax.ops.segment_sum(w, seg, num_segments=b)
        o_w = jnp.where(ok[:, None, None, None], o.astype(jnp.float32) * w[..., None], 0.0)
        out = jax.ops.segment_sum(o_w, seg, num_segments=b)
    out = out / jnp.where(tot > 0, tot, 1.0)[..., None]
    return out, jnp.where(tot > 0, m + jnp.log(jnp.maximum(tot, 1e-37)), -jnp.inf)


def kernel_scales(scales, pt, layer=None):
    """The int8 scales as the kernel's TMA reads them, [N, 2, page] (a 64-token box needs the token axis innermost),
    and the page table that indexes them.

    Token-minor scales ([P, 2, page], or [L, P, 2, page] with `layer`) are used as they are: no per-call pass.
    hcfjax.cache's [.., P, page, 2] are gathered for the table's pages only and transposed, [B * max_pages, 2, page]
    (16 B per table token moved per call, against the 584 B the kernel reads per token), indexed by b * max_pages + j.
    """
    b, n = pt.shape
    if scales.shape[-2] == 2:  # token-minor
        if layer is None:
            return scales, pt
        return scales.reshape(-1, *scales.shape[-2:]), pt + jnp.asarray(layer, jnp.int32) * scales.shape[-3]
    g = scales[pt] if layer is None else scales[layer, pt]  # [B, n, page, 2]
    return jnp.swapaxes(g, -1, -2).reshape(b * n, 2, -1), jnp.arange(b * n, dtype=jnp.int32).reshape(b, n)


def check_supported(q_nope, q_pe, kv_pages, page_table, lengths, scales, kv_lora_rank, layer) -> None:
    """Raises ValueError naming the first shape, dtype or alignment the kernel cannot take."""
    if q_nope.ndim != 4 or q_pe.ndim != 4:
        raise ValueError(f"q_nope and q_pe must be [B, T, H, *], got {q_nope.shape} and {q_pe.shape}")
    b, t, h, c = q_nope.shape
    if q_pe.shape[:3] != (b, t, h):
        raise ValueError(f"q_pe {q_pe.shape} does not match q_nope {q_nope.shape} in [B, T, H]")
    if kv_lora_rank is not None and kv_lora_rank != c:
        raise ValueError(f"q_nope's last dim {c} must be kv_lora_rank {kv_lora_rank} (absorb W_UK first)")
    want_rank = 3 if layer is None else 4
    if kv_pages.ndim != want_rank:
        raise ValueError(
            f"kv_pages must have rank {want_rank} ({'[L, ' if layer is not None else '['}P, page, C+R]), "
            f"got {kv_pages.shape}"
        )
    r = q_pe.shape[-1]
    if kv_pages.shape[-1] != c + r:
        raise ValueError(f"kv_pages' last dim {kv_pages.shape[-1]} must be C+R = {c}+{r}")
    if r != BLOCK_KV:
        raise ValueError(f"qk_rope_head_dim {r} must be {BLOCK_KV} (P is staged in a block's dead k_pe columns)")
    if c % 128:
        raise ValueError(f"kv_lora_rank {c} must be a multiple of 128 (two 64-aligned output halves)")
    if (c + r) % 64:
        raise ValueError(f"C+R = {c + r} must be a multiple of 64 (128-byte swizzled tiles)")
    if kv_pages.shape[-2] % BLOCK_KV:
        raise ValueError(f"page size {kv_pages.shape[-2]} must be a multiple of {BLOCK_KV}")
    if kv_pages.dtype == jnp.int8:
        shapes = (kv_pages.shape[:-1] + (2,), kv_pages.shape[:-2] + (2, kv_pages.shape[-2]))
        if scales is None or scales.shape not in shapes or scales.dtype != jnp.float32:
            got = None if scales is None else (scales.shape, scales.dtype)
            raise ValueError(f"an int8 cache needs f32 scales of shape {shapes[0]} (or {shapes[1]}), got {got}")
    elif kv_pages.dtype != jnp.bfloat16:
        raise ValueError(f"kv_pages must be bfloat16 or int8, got {kv_pages.dtype}")
    elif scales is not None:
        raise ValueError("scales are only for an int8 cache")
    if page_table.ndim != 2 or page_table.shape[0] != b or not jnp.issubdtype(page_table.dtype, jnp.integer):
        raise ValueError(f"page_table must be integer [B={b}, max_pages], got {page_table.shape} {page_table.dtype}")
    if lengths.shape != (b,) or not jnp.issubdtype(lengths.dtype, jnp.integer):
        raise ValueError(f"lengths must be integer [B={b}], got {lengths.shape} {lengths.dtype}")


def mla_decode(
    q_nope,
    q_pe,
    kv_pages,
    page_table,
    lengths,
    sm_scale,
    *,
    scales=None,
    kv_lora_rank=None,
    blocks_per_split=None,
    return_lse=False,
    positions=None,
    layer=None,
    interpret=False,
    num_sms=None,
    min_blocks_per_split=4,
):
    """Absorbed-MLA decode attention with the Mosaic GPU kernel.

    q_nope [B, T, H, C] (absorbed latent query), q_pe [B, T, H, R]; kv_pages [P, page, C+R] bf16 or int8 (with
    scales [P, page, 2] f32 as hcfjax.cache stores them, or token-minor [P, 2, page], which the kernel reads with no
    per-call pass: `kernel_scales`), or the whole cache [L, P, page, C+R] (and [L, ...] scales) with `layer`;
    page_table [B, max_pages]; lengths [B] cache tokens including the T queries, which sit at the last T positions
    (or at `positions` [B, T]).
    -> out [B, T, H, C] in q's dtype (and lse [B, T, H] f32).  `interpret` runs Mosaic GPU's interpreter (CPU tests).

    The sequence is split across CTAs by `split_schedule` from the actual lengths (about one wave of `num_sms`
    SMs, at least `min_blocks_per_split` 64-token blocks per split, or exactly `blocks_per_split`).
    """
    check_supported(q_nope, q_pe, kv_pages, page_table, lengths, scales, kv_lora_rank, layer)
    b, t, h, c = q_nope.shape
    r = q_pe.shape[-1]
    quant = kv_pages.dtype == jnp.int8
    ps = kv_pages.shape[-2]
    n_pages = kv_pages.shape[-3]
    pt = page_table.astype(jnp.int32)
    sc = pts = None
    if quant:
        sc, pts = kernel_scales(scales, pt, layer)
    if layer is not None:
        # Index the whole cache in the kernel (page + layer * P) instead of slicing out a layer copy.
        pt = pt + jnp.asarray(layer, jnp.int32) * n_pages
        kv_pages = kv_pages.reshape(-1, ps, c + r)
    heads = -(-h // BLOCK) * BLOCK
    q = jnp.concatenate([q_nope, q_pe], axis=-1).astype(jnp.bfloat16)
    if heads != h:
        q = jnp.pad(q, ((0, 0), (0, 0), (0, heads - h), (0, 0)))
    max_blocks = page_table.shape[1] * ps // BLOCK_KV
    vis = visible_keys(lengths.astype(jnp.int32), t, positions)
    if num_sms is None:
        num_sms = getattr(jax.devices()[0], "core_count", 132) or 132
    work, first, count, max_units = split_schedule(
        vis, max_blocks, t * (heads // BLOCK), num_sms, min_blocks_per_split, blocks_per_split
    )
    spec = _Spec(
        c=c,
        r=r,
        t=t,
        heads=heads,
        page_size=ps,
        units=work.shape[1],
        quant=quant,
        stages=1 if quant else 2,
        stages8=2,
        sm_scale=float(sm_scale),
        interpret=interpret,
    )
    o, lse = _call_kernel(spec, q, kv_pages, sc, pt, pts, vis, work)
    out, lse = _combine(o, lse, first, count, max_units)
    out = out[:, :, :h].astype(q_nope.dtype)
    return (out, lse[:, :, :h]) if return_lse else out


# ---------------------------------------------------------------------------------------------------------------
# Selection


# The kernel is the model's decode attention on a GPU: on the H200 (2026-11-29, pallas_kernels/bench/RESULTS.md) its
# teacher-forced logits are as close to a float32 truth as the XLA reference's, and it is 2-15x faster from batch 4 up.
KERNEL_ON_GPU = True


def kernel_applies(q_nope, q_pe, kv_pages, page_table, lengths, scales=None, kv_lora_rank=None, layer=None) -> bool:
    try:
        check_supported(q_nope, q_pe, kv_pages, page_table, lengths, scales, kv_lora_rank, layer)
    except ValueError:
        return False
    return True


def decode_attention(q_nope, q_pe, kv_pages, page_table, lengths, sm_scale, **kwargs):
    """The model's absorbed decode attention: the kernel on a GPU when the shapes suit it, the jnp reference elsewhere.
    HCFJAX_MLA=reference|kernel|interpret overrides (kernel/interpret raise on unsupported shapes); KERNEL_ON_GPU=False
    turns the kernel off for `auto`."""
    mode = os.environ.get("HCFJAX_MLA", "auto")
    if mode == "auto":
        ok = (
            KERNEL_ON_GPU
            and jax.default_backend() == "gpu"
            and kernel_applies(
                q_nope,
                q_pe,
                kv_pages,
                page_table,
                lengths,
                kwargs.get("scales"),
                kwargs.get("kv_lora_rank"),
                kwargs.get("layer"),
            )
        )
        mode = "kernel" if ok else "reference"
    if mode == "reference":
        return mla_decode_reference(q_nope, q_pe, kv_pages, page_table, lengths, sm_scale, **kwargs)
    if mode not in ("kernel", "interpret"):
        raise ValueError(f"HCFJAX_MLA must be auto, reference, kernel or interpret, got {mode!r}")
    return mla_decode(q_nope, q_pe, kv_pages, page_table, lengths, sm_scale, interpret=mode == "interpret", **kwargs)
