"""The Mosaic GPU (Hopper) attention kernel of absorbed-MLA decode over the paged latent cache (mla_decode.py is the
wrapper, mla_schedule.py builds its work list, mla_merge.py merges the rows it splits).

Attention: one CTA = 64 heads of one query token over one work unit (a row's block range), three warpgroups: WG0
and WG1 compute, WG2 loads. A cache block (64 tokens) sits in one of two smem slots, as three parts with a barrier
each: A = latent columns [0, C/2), B = [C/2, C), R = rope columns [C, C+R). A and B are V's two column halves; R is
dead after Q.K and holds the block's softmax P ([64, 64] in the MMAs' 16-bit type, the same 128-byte swizzle as V,
which wgmma wants).
Q sits in smem as its latent and rope parts (two TMAs straight from q_nope and q_pe); the output halves reuse it.
The f32 accumulator [64, C] does not fit one warpgroup's registers for C=512: WG0 owns O[:, :C/2], WG1 O[:, C/2:].

The schedule (version 3, leader and follower): WG0 computes S = Q.K^T for every block, the online softmax, writes P
and the row rescale, and updates its half; WG1 waits for that block's P and updates the other half. WG0 does 3/4 of
the MMA work and all of the softmax, so it is the critical path; with a bf16 cache WG1 mostly waits (with int8 it
converts: below). A slot is reloaded once both have released it. (Version 4, a seesaw over pairs of blocks that
split the MMAs evenly, measured 1.7x slower on the H200 and was dropped: docs/kernels.md.)

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

Head-tile pairs (`KernelSpec.pair`, H a multiple of 128): the CTAs of a token's two head tiles form a cluster; each
loads half of every block and multicasts it into both, and a slot is reloaded once both CTAs have released it (a
cluster barrier), so the cache crosses from L2 into the SMs once per 128 heads, not once per 64.

Outputs: a unit writes its normalized bf16 rows and lse either straight to the output (the row's only unit) or to
its partial slot, as the work list says (mla_schedule.DIRECT / slot).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.int8_f16 import to_f16
from pallas_kernels.int_sums import MAGIC, MAGIC_F
from pallas_kernels.mla_schedule import BLOCK, BLOCK_KV, DIRECT, PADDING

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)
# The v3 loops' named regions ("qk", "softmax", "pv", "convert", the barrier waits): no code unless the kernel is built
# with Mosaic GPU's profiler (KernelSpec.profile, `profile_params`), which then records each region's start and
# end clock per warpgroup (python -m pallas_kernels.bench.timeline).
scope = jax.named_scope
A, B, R = 0, 1, 2  # slot parts
# Registers per thread of (WG0, WG1, loader): the three must sum to at most 504 (504 x 128 is what the CTA holds at
# launch; asking for 512 left setmaxnreg waiting forever on the H200). An int8 converter holds a part in registers.
# v3's splits are ptxas's (the SASS of the H=128 kernel, docs/kernels.md): at (232, 232, 40) the
# leader spilled 14 values a block in its loop (bf16; 22 with int8), at (256, 208, 40) nothing spills in either
# compute loop; int8 at (248, 176, 80) leaves 8 in the leader, 4 in the loader (was 22 and 6). qk8 (the third key:
# int8 Q.K): at (248, 176, 80) ptxas waited after each of the leader's 26 wgmmas (serialised them) and spilled 264
# bytes; at (256, 176, 72) it waits 5 times and spills 100 (WG1, which converts V's second half, reloads 3 values a
# block). Timed on the H200 at 128 x 4096 (docs/kernels.md): 445 -> 375 us with the loader converting both halves, 350
# with WG1 converting one; (256, 184, 64) spills less and ran 369. The int8 split was chosen before WG1 took over
# the second latent half's conversion (2026-12-01: WG1 now holds an int8 tile beside its half of O, the loader
# converts less); it has not been re-read or re-timed since.
REGISTERS = {  # by (int8 cache, qk8)
    (False, False): (256, 208, 40),
    (True, False): (248, 176, 80),
    (True, True): (256, 176, 72),
}
P_SCALE = 256.0  # f16: P goes out as P x latent scale x P_SCALE (KernelSpec.f16)
ROPE_SHIFT = 16.0  # f16: the rope part holds int8 x s_rope / s_latent / ROPE_SHIFT, Q's rope part x ROPE_SHIFT
LAUNCH_REGISTERS = 168  # per thread at launch: 64 Ki registers over 3 x 128 threads, down to a multiple of 8


def check_registers(split) -> tuple[int, int, int]:
    """A (WG0, WG1, loader) split that setmaxnreg can make: multiples of 8 in [24, 256], the compute warpgroups
    growing from the launch's 168, the loader shrinking, the three within the CTA's 504 x 128 registers."""
    split = tuple(int(n) for n in split)
    ok = len(split) == 3 and sum(split) <= 3 * LAUNCH_REGISTERS and all(n % 8 == 0 and 24 <= n <= 256 for n in split)
    if not (ok and min(split[:2]) > LAUNCH_REGISTERS > split[2]):
        raise ValueError(f"register split {split}: 3 multiples of 8 in [24, 256], WG0, WG1 > 168 > loader, sum <= 504")
    return split


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    c: int  # kv_lora_rank
    r: int  # rope dim
    t: int  # query tokens per row
    heads: int  # padded to a multiple of BLOCK
    page_size: int
    max_pages: int  # page table width
    units: int  # work units in the grid, padding included
    batch: int  # rows of the direct output (0: no unit writes it)
    slots: int  # rows of the partial output (0: none)
    quant: bool
    sm_scale: float
    interpret: bool
    # Run the two head tiles of a query token as a cluster of two CTAs that multicast each cache block into both
    # (each loads half): the cache crosses L2 -> SM once per 128 heads instead of once per 64. Needs an even number
    # of head tiles; GPU interpret mode has no multicast copies.
    pair: bool = False
    registers: tuple[int, int, int] | None = None  # the warpgroups' register split (None: REGISTERS)
    # int8 caches: Q.K on the int8 tensor cores straight from the landed int8 blocks, Q quantised per head
    # and part (the latent's halves A and B, the rope: one scale each) by the wrapper; only the latent (V) is
    # converted to bf16, after the block's Q.K, beside the leader's softmax (half by the loader, half by WG1).
    # Opt-in (HCFJAX_MLA_QK8 in the model): the queries' rounding adds error, and it pays only on long rows
    # (docs/results.md, "MLA decode kernel").
    qk8: bool = False
    # int8 caches without qk8 (the wrapper's default there): fp16 rather than bf16 for the converted
    # cache, Q (converted in place by the leader) and P. fp16's mantissa holds a byte whole, so the latent's exact
    # conversion is 1.25 operations a value instead of 2.5 (int8_f16.py). P goes to P.V as P x latent scale x
    # P_SCALE (without it P would go subnormal for latent scales below ~1e-3), and 1/l takes P_SCALE out again. fp16's
    # range (65504) bounds what is converted: the latent queries (|q| < 65504), the rope queries times ROPE_SHIFT
    # (|q_pe| < 4094), the rope's int8 times s_rope / s_latent / ROPE_SHIFT (s_rope / s_latent < 8252 per token) and
    # P x s_latent x P_SCALE (s_latent < 255, latent values below ~32,000). Not with qk8 (fp16 measured slower there).
    # bf16 has no such bounds; RMS-normalised latents (DeepSeek's kv_a_layernorm) and rope keys sit far inside them.
    f16: bool = False
    # Mosaic GPU's in-kernel profiler: "DIR[:RANGES]" (`profile_params`), or "" for none (bench.timeline)
    profile: str = ""

    def __post_init__(self):
        if not self.sm_scale > 0:  # the softmax takes the scale on its row max (v3, bf16)
            raise ValueError(f"sm_scale must be positive, got {self.sm_scale}")
        if self.qk8 and not self.quant:
            raise ValueError("qk8 needs an int8 cache")
        if self.qk8 and self.c // 2 > 256:  # an int8 part's sum must stay below 2^22 (MAGIC)
            raise ValueError(f"qk8 takes a latent of at most 512 columns, got {self.c}")
        if self.f16 and not self.quant:
            raise ValueError("f16 needs an int8 cache")
        if self.f16 and self.qk8:  # (qk8's queries are int8; its latent measured slower in fp16)
            raise ValueError("f16 and qk8 do not go together")

    def register_split(self) -> tuple[int, int, int]:
        return self.registers or REGISTERS[(self.quant, self.qk8)]

    def compute_dtype(self):
        """The dtype of the converted cache parts (and of Q without qk8, and of P)."""
        return jnp.float16 if self.f16 else jnp.bfloat16

    def collective(self):
        return "pair" if self.pair else None

    def part(self, p: int) -> tuple[int, int]:
        """(first column, width) of slot part p."""
        return ((0, self.c // 2), (self.c // 2, self.c // 2), (self.c, self.r))[p]


def _pv(acc, p_smem, v_smem, interpret: bool):
    """acc + P @ V with P, V in smem. On the GPU the accumulator is fed to wgmma in place (pl.run_state, which waits
    for the MMA); GPU interpret mode has no run_state, so there it is a fresh accumulator added in registers."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if interpret:

        def fresh(r):
            plgpu.wgmma(r, p_smem, v_smem)
            return r[...]

        return acc + pl.run_scoped(fresh, plgpu.ACC(acc.shape, jnp.float32))
    return pl.run_state(lambda r: plgpu.wgmma(r, p_smem, v_smem))(plgpu.ACC.init(acc))


