"""The Mosaic GPU (Hopper) attention kernel of absorbed-MLA decode over the paged latent cache (mla_decode.py is the
wrapper, mla_schedule.py builds its work list, mla_merge.py merges the rows it splits). This module holds the
warpgroups' schedule and the launch; mla_kernel_spec.py the kernel's static description and shared memory,
mla_kernel_cta.py one CTA's refs and the operations its warpgroups share.

Attention: one CTA = 64 heads of one query token over one work unit (a row's block range; below 64 heads, the real
heads' rows of the tile, or all of a row's query tokens stacked in it: KernelSpec.q_heads, stack), three warpgroups: WG0
and WG1 compute, WG2 loads. A cache block (64 tokens) sits in one of two smem slots, as three parts with a barrier
each: A = latent columns [0, C/2), B = [C/2, C), R = rope columns [C, C+R). A and B are V's two column halves; R is
dead after Q.K and holds the block's softmax P ([64, 64] in the MMAs' 16-bit type, the same 128-byte swizzle as V,
which wgmma wants).
Q sits in smem as its latent and rope parts (two TMAs straight from q_nope and q_pe); the output halves reuse it.
The f32 accumulator [64, C] does not fit one warpgroup's registers for C=512: WG0 owns O[:, :C/2], WG1 O[:, C/2:].

The schedule (version 3, leader and follower): WG0 computes S = Q.K^T for every block, the online softmax, writes P
and the row rescale, and updates its half; WG1 waits for that block's P and updates the other half. WG0 does 3/4 of
the MMA work and all of the softmax, so it is the critical path; with a bf16 cache WG1 mostly waits (with int8 it
converts: below). A slot is reloaded once both have released it. (Schedules that split the leader's work across two
warpgroups ran slower: docs/kernels.md.)

int8 caches: the loader TMA-loads the int8 part into the 16-bit part's own bytes (a RefUnion: nothing else is free in
smem beside Q and two 16-bit slots); its converter reads all of it into registers, and only then writes the 16-bit
part, so the overlap is harmless. Conversion of one slot overlaps the MMAs on the other (with qk8 it follows the slot's
own Q.K instead: below). The converter is the loader, except without qk8 for the second latent half (B): WG1, which
would otherwise wait for P, converts each next block's B. The latent parts are converted exactly and without scales
(int8 -> bf16 in a few integer and bf16x2 ops, Mosaic's fast path: no int-to-float conversion instructions, which run
at 16 per clock per SM and made the loader the bottleneck), the rope part times s_rope / s_latent; the leader
multiplies S's key columns by s_latent and P by s_latent before P.V (both per token), which is the same attention as
over the dequantised cache. Without qk8 the parts, Q and P are fp16 rather than bf16 (`KernelSpec.f16`): fp16 holds a
byte whole, so the exact conversion takes half the instructions (int8_f16.py), and the leader converts Q in place after
its TMA.

int8 Q.K (`KernelSpec.qk8`, opt-in: its queries are quantised too, and it pays only on long rows): the
leader multiplies int8 queries (quantised per head by the wrapper, a scale for each part: the latent's halves A and B,
the rope) with the landed int8 block on the int8 tensor cores, an int32 accumulator per part started at MAGIC
(int_sums.py), and applies the scales (three per head, two per token) to S. Only then is the block's latent (V)
converted to bf16 in place, while the leader runs the softmax: its first half by the loader, its second by WG1 (the
half's only reader); the rope part is not converted (P goes there). The loader issues block i + 1's loads before it
waits for block i's Q.K.

Converter warpgroups (`KernelSpec.converters`, int8 transposed tiles, opt-in): a fourth warpgroup. WG3 converts each
block's first latent half and rope, WG1 its second half, each as soon as the part lands; the leader runs both P.V
halves (O^T at 16 query rows is 32 registers a half) and releases the slot alone; the loader only issues copies. A
slot's round trip is then its load, one part's conversion and the leader's work, where with three warpgroups the
loader converts between its issues and WG1 converts the next block's half before it releases the current one.

Head-tile pairs (`KernelSpec.pair`, H a multiple of 128): the CTAs of a token's two head tiles form a cluster; each
loads half of every block and multicasts it into both, and a slot is reloaded once both CTAs have released it (a
cluster barrier), so the cache crosses from L2 into the SMs once per 128 heads, not once per 64.

Transposed tiles (`KernelSpec.transposed`, tiles of at most 32 query rows by default: V2-Lite's 16 heads, one or
two tokens): the same schedule with the MMAs turned around, S^T = K Q^T [64 keys, q_rows] and O^T = V^T P^T [C/2,
q_rows] per warpgroup, the softmax down S^T's columns, P^T staged as [q_rows, 64] in the rope part; the padded rows
of a 64-row tile cost nothing.

Outputs: a unit writes its normalized bf16 rows and lse either straight to the output (the row's only unit) or to
its partial slot, as the work list says (mla_schedule.DIRECT / slot).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import lowering_cache
from pallas_kernels.mla_kernel_cta import Cta, finish_rows, initial_state, p_tile, pv_update, query_layout
from pallas_kernels.mla_kernel_spec import (
    LOG2E,
    P_SCALE,
    REGISTERS,
    A,
    B,
    KernelSpec,
    R,
    check_registers,
    launch_registers,
    profile_params,
    scope,
    smem_types,
)
from pallas_kernels.mla_schedule import BLOCK, BLOCK_KV, PADDING

__all__ = ["REGISTERS", "KernelSpec", "attention", "check_registers", "profile_params", "scope", "smem_types"]


def _v3(ctx: Cta, wg, active):
    """WG0 computes every block's scores and softmax; WG1 follows with the other output half (and, int8,
    converts the latent's second half: the next block's, or with qk8 this block's after its Q.K). With converters,
    WG0 runs both halves and WG1 and WG3 only convert."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    spec, bars = ctx.spec, ctx.bars
    row = query_layout(spec)
    regs = spec.register_split()
    key_axis = spec.key_axis
    b = lambda x, s: lax.broadcast_in_dim(x, s, [1 - key_axis])  # noqa: E731  (a query-row vector onto S or O)
    # int8 without qk8: WG1 converts each next block's second latent half (a K part of that block's Q.K) while the
    # leader computes P, the loader the first half and the rope (docs/kernels.md).
    split = spec.quant and not spec.qk8 and not spec.converters
    conv = spec.converters  # WG1 and WG3 convert; the leader runs both P.V halves
    log2_scale = spec.sm_scale * LOG2E

    halves = (A, B) if conv else (A,)  # the output halves (V's parts) the leader accumulates

    def one_block(i, carry):
        """The leader's work on block i: Q.K, the online softmax and P.V; the block's slot is then released."""
        acc, m, den = carry
        slot = lax.rem(i, 2)
        with scope("qk"):  # (the waits for the block's parts included)
            if spec.qk8:  # S from the int8 block, all scales applied; its latent is then converted in place
                s = ctx.scores_i8(slot, fast=not spec.interpret, factor=log2_scale)
            else:
                s = ctx.scores(slot, (A, B, R))
        with scope("softmax"):
            # Where the softmax scale (into the log2 domain) is taken was timed (docs/kernels.md):
            # qk8 on the per-token scales in `scores_i8`; bf16 on the row max and inside exp2's
            # argument, one FFMA a score (the max commutes with a positive scale exactly, so m and the lse are
            # as before; P may differ by an ulp); int8 without qk8 as a multiply on S (on the per-token scales
            # it ran 1.2% slower with bf16 parts). sm_scale > 0: KernelSpec checks.
            if spec.quant:  # the latent parts hold the int8 values exactly: P.V takes the latent scale on P
                sc_v, sc_k = ctx.latent_scale(slot, s.shape)
                if not spec.qk8:  # (the rope part holds its values relative to the latent scale)
                    s = s * sc_k
            s = ctx.masked(s, i, scaled=spec.quant and not spec.qk8)
            if spec.quant:
                m_new = jnp.maximum(m, s.max(axis=key_axis))
                p = jnp.exp2(s - b(m_new, s.shape))
            else:
                m_new = jnp.maximum(m, s.max(axis=key_axis) * log2_scale)
                p = jnp.exp2(s * log2_scale - b(m_new, s.shape))
            alpha = jnp.exp2(m - m_new)
            den = den * alpha + p.sum(axis=key_axis)
            # P goes into the slot's rope part, dead after Q.K; WG1 reads it and the rescale from here. int8: P
            # times the latent scales, so that P.V over the exact int8 latent is P.V over the dequantised one.
            p = (p * sc_v if spec.quant else p).astype(ctx.parts[R].dtype)
            p_smem = p_tile(ctx, slot)  # (P^T [64 keys, q_rows] staged as [q_rows, 64], K-major for O^T's wgmma)
            (p_smem.transpose((1, 0)) if spec.transposed else p_smem)[...] = p
            if not conv:  # (WG1's rescale)
                ctx.query_vector(slot)[...] = alpha
            plgpu.commit_smem()
            if not conv:
                plgpu.barrier_arrive(bars["sig"].at[slot])
        if spec.qk8:  # V's first half, converted after this block's Q.K
            with scope("wait_v"):
                plgpu.barrier_wait(bars["full"].at[slot * 3 + A])
        with scope("pv"):
            acc = tuple(
                pv_update(a * b(alpha, a.shape), p_smem, ctx.parts[h].at[slot], spec)
                for a, h in zip(acc, halves, strict=True)
            )
        plgpu.barrier_arrive(bars["consumed"].at[slot])
        return acc, m_new, den

    def finish_and_store(acc, m, den):
        inv_l, lse = finish_rows(m, den)
        if spec.f16:  # P went out times P_SCALE
            inv_l = inv_l * (1.0 / P_SCALE)
        if not conv:  # (WG1 scales and stores the other half)
            ctx.query_vector(2)[...] = inv_l
            plgpu.commit_smem()
            plgpu.barrier_arrive(bars["sig"].at[2])
        for w, a in enumerate(acc):
            ctx.store(a, inv_l, w, lse if w == 0 else None)

    def _leader():
        _set_registers(regs[0], spec)
        ctx.load_q(issue=True)
        acc0, m0, l0 = initial_state(spec)
        carry = ((acc0,) * len(halves), m0, l0)
        acc, m, den = lax.fori_loop(0, ctx.n_steps, one_block, carry)
        finish_and_store(acc, m, den)

    def _second():
        _set_registers(regs[1], spec)
        if split:  # block 0's second latent half; each step then converts the next block's

            @pl.when(ctx.n_steps >= 1)
            def _():
                ctx.finish(0, B, scales=False)

        def step(i, acc):
            slot = lax.rem(i, 2)
            if spec.qk8:  # V's second half, converted here while the loader converts the first
                with scope("wait_qk"):
                    plgpu.barrier_wait(bars["qk"].at[slot])
                with scope("convert"):
                    ctx.convert_part(slot, B, mark=False)
            elif split:  # block i + 1's second latent half (a K part of its Q.K), while the leader computes P

                @pl.when(i + 1 < ctx.n_steps)
                def _():
                    with scope("convert"):
                        ctx.finish(1 - slot, B, scales=False)

            else:
                with scope("wait_v"):
                    plgpu.barrier_wait(bars["full"].at[slot * 3 + B])
            with scope("wait_p"):
                plgpu.barrier_wait(bars["sig"].at[slot])
            with scope("pv"):
                alpha = plgpu.load(ctx.query_vector(slot), layout=row)
                acc = pv_update(acc * b(alpha, acc.shape), p_tile(ctx, slot), ctx.parts[B].at[slot], spec)
            plgpu.barrier_arrive(bars["consumed"].at[slot])
            return acc

        acc = lax.fori_loop(0, ctx.n_steps, step, initial_state(spec)[0])
        plgpu.barrier_wait(bars["sig"].at[2])
        ctx.store(acc, plgpu.load(ctx.query_vector(2), layout=row), 1)

    def _second_half_converter():
        _set_registers(regs[1], spec)

        @pl.loop(0, ctx.n_steps)
        def _(i):
            with scope("convert"):
                ctx.finish(lax.rem(i, 2), B, scales=False)

    def _first_half_converter():
        _set_registers(regs[3], spec)

        @pl.loop(0, ctx.n_steps)
        def _(i):
            with scope("convert"):
                for p in (A, R):
                    ctx.finish(lax.rem(i, 2), p, scales=p == A)

    pl.when(jnp.logical_and(wg == 0, active))(_leader)
    if conv:
        pl.when(jnp.logical_and(wg == 1, active))(_second_half_converter)
        pl.when(jnp.logical_and(wg == 3, active))(_first_half_converter)
    else:
        pl.when(jnp.logical_and(wg == 1, active))(_second)

    def issue_block(i):
        slot = lax.rem(i, 2)
        where = ctx.pages(i)  # before the wait: the page-table loads overlap it

        @pl.when(i >= 2)
        def _():
            with scope("wait_slot"):
                plgpu.barrier_wait(bars["consumed"].at[slot])

        for p in (A, B, R):
            ctx.issue(i, slot, p, scales=p == A, where=where)

    @pl.when(jnp.logical_and(wg == 2, active))
    def _loader():
        _set_registers(regs[2], spec)
        if spec.qk8:  # block i + 1's loads go out before block i's conversion, which waits for block i's Q.K

            @pl.when(ctx.n_steps >= 1)  # (a row with nothing to read has a unit of no blocks)
            def _():
                issue_block(0)

        @pl.loop(0, ctx.n_steps)
        def _(i):
            slot = lax.rem(i, 2)
            if not spec.qk8:
                issue_block(i)
                ctx.prefetch(i + 1)
                if conv:  # (the converter warpgroups convert)
                    return
                with scope("convert"):  # (int8; the waits for the parts' TMAs included)
                    for p in (A, R) if split else (A, B, R):
                        ctx.finish(slot, p, scales=p == A)
                return

            @pl.when(i + 1 < ctx.n_steps)
            def _():
                issue_block(i + 1)
                ctx.prefetch(i + 2)

            with scope("wait_qk"):
                plgpu.barrier_wait(bars["qk"].at[slot])
            with scope("convert"):
                ctx.convert_part(slot, A)  # V's first half (WG1 converts the second; the rope part takes P)

        # Observe the last slots' releases too: a waiter must see every phase of its barriers (the interpreter
        # checks).
        @pl.loop(jnp.maximum(ctx.n_steps - 2, 0), ctx.n_steps)
        def _(i):
            plgpu.barrier_wait(bars["consumed"].at[lax.rem(i, 2)])


