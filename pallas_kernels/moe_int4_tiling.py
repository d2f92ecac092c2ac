"""The int4 MoE kernel's tiling (moe_int4.py): how a call is cut into CTAs and pipeline steps (`Tiling`), the choice
by regime (`default_tiling`, docs/kernels.md has the reasoning), the shared memory and registers a tiling takes
(`smem_bytes`, `regs`), the token blocks each CTA finds from the group sizes (`block_info`), and which variants pay
(`quant_out_pays`, `digits_pay`). Plain Python and jnp: nothing here lowers to Mosaic GPU."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import lax

BN = 64  # weight rows of one wgmma (its M dimension); a CTA takes 1, 2 or 4 such tiles
KC = 64  # K per wgmma call: one 64-byte packed column tile, one K half of a 128 group
QGROUP = 128  # channels per scale of the gate/up kernel's quantised output (qout), the down projection's K group
ROW_ALIGN = 8  # a token tile starts at a multiple of 8 rows: its smem copy is tiled in 8-row tiles, and the TMA of a
# tiled copy addresses x in whole tiles (Mosaic's layout inference rejects other dynamic row offsets)
SMEM_LIMIT = 227 * 1024  # bytes of shared memory a CTA may opt into on Hopper (H100, H200)
SMEM_PER_SM = 228 * 1024  # shared by the CTAs of an SM, each also holding 1 KiB for the system
REGS = 192  # registers per thread a default tiling may pin (`regs`; 2 CTAs per SM leave each thread 255)
SMS = 132  # streaming multiprocessors of an H100 / H200 (default_tiling's split-K choice)
UNPACK_FIRST_REGS = 224  # `regs` up to which a w4a8 step unpacks all its tiles first (Tiling.unpack_first)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """How a call is cut into CTAs and pipeline steps (`default_tiling` by regime)."""

    bm: int  # token rows per block: the wgmma N, a multiple of 16 in [16, 256]
    bn: int  # weight rows (output features) per CTA: 64, 128 or 256
    stages: int  # pipeline steps in flight
    gps: int = 1  # K groups per pipeline step (one TMA per operand per step); where gps does not divide the K groups
    # the last step's TMAs run past K and land zeros (weights, scales and tokens alike), which add nothing
    a_regs: bool = True  # unpacked weights go to wgmma from registers; False: through smem, as the first version did
    inline: bool = True  # unpack with int4_unpack's inline_mgpu bit tricks; False: the same values from int16 ops
    # (widening conversions, as the first version; the interpreter's only way)
    splits: int = 1  # K splits (split-K): CTAs per output tile, each over 1/splits of the K groups, writing an f32
    # partial that the wrapper sums (decode: more CTAs, so more loads in flight, where one K loop per tile is too few)
    unpack_first: bool = True  # w4a8: unpack every tile of a step before its first wgmma; False: each tile just before
    # its own wgmmas (default_tiling's choice where a step's A operands would not fit in registers beside the
    # accumulators)
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


def k_steps(t: Tiling, k_groups: int) -> int:
    """Pipeline steps of one K split: ceil(k_groups / gps), the last one partial where gps does not divide them (K =
    1408, V2-Lite's down projection, is 11 groups: five steps of two and one of one, not eleven of one). Split-K
    needs the splits to divide the steps evenly (`check_tiling`)."""
    return -(-k_groups // t.gps) // t.splits


NARROW_WIDTHS = 5  # block widths of a narrow tiling at most: each is a copy of the kernel's pipeline and epilogue


def block_widths(t: Tiling) -> tuple[int, ...]:
    """The token block widths a CTA may run at, ascending (the last is the grid's bm): with t.narrow the multiples of
    16 up to bm, the NARROW_WIDTHS largest of them (blocks of 80 rows: 16 to 80), else bm alone. Each width is a copy
    of the pipeline in the kernel's code: ten of them (w4a8, 160-row blocks) took the H200 run past its time limit
    while compiling."""
    if not t.narrow:
        return (t.bm,)
    return tuple(range(max(16, t.bm - 16 * (NARROW_WIDTHS - 1)), t.bm + 1, 16))


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
    x_scales = [t.gps * xs_block(t.bm) * 4] if xgroups else []
    return weights + [t.bm * t.gps * g * (2 if act == "bf16" else 1)] + x_scales


def _pipe_bytes(act: str, t: Tiling, g: int, nw: int, xgroups: bool = False, stages: int | None = None) -> int:
    """The pipeline's buffers: one per operand, its stages' blocks back to back, each buffer rounded up to the 1 KiB
    Mosaic aligns it to (the scales' buffers are far from a multiple of it)."""
    return sum(_kib((stages or t.stages) * b) for b in _stage_blocks(act, t, g, nw, xgroups))


def smem_bytes(act: str, t: Tiling, g: int = 128, nw: int = 1, xgroups: bool = False, qout: bool = False) -> int:
    """Shared memory of one CTA, an upper bound on what Mosaic allocates (tests/test_quant_tiling.py checks it): the
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


def xs_block(bm: int) -> int:
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
    return 0 if t.a_regs else a_tiles(t, g, nw) * BN * KC * (2 if act == "bf16" else 1)


def a_tiles(t: Tiling, g: int, nw: int) -> int:
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
      Except the fused w4a8 kernel where an average expert's rows fit the largest block: one block of that size on
      one compute warpgroup, the experts with more rows taking a second, narrow one (Tiling.narrow), where two
      blocks sized for the spread streamed every expert's weights twice (H200, V3's gate/up shape, 8 experts x 512
      rows, kernel time: bm = 48 96.4 us; bm = 80 64.7 us, 65.5 on two compute warpgroups; the single-weight kernel
      at bn = 128 has half the CTAs and was slower there).
    - bn: 128 (two wgmma M tiles share each token tile: half the token bytes per MMA) unless the registers would
      then force token blocks below 64 rows; 256 for one weight in decode with fewer than 8 K steps and CTAs enough
      for two waves at 256, where a CTA's fixed costs (finding its block among E + 1 groups, the pipeline's fill,
      the epilogue) weigh against its few loads (V2-Lite's down projection, docs/kernels.md).
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
        if act == "int8" and nw == 2 and nb > 1 and mu + ROW_ALIGN <= cap(bn_):  # the mean fits one block (below)
            bm, auto_wgs = cap(bn_), False
    if gps is None:
        gps = 2 if bm <= 32 and k_groups > 1 else 1
    short = -(-k_groups // gps) < 8 and (n // 256) * min(m, e) >= 2 * sms  # few K steps, CTAs for 2 waves still
    if bn is None and nw == 1 and wgs == 1 and bm <= 32 and n % 256 == 0 and short:
        bn_ = 256  # half the CTAs, each paying its fixed costs once for twice the weight rows
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
            [1]
            + [s for s in range(1, min(8, k_steps(t, k_groups)) + 1) if _pipe_bytes(act, t, g, nw, stages=s) <= budget]
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
    t = dataclasses.replace(t, splits=splits)
    return dataclasses.replace(t, stages=max(2, min(stages(ctas), k_steps(t, k_groups))))


def quant_out_pays(act: str, m: int, n: int, k_groups: int, e: int, g: int = 128) -> bool:
    """Whether the fused gate/up kernel should quantise its output itself (quant_out) for this call: when the tiling
    quant_out needs (bn = QGROUP, whole 128-channel groups per CTA) still takes an average expert's rows in one token
    block. quant_out's bn = 128 leaves the registers room for 32-row blocks only (fused: two weights, two 64-row
    tiles each); with more rows per expert than that, every expert's weights go through several small blocks, and
    quantising the bf16 product after the kernel (one XLA pass) costs less. H200, fused w4a8 with the tokens
    quantised by the caller, quant_out against the bf16 product (docs/kernels.md): 32 experts x 1024 rows
    220.6 against 229.2 us (32 rows per expert: in the kernel), x 4096 483.6 against 472.6, x 16384 1736.9
    against 1600.7 (after it). In decode the default tiling has bn = 128 already."""
    t = default_tiling(act, m, n, k_groups, e, nw=2, g=g, bn=QGROUP, wgs=1)
    return t.bm * max(e, 1) >= m


def check_tiling(t: Tiling, act, n, k_groups, g, nw, interpret, xgroups=False, qout=False):
    if t.bm % 16 or not 16 <= t.bm <= 256:
        raise ValueError(f"bm must be a multiple of 16 in [16, 256], got {t.bm}")
    if t.bn not in (64, 128, 256) or n % t.bn:
        raise ValueError(f"bn must be 64, 128 or 256 and divide N={n}, got {t.bn}")
    if (t.splits > 1 and k_groups % (t.gps * t.splits)) or t.gps > k_groups or t.stages < 1:
        raise ValueError(
            f"gps={t.gps} (at most the {k_groups} K groups) x splits={t.splits} must divide them where splits > 1;"
            f" stages={t.stages} >= 1"
        )
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


def digits_pay(m: int, n: int, g: int, k_groups: int, e: int) -> bool:
    """Whether w4a16 runs faster as int8 digits on the w4a8 kernel (`int4_ragged_dot_digits`) than on its own
    kernel: where the doubled rows still take 16-row token blocks (about 6 rows per expert or fewer, the decode of
    wide expert parallelism), so the w4a8 kernel's cheaper unpacking comes with no more MMA columns. On the H200
    (docs/kernels.md): 32 experts x 128 rows at 2048 x 7168, 85.2 against 115.8 us; at 8 rows per expert (16 x 128)
    the digits need 32-row blocks and were level to 13% slower."""
    return g == QGROUP and default_tiling("int8", 2 * m, n, k_groups, e).bm == 16