@dataclasses.dataclass(frozen=True)
class _Ctx:
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
    t: object
    h0: object
    start: object
    vis: object
    n_steps: object
    dest: object

    def page(self, i, table):
        """(page, offset in page) of the unit's block i."""
        tok = self.start + i * BLOCK_KV
        j = jnp.minimum(lax.div(tok, self.spec.page_size), self.spec.max_pages - 1)
        return table[self.b, j], lax.rem(tok, self.spec.page_size)

    def scores(self, slot: int | jax.Array, order):
        """S = Q . K^T [64 heads, 64 tokens] of the block in `slot`, f32: one wgmma per part in `order`, each issued
        once its part has landed."""
        import jax.experimental.pallas as pl
        import jax.experimental.pallas.mosaic_gpu as plgpu

        def body(s_ref):
            for p in order:
                plgpu.barrier_wait(self.bars["full"].at[slot * 3 + p])
                col, w = self.spec.part(p)
                q = self.q[1] if p == R else self.q[0].at[:, pl.ds(col, w)]
                plgpu.wgmma(s_ref, q, self.parts[p].at[slot].transpose((1, 0)))
            return s_ref[...]

        return pl.run_scoped(body, plgpu.ACC((BLOCK, BLOCK_KV)))

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

        key = plgpu.broadcasted_iota(jnp.int32, (BLOCK, BLOCK_KV), 1, layout=plgpu.Layout.WGMMA)
        key = key + (self.start + i * BLOCK_KV)
        return jnp.where(key < self.vis, s * (self.spec.sm_scale * _LOG2E) if scaled else s, -jnp.inf)

    def load_q(self, issue: bool):
        import jax.experimental.pallas as pl
        import jax.experimental.pallas.mosaic_gpu as plgpu

        q_bar = self.bars["q"]
        if issue:
            heads = pl.ds(self.h0, BLOCK)
            plgpu.copy_gmem_to_smem(self.ins["q_nope"].at[self.b, self.t, heads], self.q_in[0], q_bar.at[0])
            plgpu.copy_gmem_to_smem(self.ins["q_pe"].at[self.b, self.t, heads], self.q_in[1], q_bar.at[0])
            if self.spec.qk8:
                plgpu.copy_gmem_to_smem(self.ins["qs"].at[self.b, self.t, :, heads], self.qs, q_bar.at[0])
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
        heads, cols = pl.ds(self.h0, BLOCK), pl.ds(w * half, half)
        o_half = self.o_smem.at[w]
        o_half[...] = (acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])).astype(o_half.dtype)
        if lse is not None:
            self.rows.at[3][...] = lse
        plgpu.commit_smem()
        targets = []
        if self.out is not None:
            targets.append((self.dest == DIRECT, self.out, self.b))
        if self.part_out is not None:
            targets.append((self.dest >= 0, self.part_out, jnp.maximum(self.dest, 0)))
        for on, (o_ref, l_ref), idx in targets:

            @pl.when(on)
            def _(o_ref=o_ref, l_ref=l_ref, idx=idx):
                plgpu.copy_smem_to_gmem(o_half, o_ref.at[idx, self.t, heads, cols])
                if lse is not None:
                    plgpu.copy_smem_to_gmem(self.rows.at[3], l_ref.at[idx, self.t, heads])

        plgpu.wait_smem_to_gmem(0)

    def pages(self, i):
        """Where block i lies: (page, offset) in the cache and, int8, in the scales' table. Global loads: the v3
        loader reads them before it waits for the slot, so their latency overlaps the wait instead of following it
        (ncu's dominant stall in this kernel was long_scoreboard, docs/kernels.md)."""
        return self.page(i, self.ins["pt"]), self.page(i, self.ins["pts"]) if self.spec.quant else None

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

    def latent_scale(self, slot):
        """int8: the block's latent scales as rows over S's key columns [64, 64]: (for P, times P_SCALE
        with f16; for S, zero scales as 1)."""
        import jax.experimental.pallas.mosaic_gpu as plgpu

        col = plgpu.Layout.WGMMA.reduce(0)
        sc = plgpu.load(self.scales.at[slot, 0], layout=col)
        sc_v = sc * P_SCALE if self.spec.f16 else sc
        return lax.broadcast_in_dim(sc_v, (BLOCK, BLOCK_KV), [1]), lax.broadcast_in_dim(
            _nonzero(sc), (BLOCK, BLOCK_KV), [1]
        )

    def prefetch(self, i):
        """int8: warms L2 with block i (its TMA cannot start before its slot is free)."""
        import jax.experimental.pallas as pl
        import jax.experimental.pallas.mosaic_gpu as plgpu

        if self.spec.quant:
            page, off = self.page(i, self.ins["pt"])
            for p in range(3):  # one per part: a TMA box is at most 256 wide
                col, w = self.spec.part(p)
                src = self.ins["kv"].at[page, pl.ds(off, BLOCK_KV), pl.ds(col, w)]
                plgpu.async_prefetch(src, predicate=i < self.n_steps)