def _set_registers(n: int, spec: KernelSpec):
    """setmaxnreg to n registers a thread, up or down from the launch's count (nothing when equal)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    launch = launch_registers(spec.warpgroups)
    if n != launch:
        plgpu.set_max_registers(n, action="increase" if n > launch else "decrease")


def _kernel(spec: KernelSpec, *refs):
    names = ["q_nope", "q_pe"] + (["qs"] if spec.qk8 else []) + ["kv"] + (["sc"] if spec.quant else [])
    names += ["pt"] + (["layer"] if spec.layer_pages else []) + ["vis", "work"]
    ins = dict(zip(names, refs[: len(names)], strict=True))
    rest = list(refs[len(names) :])
    out = (rest.pop(0), rest.pop(0)) if spec.batch else None
    part_out = (rest.pop(0), rest.pop(0)) if spec.slots else None
    ((q_views, parts, rows, scales, qs), bars) = rest
    q_in, *q_f16, o_smem = q_views  # (with f16, Q's bf16 and fp16 views)
    if spec.quant:
        i8 = tuple(u[1] for u in parts)
        parts = tuple(u[0] for u in parts)
    else:
        i8 = None
    names = ["q", "full", "consumed", "sig"] + (["i8", "sc"] if spec.quant else []) + (["qk"] if spec.qk8 else [])
    bars = dict(zip(names, bars[: len(names)], strict=True))

    n_ht = spec.heads // BLOCK
    qt, unit, wg = lax.axis_index("qt"), lax.axis_index("unit"), lax.axis_index("wg")
    if spec.pair:  # the grid counts pairs of head tiles
        qt = qt * 2 + lax.axis_index("pair")
    work = ins["work"]
    # This CTA's work unit (mla_schedule): row b, blocks [blk0, blk0 + n_blk), where the output goes.
    b, blk0, n_blk, dest = work[0, unit], work[1, unit], work[2, unit], work[3, unit]
    t = lax.div(qt, n_ht) * spec.stack
    vis_tokens = tuple(ins["vis"][b, t + k] for k in range(spec.stack))
    vis = functools.reduce(jnp.maximum, vis_tokens)
    start = blk0 * BLOCK_KV
    n_steps = jnp.minimum(lax.div(jnp.maximum(vis - start, 0) + (BLOCK_KV - 1), BLOCK_KV), n_blk)
    ctx = Cta(
        spec=spec,
        ins=ins,
        out=out,
        part_out=part_out,
        q=tuple(q_f16[0]) if q_f16 else tuple(q_in),
        q_in=tuple(q_in),
        qs=qs,
        o_smem=o_smem,
        parts=parts,
        i8=i8,
        rows=rows,
        scales=scales,
        bars=bars,
        b=b,
        t=t,
        h0=lax.rem(qt, n_ht) * BLOCK,
        start=start,
        vis=vis,
        vis_tokens=vis_tokens,
        n_steps=n_steps,
        dest=dest,
    )
    _v3(ctx, wg, dest != PADDING)


def _out_type(spec: KernelSpec) -> tuple[jax.ShapeDtypeStruct, ...]:
    """The kernel's outputs: (out, lse) for the rows it finishes, then (partial, lse) for split rows' slots (outputs
    of spec.io_heads heads, lse of spec.heads, the tokens stacked into one row with spec.stack)."""
    out_type = []
    for rows in (spec.batch, spec.slots):
        if rows:
            out_type += [
                jax.ShapeDtypeStruct((rows, spec.t, spec.io_heads, spec.c), jnp.bfloat16),
                jax.ShapeDtypeStruct((rows, spec.lse_tokens, spec.heads), jnp.float32),
            ]
    return tuple(out_type)


def _launch_kernel(spec: KernelSpec):
    """The kernel of one launch, from its spec alone (lowering_cache may build it in another process)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    return plgpu.kernel(
        functools.partial(_kernel, spec),
        out_type=_out_type(spec),
        scratch_types=smem_types(spec),
        grid=(spec.lse_tokens * (spec.heads // BLOCK) // (2 if spec.pair else 1), spec.units),
        grid_names=("qt", "unit"),
        **(dict(cluster=(2,), cluster_names=("pair",)) if spec.pair else {}),
        num_threads=spec.warpgroups,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, **profile_params(spec.profile)),
        kernel_name=f"mla_decode_{'int8' if spec.quant else 'bf16'}",  # in profiles: "mla_decode_bf16_mosaic..."
    )


def attention(spec: KernelSpec, q_nope, q_pe, kv, sc, pt, vis, work, qs=None, layer=None):
    """Runs the attention kernel (layer: [1] int32 with spec.layer_pages, else None). -> (out [batch, T, H, C] bf16,
    lse [batch, T, H] f32) if spec.batch, then (partial [slots, T, H, C], lse [slots, T, H]) if spec.slots."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if (layer is None) != (not spec.layer_pages):
        raise ValueError("a layer operand goes with spec.layer_pages, and only with it")
    kern = functools.partial(_launch_kernel, spec)
    args = (q_nope, q_pe) + ((qs,) if spec.qk8 else ()) + (kv,) + ((sc,) if spec.quant else ()) + (pt,)
    args += ((layer,) if spec.layer_pages else ()) + (vis, work)
    if spec.interpret:
        # Enough simulated TMA engines for every copy the kernel keeps in flight.
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(num_tma_threads_per_device=16)):
            return kern()(*args)
    if spec.profile:  # the in-kernel profiler's output is the traced program's, not an exported module's
        return kern()(*args)
    return lowering_cache.launch(("mla_decode", spec), kern, *args, out=_out_type(spec))
