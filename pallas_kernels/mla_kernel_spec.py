"""The MLA decode kernel's static side (mla_kernel.py runs it): KernelSpec, the warpgroups' register split, the
shared memory and barriers a CTA holds (smem_types), and the in-kernel profiler's compiler params."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from pallas_kernels.mla_schedule import BLOCK, BLOCK_KV

LOG2E = math.log2(math.e)
# The v3 loops' named regions ("qk", "softmax", "pv", "convert", the barrier waits): no code unless the kernel is built
# with Mosaic GPU's profiler (KernelSpec.profile, `profile_params`), which then records each region's start and
# end clock per warpgroup (python -m pallas_kernels.bench.timeline).
scope = jax.named_scope
A, B, R = 0, 1, 2  # slot parts
PART_NAMES = "ABR"  # their names in the profiler's regions (bench.timeline)
# Registers per thread of (WG0, WG1, loader): the three must sum to at most 504 (504 x 128 is what the CTA holds at
# launch; asking for 512 left setmaxnreg waiting forever on the H200). An int8 converter holds a part in registers.
# v3's splits are ptxas's (the SASS of the H=128 kernel, docs/kernels.md): at (232, 232, 40) the
# leader spilled 14 values a block in its loop (bf16; 22 with int8), at (256, 208, 40) nothing spills in either
# compute loop; int8 at (248, 176, 80) leaves 8 in the leader, 4 in the loader (was 22 and 6). qk8 (the third key:
# int8 Q.K): at (248, 176, 80) ptxas waited after each of the leader's 26 wgmmas (serialised them) and spilled 264
# bytes; at (256, 176, 72) it waits 5 times and spills 100 (WG1, which converts V's second half, reloads 3 values a
# block). Timed on the H200 at 128 x 4096 (docs/kernels.md): 445 -> 375 us with the loader converting both halves, 350
# with WG1 converting one; (256, 184, 64) spills less and ran 369. The int8 split was chosen before WG1 took over
# the second latent half's conversion (WG1 holds an int8 tile beside its half of O, the loader converts less); it
# has not been re-read or re-timed since.
REGISTERS = {  # by (int8 cache, qk8)
    (False, False): (256, 208, 40),
    (True, False): (248, 176, 80),
    (True, True): (256, 176, 72),
}
# With converter warpgroups (KernelSpec.converters) the split is (WG0, WG1, loader, WG3): four warpgroups launch with
# 128 registers a thread. The leader holds both output halves (O^T: 2 x 32 registers at 16 query rows), the
# converters an int8 part and one converted tile, the loader only issues copies.
CONVERTER_REGISTERS = (168, 128, 56, 152)
P_SCALE = 256.0  # f16: P goes out as P x latent scale x P_SCALE (KernelSpec.f16)
ROPE_SHIFT = 16.0  # f16: the rope part holds int8 x s_rope / s_latent / ROPE_SHIFT, Q's rope part x ROPE_SHIFT


def launch_registers(warpgroups: int) -> int:
    """Registers per thread at launch: 64 Ki over the CTA's threads, down to a multiple of 8 (168 for three
    warpgroups, 128 for four)."""
    return 65536 // (128 * warpgroups) // 8 * 8


def check_registers(split, warpgroups: int = 3) -> tuple[int, ...]:
    """A split (WG0, WG1, loader[, WG3]) that setmaxnreg can make: multiples of 8 in [24, 256], the leader growing
    from the launch's count and the loader shrinking (three warpgroups: WG1 grows too), all within the CTA's
    registers."""
    split = tuple(int(n) for n in split)
    launch = launch_registers(warpgroups)
    ok = len(split) == warpgroups and sum(split) <= warpgroups * launch
    ok = ok and all(n % 8 == 0 and 24 <= n <= 256 for n in split)
    grows = split[:2] if warpgroups == 3 else split[:1]
    if not (ok and min(grows) > launch > split[2]):
        names = "WG0, WG1 > 168 > loader" if warpgroups == 3 else "WG0 > 128 > loader"
        raise ValueError(
            f"register split {split}: {warpgroups} multiples of 8 in [24, 256], {names}, sum <= {warpgroups * launch}"
        )
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
    # Heads of q and of the outputs where they are fewer than one 64-row tile (a multiple of 8; 0: `heads`): the CTA
    # loads Q into the first q_heads rows of its tile and stores only those rows, so the wrapper pads nothing and
    # slices nothing (V2-Lite's 16 heads). The other rows hold whatever smem held; a row of S, P and O depends only
    # on its own row of Q, so they never reach the stored rows. The lse outputs keep `heads` rows (a tile's row
    # vector).
    q_heads: int = 0
    # Query tokens per CTA: with q_heads, the T tokens of a row stacked in one tile (token s in rows [s * q_heads,
    # (s + 1) * q_heads), each row masked at its own token's visible keys), so the row's cache is read once for all
    # of them (MTP verification at 16 heads). 1 or T; the lse outputs are then [.., 1, heads] with the rows stacked
    # the same way.
    stack: int = 1
    # With q_heads: the MMAs run transposed, the block's 64 cache tokens as their M and the tile's q_heads x stack
    # query rows as N: S^T = K Q^T, the softmax down S^T's columns, O^T = V^T P^T. A 64-row tile then does the work of
    # its real rows, not of 64 (at 16 heads a quarter of the Q.K and P.V FLOPs and of the softmax's elements). Q and
    # the output staging keep their 64 rows in smem (f16's in-place conversion of Q lays out 64-row tiles), of which
    # the MMAs and the stores read the first q_rows.
    transposed: bool = False
    # int8 transposed tiles: four warpgroups, two of them converters. WG3 converts each block's first latent half and
    # its rope, WG1 the second half, both as soon as the block lands; the leader runs both P.V halves (O^T is small at
    # 16 query rows) and the loader only issues copies. A slot's round trip is then its load, one part's conversion
    # and the leader's MMAs, with no conversion on the loader between its issues nor on a warpgroup that releases
    # slots (three warpgroups: the loader converts the first half and the rope, WG1 the next block's second half
    # before its own P.V).
    converters: bool = False
    # The cache holds every layer's pages ([L * P, page, C+R]): the kernel takes the layer as an operand and reads
    # page pt[b, j] + layer * layer_pages (0: a one-layer cache, no operand), so the page table needs no pass per
    # layer.
    layer_pages: int = 0
    # int8 scales gathered into the table's order, [B * max_pages, 2, page] (`mla_decode.kernel_scales`): row b's
    # block j is at b * max_pages + j. Otherwise the scales are token-minor and lie at the cache's page.
    scale_rows: bool = False
    # q_nope arrives heads first, [H, B, T, C], as the absorbed query's batched product over the heads makes it: the
    # kernel's TMA reads a head tile's rows at their stride, so no transpose runs before it (q_pe stays [B, T, H, R]).
    heads_first: bool = False

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
        if self.q_heads and not (self.heads == BLOCK and 0 < self.q_heads < BLOCK and self.q_heads % 8 == 0):
            raise ValueError(f"q_heads must be a multiple of 8 below {BLOCK} with one head tile, got {self.q_heads}")
        if self.stack != 1 and not (self.stack == self.t and self.q_heads and self.t * self.q_heads <= BLOCK):
            raise ValueError(f"stack must be 1 or T with T x q_heads <= {BLOCK}, got {self.stack}")
        if self.stack != 1 and self.qk8:  # (each token's query scales would land mid-row)
            raise ValueError("qk8 queries are not stacked")
        if self.transposed and not (self.q_heads and not self.qk8 and not self.pair):
            raise ValueError("transposed needs q_heads, and neither qk8 nor pair")
        if self.converters and not (self.transposed and self.quant):
            raise ValueError("converters need an int8 cache and transposed tiles")
        if self.scale_rows and not self.quant:
            raise ValueError("scale_rows needs an int8 cache")
        if self.heads_first and self.qk8:  # (qk8's queries are quantised per head in the [B, T, H, C] layout)
            raise ValueError("heads_first queries are not quantised (qk8)")
        if self.layer_pages < 0:
            raise ValueError(f"layer_pages must be >= 0, got {self.layer_pages}")

    @property
    def io_heads(self) -> int:
        """Heads of q and of the outputs' rows."""
        return self.q_heads or self.heads

    @property
    def tile_rows(self) -> int:
        """Rows of a head tile that are loaded and stored."""
        return self.q_heads or BLOCK

    def token_rows(self, ref, k: int = 0):
        """Stacked token k's rows of a head tile's smem ref [64, ...]: the whole ref, or with q_heads its rows
        [k * q_heads, (k + 1) * q_heads)."""
        import jax.experimental.pallas as pl

        return ref.at[pl.ds(k * self.q_heads, self.q_heads)] if self.q_heads else ref

    @property
    def q_rows(self) -> int:
        """Query rows the MMAs compute: the tile's real rows when transposed, else all 64."""
        return self.q_heads * self.stack if self.transposed else BLOCK

    @property
    def key_axis(self) -> int:
        """The axis of S over the block's keys, which the softmax reduces: 1 of S [rows, keys], 0 of S^T when
        transposed."""
        return 0 if self.transposed else 1

    @property
    def lse_tokens(self) -> int:
        """Query tokens along the lse outputs' second axis (1 when stacked)."""
        return self.t // self.stack

    @property
    def warpgroups(self) -> int:
        return 4 if self.converters else 3

    def register_split(self) -> tuple[int, ...]:
        if self.registers:
            return self.registers
        return CONVERTER_REGISTERS if self.converters else REGISTERS[(self.quant, self.qk8)]

    def compute_dtype(self):
        """The dtype of the converted cache parts (and of Q without qk8, and of P)."""
        return jnp.float16 if self.f16 else jnp.bfloat16

    def collective(self):
        return "pair" if self.pair else None

    def part(self, p: int) -> tuple[int, int]:
        """(first column, width) of slot part p."""
        return ((0, self.c // 2), (self.c // 2, self.c // 2), (self.c, self.r))[p]


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
            twin = plgpu.SMEM((2, 2, BLOCK_KV, w), jnp.int8, transforms=t64)
            part = plgpu.RefUnion(part, twin)
        parts.append(part)
    smem = (
        q,
        tuple(parts),
        plgpu.SMEM((4, BLOCK), jnp.float32),  # row vectors: alpha per slot, 1/l, lse staging
        plgpu.SMEM((2, 2, BLOCK_KV), jnp.float32) if spec.quant else None,
        plgpu.SMEM((3, BLOCK), jnp.float32) if spec.qk8 else None,  # Q's scales per head and part (A, B, rope)
    )
    # the warpgroups that read a slot release it: both P.V halves' (with converters the leader runs both)
    consumed = plgpu.Barrier(num_arrivals=1 if spec.converters else 2, num_barriers=2)
    if spec.pair:  # a slot is refilled (in both CTAs, by multicast) once both CTAs' readers have released it
        consumed = plgpu.ClusterBarrier(
            collective_axes=("pair",), num_barriers=consumed.num_barriers, num_arrivals=consumed.num_arrivals
        )
    bars = [
        # Q: the latent and rope copies of each stacked token (qk8: and the scales)
        plgpu.Barrier(num_arrivals=3 if spec.qk8 else 2 * spec.stack, num_barriers=1),
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