def _nonzero(scale):
    """Zero scales (all-zero latent rows) as 1: the latent is then 0 whatever scale multiplies it."""
    return jnp.where(scale > 0, scale, 1.0)


def _finish(m, den):
    """(1 / l, natural-log lse) from the running max (log2 domain) and the row sums; rows with nothing visible get
    zeros and -inf."""
    inv_l = jnp.where(den > 0, 1.0 / jnp.maximum(den, 1e-30), 0.0)
    lse = jnp.where(den > 0, (m + jnp.log2(jnp.maximum(den, 1e-30))) * _LN2, -jnp.inf)
    return inv_l, lse


def _init(half):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    row = plgpu.Layout.WGMMA.reduce(1)
    m0 = plgpu.layout_cast(jnp.full((BLOCK,), -1e30, jnp.float32), row)
    l0 = plgpu.layout_cast(jnp.zeros((BLOCK,), jnp.float32), row)
    acc0 = plgpu.layout_cast(jnp.zeros((BLOCK, half), jnp.float32), plgpu.Layout.WGMMA)
    return acc0, m0, l0


def _v3(ctx: _Ctx, wg, active):
    """WG0 computes every block's scores and softmax; WG1 follows with the other output half (and, int8,
    converts the latent's second half: the next block's, or with qk8 this block's after its Q.K)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    spec, bars = ctx.spec, ctx.bars
    half = spec.c // 2
    row = plgpu.Layout.WGMMA.reduce(1)
    regs = spec.register_split()
    b = lambda x, s: lax.broadcast_in_dim(x, s, [0])  # noqa: E731
    # int8 without qk8: WG1 converts each next block's second latent half (a K part of that block's Q.K) while the
    # leader computes P, the loader the first half and the rope (docs/kernels.md; 451 -> 400 us at
    # 128 x 4096).
    split = spec.quant and not spec.qk8
    log2_scale = spec.sm_scale * _LOG2E

    @pl.when(jnp.logical_and(wg == 0, active))
    def _leader():
        plgpu.set_max_registers(regs[0], action="increase")
        ctx.load_q(issue=True)

        def step(i, carry):
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
                    sc_v, sc_k = ctx.latent_scale(slot)
                    if not spec.qk8:  # (the rope part holds its values relative to the latent scale)
                        s = s * sc_k
                s = ctx.masked(s, i, scaled=spec.quant and not spec.qk8)
                if spec.quant:
                    m_new = jnp.maximum(m, s.max(axis=1))
                    p = jnp.exp2(s - b(m_new, s.shape))
                else:
                    m_new = jnp.maximum(m, s.max(axis=1) * log2_scale)
                    p = jnp.exp2(s * log2_scale - b(m_new, s.shape))
                alpha = jnp.exp2(m - m_new)
                den = den * alpha + p.sum(axis=1)
                # P goes into the slot's rope part, dead after Q.K; WG1 reads it and the rescale from here. int8: P
                # times the latent scales, so that P.V over the exact int8 latent is P.V over the dequantised one.
                p_smem = ctx.parts[R].at[slot]
                p_smem[...] = (p * sc_v if spec.quant else p).astype(p_smem.dtype)
                ctx.rows.at[slot][...] = alpha
                plgpu.commit_smem()
                plgpu.barrier_arrive(bars["sig"].at[slot])
            if spec.qk8:  # V's first half, converted after this block's Q.K
                with scope("wait_v"):
                    plgpu.barrier_wait(bars["full"].at[slot * 3 + A])
            with scope("pv"):
                acc = _pv(acc * b(alpha, acc.shape), p_smem, ctx.parts[A].at[slot], spec.interpret)
            plgpu.barrier_arrive(bars["consumed"].at[slot])
            return acc, m_new, den

        acc, m, den = lax.fori_loop(0, ctx.n_steps, step, _init(half))
        inv_l, lse = _finish(m, den)
        if spec.f16:  # P went out times P_SCALE
            inv_l = inv_l * (1.0 / P_SCALE)
        ctx.rows.at[2][...] = inv_l
        plgpu.commit_smem()
        plgpu.barrier_arrive(bars["sig"].at[2])
        ctx.store(acc, inv_l, 0, lse)

    @pl.when(jnp.logical_and(wg == 1, active))
    def _second():
        plgpu.set_max_registers(regs[1], action="increase")
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
                alpha = plgpu.load(ctx.rows.at[slot], layout=row)
                acc = _pv(acc * b(alpha, acc.shape), ctx.parts[R].at[slot], ctx.parts[B].at[slot], spec.interpret)
            plgpu.barrier_arrive(bars["consumed"].at[slot])
            return acc

        acc = lax.fori_loop(0, ctx.n_steps, step, _init(half)[0])
        plgpu.barrier_wait(bars["sig"].at[2])
        ctx.store(acc, plgpu.load(ctx.rows.at[2], layout=row), 1)

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
        plgpu.set_max_registers(regs[2], action="decrease")
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


def _kernel(spec: KernelSpec, *refs):
    names = ["q_nope", "q_pe"] + (["qs"] if spec.qk8 else []) + ["kv"] + (["sc", "pts"] if spec.quant else [])
    names += ["pt", "vis", "work"]
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
    t = lax.div(qt, n_ht)
    vis = ins["vis"][b, t]
    start = blk0 * BLOCK_KV
    n_steps = jnp.minimum(lax.div(jnp.maximum(vis - start, 0) + (BLOCK_KV - 1), BLOCK_KV), n_blk)
    ctx = _Ctx(
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
        n_steps=n_steps,
        dest=dest,
    )
    _v3(ctx, wg, dest != PADDING)


def smem_types(spec: KernelSpec):
    """(scratch buffers, barriers) of the attention kernel."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    bf16, cdt = jnp.bfloat16, spec.compute_dtype()
    t128 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    t64 = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(64))
    if spec.qk8:  # int8 Q (64-byte rows per 64 columns, as the int8 blocks it meets in the wgmma)
        q_parts = (tuple(plgpu.SMEM((BLOCK, w), jnp.int8, transforms=t64) for w in (spec.c, spec.r)),)
    else:  # with f16: the bf16 Q as it lands, and the same bytes as fp16 once the leader has converted them
        q_parts = tuple(
            tuple(plgpu.SMEM((BLOCK, w), dt, transforms=t128) for w in (spec.c, spec.r))
            for dt in ((bf16, cdt) if spec.f16 else (bf16,))
        )
    q = plgpu.RefUnion(  # Q, then (after the last Q.K) the two output halves
        *q_parts,
        plgpu.SMEM((2, BLOCK, spec.c // 2), bf16, transforms=t128),
    )
    parts = []
    for p in (A, B, R):
        w = spec.part(p)[1]
        part = plgpu.SMEM((2, BLOCK_KV, w), cdt, transforms=t128)
        if spec.quant:
            # The int8 twin [slot, 0] starts where 16-bit slot `slot` starts ([slot, 1] is padding).
            part = plgpu.RefUnion(part, plgpu.SMEM((2, 2, BLOCK_KV, w), jnp.int8, transforms=t64))
        parts.append(part)
    smem = (
        q,
        tuple(parts),
        plgpu.SMEM((4, BLOCK), jnp.float32),  # row vectors: alpha per slot, 1/l, lse staging
        plgpu.SMEM((2, 2, BLOCK_KV), jnp.float32) if spec.quant else None,
        plgpu.SMEM((3, BLOCK), jnp.float32) if spec.qk8 else None,  # Q's scales per head and part (A, B, rope)
    )
    consumed = plgpu.Barrier(num_arrivals=2, num_barriers=2)  # both warpgroups release the whole slot
    if spec.pair:  # a slot is refilled (in both CTAs, by multicast) once both CTAs' readers have released it
        consumed = plgpu.ClusterBarrier(
            collective_axes=("pair",), num_barriers=consumed.num_barriers, num_arrivals=consumed.num_arrivals
        )
    bars = [
        plgpu.Barrier(num_arrivals=3 if spec.qk8 else 2, num_barriers=1),  # Q: latent and rope copies (qk8: scales)
        plgpu.Barrier(num_barriers=6),  # part loaded, [slot * 3 + part]
        consumed,
        plgpu.Barrier(num_barriers=3),  # P ready per slot, 1/l
    ]
    if spec.quant:
        bars += [plgpu.Barrier(num_barriers=6), plgpu.Barrier(num_barriers=2)]  # int8 part TMAs, scales per slot
    if spec.qk8:
        bars.append(plgpu.Barrier(num_barriers=2))  # a slot's Q.K done: its latent may be converted
    return smem, tuple(bars)


def profile_params(value: str) -> dict:
    """CompilerParams for Mosaic GPU's in-kernel profiler from value = DIR[:RANGES] (KernelSpec.profile; "" for
    none): each run then writes a Perfetto trace of every warpgroup's named regions into DIR, RANGES (default 100,
    which fits beside every v3 kernel's buffers at H=128) regions per warpgroup and CTA, kept in shared memory
    (4 x 4 bytes each; later ones are dropped)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if not value:
        return {}
    path, _, ranges = value.partition(":")
    if ranges and not ranges.isdigit():
        raise ValueError(f"the kernel profile must be DIR or DIR:RANGES, got {value!r}")
    return dict(
        profile_dir=path,
        profile_space=int(ranges or 100),
        profile_bounds_check=True,
        profile_trace_scope=plgpu.TraceScope.WARPGROUP,
    )


def attention(spec: KernelSpec, q_nope, q_pe, kv, sc, pts, pt, vis, work, qs=None):
    """Runs the attention kernel. -> (out [batch, T, H, C] bf16, lse [batch, T, H] f32) if spec.batch, then
    (partial [slots, T, H, C], lse [slots, T, H]) if spec.slots."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    out_type = []
    for rows in (spec.batch, spec.slots):
        if rows:
            out_type += [
                jax.ShapeDtypeStruct((rows, spec.t, spec.heads, spec.c), jnp.bfloat16),
                jax.ShapeDtypeStruct((rows, spec.t, spec.heads), jnp.float32),
            ]
    kern = plgpu.kernel(
        functools.partial(_kernel, spec),
        out_type=tuple(out_type),
        scratch_types=smem_types(spec),
        grid=(spec.t * (spec.heads // BLOCK) // (2 if spec.pair else 1), spec.units),
        grid_names=("qt", "unit"),
        **(dict(cluster=(2,), cluster_names=("pair",)) if spec.pair else {}),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True, **profile_params(spec.profile)),
        kernel_name=f"mla_decode_{'int8' if spec.quant else 'bf16'}",  # profiles and ncu: "mla_decode_bf16_mosaic..."
    )
    args = (q_nope, q_pe) + ((qs,) if spec.qk8 else ()) + (kv,) + ((sc, pts) if spec.quant else ()) + (pt, vis, work)
    if spec.interpret:
        # Enough simulated TMA engines for every copy the kernel keeps in flight.
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(num_tma_threads_per_device=16)):
            return kern(*args)
    return kern(*args)
