"""One CTA of the MLA decode kernel (mla_kernel.py): its refs and work unit, and the operations its warpgroups
share: loading Q, issuing a cache block's TMAs, converting int8 parts, Q.K, masking, storing the output; and the
online softmax's pieces the leader uses (its state, the P.V update, the final 1/l and lse)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.int8_f16 import to_f16
from pallas_kernels.int_sums import MAGIC, MAGIC_F
from pallas_kernels.mla_kernel_spec import LOG2E, P_SCALE, PART_NAMES, ROPE_SHIFT, A, B, KernelSpec, R, scope
from pallas_kernels.mla_schedule import BLOCK, BLOCK_KV, DIRECT

LN2 = math.log(2.0)  # log2 -> natural-log lse


@dataclasses.dataclass(frozen=True)
class Cta:
    """One CTA's refs and work unit, shared by the warpgroups' code."""

    spec: KernelSpec
    ins: dict
    out: tuple  # (out, lse) or None
    part_out: tuple  # (partial out, partial lse) or None
    q: tuple  # smem (latent [64, C], rope [64, R]): bf16, fp16 with f16, int8 with qk8
    q_in: tuple  # where Q's TMAs land: q, or with f16 its bf16 view (the leader converts it in place: `load_q`)
    qs: object  # qk8: smem [3, 64] f32, the heads' scales of Q's parts (A, B, rope); else None
    o_smem: object  # [2, 64, C/2] output halves (aliases q)
    parts: tuple  # per part: bf16 or fp16 (f16) [2, 64, w] (slot-major)
    i8: tuple  # per part: int8 [2, 2, 64, w] twins overlaying the 16-bit parts (int8 caches), else None
    rows: object  # [4, 64] f32 row vectors handed between warpgroups
    scales: object  # [2, 2, 64] f32 int8 scales per slot, or None
    bars: dict
    b: object
    t: object  # the CTA's (first) query token
    h0: object
    start: object
    vis: object  # keys visible to the CTA's queries (with stacked tokens, the most any of them sees)
    vis_tokens: tuple  # with stacked tokens, each one's visible keys (spec.stack scalars)
    n_steps: object
    dest: object

    def page(self, i):
        """(page, offset in page) of the unit's block i in the cache, and its page-table column."""
        tok = self.start + i * BLOCK_KV
        j = jnp.minimum(lax.div(tok, self.spec.page_size), self.spec.max_pages - 1)
        page = self.ins["pt"][self.b, j]
        if self.spec.layer_pages:
            page = page + self.ins["layer"][0] * self.spec.layer_pages
        return page, lax.rem(tok, self.spec.page_size), j

    def scores(self, slot: int | jax.Array, order):
        """S = Q . K^T [64 heads, 64 tokens] of the block in `slot`, f32 (transposed: S^T = K . Q^T [64 tokens,
        q_rows]): one wgmma per part in `order`, each issued once its part has landed."""
        import jax.experimental.pallas as pl
        import jax.experimental.pallas.mosaic_gpu as plgpu

        def body(s_ref):
            for p in order:
                with scope("wait_" + PART_NAMES[p]):  # (the timeline's: which part the leader waits for)
                    plgpu.barrier_wait(self.bars["full"].at[slot * 3 + p])
                col, w = self.spec.part(p)
                q = self.q[1] if p == R else self.q[0].at[:, pl.ds(col, w)]
                k = self.parts[p].at[slot]
                if self.spec.transposed:  # (the tile's first q_rows rows)
                    plgpu.wgmma(s_ref, k, q.at[pl.ds(0, self.spec.q_rows)].transpose((1, 0)))
                else:
                    plgpu.wgmma(s_ref, q, k.transpose((1, 0)))
            return s_ref[...]

        shape = (BLOCK_KV, self.spec.q_rows) if self.spec.transposed else (BLOCK, BLOCK_KV)
        return pl.run_scoped(body, plgpu.ACC(shape))

    def scores_i8(self, slot, fast: bool, factor: float = 1.0):
        """qk8: S [64 heads, 64 tokens] f32 of the block in `slot` from int8 Q and the landed int8 block, one int32
        accumulator per part (a part's sum is at most 256 x 127 x 127 < 2^22, so it starts at MAGIC and its bits read
        as an f32 without a conversion; A and B together could reach 2^23), then the per-token cache scales and the
        per-head query scales (one per part): S = s_lat (sq_a a + sq_b b) + s_rope sq_r r, times `factor` (taken
        on the per-token scales). Signals `qk` as soon as the MMAs are done, so the loader and WG1 may convert the
        block's latent in place."""
        import jax.experimental.pallas as pl
        import jax.experimental.pallas.mosaic_gpu as plgpu

        def body(*accs):
            if fast:  # every accumulator starts before the first wgmma (ptxas serialises stores between in-flight
                # wgmmas, docs/kernels.md); the interpreter cannot store to an accumulator: it adds MAGIC below
                for acc in accs:
                    acc[...] = plgpu.layout_cast(jnp.full((BLOCK, BLOCK_KV), MAGIC, jnp.int32), plgpu.Layout.WGMMA)
            for p, acc in zip((A, B, R), accs, strict=True):
                plgpu.barrier_wait(self.bars["i8"].at[slot * 3 + p])
                col, w = self.spec.part(p)
                twin = self.i8[p].at[slot, 0]
                for c0 in range(0, w, 64):
                    q = self.q[1] if p == R else self.q[0].at[:, pl.ds(col + c0, 64)]
                    plgpu.wgmma(acc, q, twin.at[:, pl.ds(c0, 64)].transpose((1, 0)))
            return tuple(acc[...] for acc in accs)

        with scope("mma"):  # (the parts' waits and the accumulators' read-out included)
            sums = pl.run_scoped(body, *[plgpu.ACC((BLOCK, BLOCK_KV), jnp.int32)] * 3)
        plgpu.barrier_arrive(self.bars["qk"].at[slot])
        with scope("scale"):
            a, b_, r = (lax.bitcast_convert_type(v if fast else v + MAGIC, jnp.float32) - MAGIC_F for v in sums)
            plgpu.barrier_wait(self.bars["sc"].at[slot])
            col, row = plgpu.Layout.WGMMA.reduce(0), plgpu.Layout.WGMMA.reduce(1)
            s_lat, s_rope = (
                lax.broadcast_in_dim(plgpu.load(self.scales.at[slot, i], layout=col) * factor, a.shape, [1])
                for i in (0, 1)
            )
            sq_a, sq_b, sq_r = (
                lax.broadcast_in_dim(plgpu.load(self.qs.at[i], layout=row), a.shape, [0]) for i in range(3)
            )
            return (a * sq_a + b_ * sq_b) * s_lat + r * sq_r * s_rope

    def masked(self, s, i, scaled: bool = True):
        """Scores of block i in the log2 domain (`scaled`; else as they are), -inf past the query's visible keys."""
        import jax.experimental.pallas.mosaic_gpu as plgpu

        key_axis = self.spec.key_axis  # (S^T: the keys down its rows, the query rows across)
        key = plgpu.broadcasted_iota(jnp.int32, s.shape, key_axis, layout=plgpu.Layout.WGMMA)
        key = key + (self.start + i * BLOCK_KV)
        limit = self.vis
        if self.spec.stack > 1:  # each stacked token's rows at its own visible keys
            row = plgpu.broadcasted_iota(jnp.int32, s.shape, 1 - key_axis, layout=plgpu.Layout.WGMMA)
            limit = self.vis_tokens[0]
            for k, vis in enumerate(self.vis_tokens[1:], 1):
                limit = jnp.where(row >= k * self.spec.q_heads, vis, limit)
        return jnp.where(key < limit, s * (self.spec.sm_scale * LOG2E) if scaled else s, -jnp.inf)

    def load_q(self, issue: bool):
        import jax.experimental.pallas as pl
        import jax.experimental.pallas.mosaic_gpu as plgpu

        q_bar = self.bars["q"]
        if issue:
            # (with q_heads, the tile's other rows are never stored; stacked tokens: token t + k in its own rows)
            heads = pl.ds(self.h0, self.spec.tile_rows)
            for k in range(self.spec.stack):
                for name, dst in zip(("q_nope", "q_pe"), self.q_in, strict=True):
                    dst = self.spec.token_rows(dst, k)
                    src = self.ins[name]
                    if name == "q_nope" and self.spec.heads_first:
                        src = src.at[heads, self.b, self.t + k]
                    else:
                        src = src.at[self.b, self.t + k, heads]
                    plgpu.copy_gmem_to_smem(src, dst, q_bar.at[0])
            if self.spec.qk8:  # (the scales are padded to whole tiles)
                plgpu.copy_gmem_to_smem(
                    self.ins["qs"].at[self.b, self.t, :, pl.ds(self.h0, BLOCK)], self.qs, q_bar.at[0]
                )
        plgpu.barrier_wait(q_bar.at[0])
        if self.spec.f16:  # bf16 -> fp16 in place, a [64, 64] tile at a time (all of it read, then written)
            for src, dst, shift in zip(self.q_in, self.q, (1.0, ROPE_SHIFT), strict=True):
                for j in range(src.shape[1] // 64):
                    x = src.at[:, pl.ds(64 * j, 64)][...]
                    plgpu.commit_smem()
                    dst.at[:, pl.ds(64 * j, 64)][...] = (x * shift if shift != 1 else x).astype(dst.dtype)
            plgpu.commit_smem()

    def store(self, acc, inv_l, w: int, lse=None):
        """Writes output half w (acc / l, bf16) and, when given, the lse, to the output or the partial slot."""
        import jax.experimental.pallas as pl
        import jax.experimental.pallas.mosaic_gpu as plgpu

        half = self.spec.c // 2
        heads, cols = pl.ds(self.h0, self.spec.tile_rows), pl.ds(w * half, half)
        o_half = self.o_smem.at[w]
        o_acc = o_half  # where acc goes; with transposed tiles acc is O^T [C/2, q_rows], the staging's first rows
        if self.spec.transposed:
            o_acc = o_half.at[pl.ds(0, self.spec.q_rows)].transpose((1, 0))
        query_axis = 1 - self.spec.key_axis  # (of O, or of O^T)
        o_acc[...] = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [query_axis])).astype(o_half.dtype)
        if lse is not None:
            self.query_vector(3)[...] = lse
        plgpu.commit_smem()
        targets = []
        if self.out is not None:
            targets.append((self.dest == DIRECT, self.out, self.b))
        if self.part_out is not None:
            targets.append((self.dest >= 0, self.part_out, jnp.maximum(self.dest, 0)))
        for on, (o_ref, l_ref), idx in targets:

            @pl.when(on)
            def _(o_ref=o_ref, l_ref=l_ref, idx=idx):
                for k in range(self.spec.stack):
                    plgpu.copy_smem_to_gmem(self.spec.token_rows(o_half, k), o_ref.at[idx, self.t + k, heads, cols])
                if lse is not None:  # (stacked: one row of the lse output holds every token's)
                    lse_at = l_ref.at[idx, lax.div(self.t, self.spec.stack), pl.ds(self.h0, BLOCK)]
                    plgpu.copy_smem_to_gmem(self.rows.at[3], lse_at)

        plgpu.wait_smem_to_gmem(0)

    def pages(self, i):
        """Where block i lies: (page, offset) in the cache and, int8, in the scales' table. Global loads: the v3
        loader reads them before it waits for the slot, so their latency overlaps the wait instead of following it
        (ncu's dominant stall in this kernel was long_scoreboard, docs/kernels.md)."""
        page, off, j = self.page(i)
        if not self.spec.quant:
            return (page, off), None
        return (page, off), (self.b * self.spec.max_pages + j if self.spec.scale_rows else page, off)

    def issue(self, i, slot, p: int, scales: bool, where=None):
        """Starts loading part p of the unit's block i into `slot`: a TMA into the part (bf16 caches) or into its int8
        twin, plus, with `scales`, the block's int8 scales. `where`: the block's `pages(i)`, if already read."""
        import jax.experimental.pallas as pl
        import jax.experimental.pallas.mosaic_gpu as plgpu

        col, w = self.spec.part(p)
        where = where or self.pages(i)
        page, off = where[0]
        src = self.ins["kv"].at[page, pl.ds(off, BLOCK_KV), pl.ds(col, w)]
        if not self.spec.quant:
            dst, bar = self.parts[p].at[slot], self.bars["full"].at[slot * 3 + p]
        else:
            dst, bar = self.i8[p].at[slot, 0], self.bars["i8"].at[slot * 3 + p]
        plgpu.copy_gmem_to_smem(src, dst, bar, collective_axes=self.spec.collective())
        if scales and self.spec.quant:
            page, off = where[1]
            sc = self.ins["sc"].at[page, :, pl.ds(off, BLOCK_KV)]
            plgpu.copy_gmem_to_smem(
                sc, self.scales.at[slot], self.bars["sc"].at[slot], collective_axes=self.spec.collective()
            )

    def finish(self, slot, p: int, scales: bool):
        """int8: converts the landed part p into bf16 or fp16 in place and marks it loaded (`convert_part`; a bf16
        cache: nothing to do)."""
        import jax.experimental.pallas.mosaic_gpu as plgpu

        if not self.spec.quant:
            return
        with scope("land"):  # (the timeline's: the wait for the part's TMA, apart from its conversion)
            if scales:
                plgpu.barrier_wait(self.bars["sc"].at[slot])
            plgpu.barrier_wait(self.bars["i8"].at[slot * 3 + p])
        if p != R:  # the latent scale is applied to S and P by the leader (`latent_scale`)
            self.convert_part(slot, p)
            return
        token = plgpu.Layout.WGMMA.reduce(1)
        # the rope relative to the latent scale, which multiplies all of S
        scale = plgpu.load(self.scales.at[slot, 1], layout=token)
        scale = scale / _nonzero(plgpu.load(self.scales.at[slot, 0], layout=token))
        if self.spec.f16:  # (Q's rope part is ROPE_SHIFT times larger)
            scale = scale * (1.0 / ROPE_SHIFT)
        scale = lax.broadcast_in_dim(scale, (BLOCK_KV, 64), [0])
        dtype = self.spec.compute_dtype()
        self.convert_part(slot, p, lambda x: (x.astype(jnp.float32) * scale).astype(dtype))

    def convert_part(self, slot, p: int, convert=None, mark: bool = True):
        """Part p of `slot` from its landed int8 twin to bf16 or fp16 in place, then (`mark`) marked loaded. The whole
        twin is read into registers before any 16-bit store, since the twin overlays the part's bytes. convert: int8
        tile -> bf16 or fp16 (default: exact, the scales applied to S and P; integer and bf16x2 or fp16x2 ops, no I2F:
        2.5 a value for bf16, 1.25 for fp16, int8_f16.py)."""
        import jax.experimental.pallas as pl
        import jax.experimental.pallas.mosaic_gpu as plgpu

        w = self.spec.part(p)[1]
        twin, dst = self.i8[p].at[slot, 0], self.parts[p].at[slot]
        tiles = [plgpu.load(twin.at[:, pl.ds(64 * j, 64)], layout=plgpu.Layout.WGMMA_8BIT) for j in range(w // 64)]
        plgpu.commit_smem()  # also a warpgroup barrier: every thread has read the twin
        for j, x in enumerate(tiles):
            if convert is None:
                y = to_f16(x, fast=not self.spec.interpret) if self.spec.f16 else x.astype(dst.dtype)
            else:
                y = convert(x)
            dst.at[:, pl.ds(64 * j, 64)][...] = y
        plgpu.commit_smem()
        if mark:  # (False: the converting warpgroup is the part's only reader)
            plgpu.barrier_arrive(self.bars["full"].at[slot * 3 + p])

    def latent_scale(self, slot, shape=(BLOCK, BLOCK_KV)):
        """int8: the block's latent scales over S's key columns, or S^T's key rows when transposed (for P, times
        P_SCALE with f16; for S, zero scales as 1)."""
        import jax.experimental.pallas.mosaic_gpu as plgpu

        key_axis = self.spec.key_axis
        sc = plgpu.load(self.scales.at[slot, 0], layout=plgpu.Layout.WGMMA.reduce(1 - key_axis))
        sc_v = sc * P_SCALE if self.spec.f16 else sc
        return tuple(lax.broadcast_in_dim(v, shape, [key_axis]) for v in (sc_v, _nonzero(sc)))

    def query_vector(self, i: int):
        """Row i of the [4, 64] vectors handed between warpgroups, one value per query row of the tile: all 64
        entries, or the first q_rows when transposed."""
        import jax.experimental.pallas as pl

        return self.rows.at[i, pl.ds(0, self.spec.q_rows)]

    def prefetch(self, i):
        """int8: warms L2 with block i (its TMA cannot start before its slot is free)."""
        import jax.experimental.pallas as pl
        import jax.experimental.pallas.mosaic_gpu as plgpu

        if self.spec.quant:
            page, off, _ = self.page(i)
            for p in range(3):  # one per part: a TMA box is at most 256 wide
                col, w = self.spec.part(p)
                src = self.ins["kv"].at[page, pl.ds(off, BLOCK_KV), pl.ds(col, w)]
                plgpu.async_prefetch(src, predicate=i < self.n_steps)


def _nonzero(scale):
    """Zero scales (all-zero latent rows) as 1: the latent is then 0 whatever scale multiplies it."""
    return jnp.where(scale > 0, scale, 1.0)


def pv_update(acc, p_smem, v_smem, spec: KernelSpec):
    """acc + P @ V with P, V in smem (transposed: acc^T + V^T @ P^T, P^T staged as [q_rows, 64]). On the GPU the
    accumulator is fed to wgmma in place (pl.run_state, which waits for the MMA); GPU interpret mode has no run_state,
    so there it is a fresh accumulator added in registers."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if spec.transposed:
        a, b = v_smem.transpose((1, 0)), p_smem.transpose((1, 0))
    else:
        a, b = p_smem, v_smem
    if spec.interpret:

        def fresh(r):
            plgpu.wgmma(r, a, b)
            return r[...]

        return acc + pl.run_scoped(fresh, plgpu.ACC(acc.shape, jnp.float32))
    return pl.run_state(lambda r: plgpu.wgmma(r, a, b))(plgpu.ACC.init(acc))


def finish_rows(m, den):
    """(1 / l, natural-log lse) from the running max (log2 domain) and the row sums; rows with nothing visible get
    zeros and -inf."""
    inv_l = jnp.where(den > 0, 1.0 / jnp.maximum(den, 1e-30), 0.0)
    lse = jnp.where(den > 0, (m + jnp.log2(jnp.maximum(den, 1e-30))) * LN2, -jnp.inf)
    return inv_l, lse


def initial_state(spec: KernelSpec):
    """A warpgroup's output half (O, or O^T when transposed) and the running max and sum, one per query row."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    n, half = spec.q_rows, spec.c // 2
    vec = query_layout(spec)
    m0 = plgpu.layout_cast(jnp.full((n,), -1e30, jnp.float32), vec)
    l0 = plgpu.layout_cast(jnp.zeros((n,), jnp.float32), vec)
    shape = (half, n) if spec.transposed else (n, half)
    acc0 = plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)
    return acc0, m0, l0


def query_layout(spec: KernelSpec):
    """The layout of a vector with one value per query row: S's rows, or S^T's columns when transposed."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    return plgpu.Layout.WGMMA.reduce(spec.key_axis)


def p_tile(ctx: Cta, slot):
    """Where a block's P goes: its slot's rope part, [64, 64], or its first q_rows rows for P^T when transposed."""
    import jax.experimental.pallas as pl

    p_smem = ctx.parts[R].at[slot]
    return p_smem.at[pl.ds(0, ctx.spec.q_rows)] if ctx.spec.transposed else p_smem
