"""Int4 MoE grouped GEMM (w4a16, w4a8): a Mosaic GPU (Hopper) kernel, its wrapper, and the pure-jnp reference.

The function is `jax.lax.ragged_dot(x, W, group_sizes)` with W the int4 experts of a `hcfjax.quant.QWeight`:
x [M, K] rows sorted by expert, q [E, N, K/2] packed int4, scale [E, K/G, N] f32 (G = 128), group_sizes [E].
hcfjax/quant.py documents the layout; within each K group of G, byte j holds k = j (low nibble) and k = j + G/2
(high nibble), so one group's packed bytes unpack into two contiguous K halves without any shuffle.

Kernel layout (the product is computed transposed, out^T = W^T x^T, so the weight tile is wgmma's A operand and the
token tile, read K-major, its B operand, as int8 wgmma requires):
  grid (N/64, token blocks). x is not copied or padded: `block_table` (tiny XLA ops on group_sizes) gives each token
  block its expert and a BM-row tile of x at a row offset (a multiple of 8); the block owns the rows of its tile that
  are its expert's (a tile may reach into the neighbouring groups, whose rows it computes and drops; past M the TMA
  loads zeros). Rows past sum(group_sizes) form one more group whose blocks store zeros; unused blocks exit at once.
  A pipeline of `stages` steps over the K groups TMA-loads per group the packed tile [64, G/2], its scales [64]
  (contiguous: the scales are stored K-group-major) and the token tile [BM, G];
  the packed tile is widened to int16 in registers (Mosaic GPU has no 8-bit shifts) and split by two arithmetic
  shifts into the two K halves, then
    w4a16: scaled in f32, rounded to bf16 (as the reference dequantises), stored to one of two smem slots, and two
           bf16 wgmmas accumulate into an f32 accumulator ref that lives across the pipeline. They are left in flight
           (wgmma_wait(2) keeps the last step's), so the next group's unpacking overlaps them; the token tiles are
           released one step late (delay_release=1) for the same reason.
    w4a8:  stored to smem as int8, two int8 wgmmas into a fresh int32 accumulator (tokens pre-quantised per token),
           added to the f32 register accumulator times the group scales; the token scales ([BM] f32, copied once into
           a buffer of their own) multiply the accumulator at the end.
  int4_gated_ragged_dot runs the same loop over two weights (gate, up) with two accumulators and one token tile, and
  writes silu(gate) * up (f32, rounded once): the expert MLP's first half in one kernel.
  The f32 tile out^T [64, BM] is stored transposed into an untiled bf16 smem tile [BM, 64] (rows of 128 B), and only
  the block's rows go to out [M, N] in x's row order, by TMA stores of power-of-two row counts (as jax's
  ragged_dot_mgpu.py does: a TMA box has a static size). No XLA pass after the kernel; before it only the block table
  and, for w4a8, the per-token int8 quantisation of x (one fused pass; in the kernel it would be redone by every one
  of the N/64 CTAs that share a token tile, and each needs the token's max over all of K before its first step).
Shared memory per CTA is `smem_bytes` (about 68 KiB at BM=16 up to 194 KiB at BM=128 for w4a16, 4 stages; NOTES.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from hcfjax.cache import quantize_int8
from hcfjax.quant import QWeight, ragged_dot_reference

BN = 64  # weight rows (output features) per CTA: the wgmma M dimension
ACTS = ("bf16", "int8")


def int4_ragged_dot_reference(x, q, scale, group_sizes, act="bf16"):
    """The kernel's function in plain jnp (hcfjax.quant's reference): x [M, K] -> [M, N] in x's dtype."""
    return ragged_dot_reference(x, QWeight(q, scale, 4, act), group_sizes)


def supports(x, q, scale) -> bool:
    """Whether the kernel takes these operands (else callers use the reference): bf16 x, N a multiple of 64, the
    int4 group a multiple of 64."""
    k = x.shape[-1]
    return x.dtype == jnp.bfloat16 and q.shape[-2] % BN == 0 and (k // scale.shape[-2]) % 64 == 0


def default_block_m(m: int, e: int) -> int:
    """Token block: about one block per expert (each block re-streams its expert's weights, so in the decode regime
    a second, nearly empty block would double the bytes), with headroom for uneven routing, at most 128."""
    per_expert = 1.25 * m / max(e, 1)
    return next((b for b in (16, 32, 64) if per_expert <= b), 128)


def _swizzle(row_bytes: int) -> int:
    for s in (128, 64, 32):
        if row_bytes % s == 0:
            return s
    raise ValueError(f"tile rows of {row_bytes} bytes cannot be swizzled")


def _transforms(cols: int, itemsize: int):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    sw = _swizzle(cols * itemsize)
    return (plgpu.TilingTransform((8, sw // itemsize)), plgpu.SwizzleTransform(sw))


def _unpack(p):
    """int8 [BN, G/2] packed tile (WGMMA layout) -> its two K halves as int16 (k = j, k = j + G/2). Mosaic GPU has no
    shifts on 8-bit registers, so the bytes are widened first (sign-extending: the high nibble is then one arithmetic
    shift away)."""
    p16 = p.astype(jnp.int16)
    lo = lax.shift_right_arithmetic(lax.shift_left(p16, jnp.int16(12)), jnp.int16(12))
    return lo, lax.shift_right_arithmetic(p16, jnp.int16(4))


def _kernel(act, g, bm, k_groups, stages, nw, n_experts, table_ref, *refs):
    """nw = 1: out^T = W^T x^T; nw = 2 (gate, up): out^T = silu(Wg^T x^T) * (Wu^T x^T), both from one token tile.
    table_ref [4, blocks] int32 (`block_table`): this block's expert, tile row, first valid row in the tile, rows."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    w_refs, s_refs = refs[0 : 2 * nw : 2], refs[1 : 2 * nw : 2]
    x_ref, *rest = refs[2 * nw :]
    if act == "int8":
        xs_ref, o_ref, wd_smem, o_smem, xs_smem, xs_bar = rest
    else:
        o_ref, wd_smem, o_smem = rest
    ni, mi = lax.axis_index("n"), lax.axis_index("m")
    e, tile, off, count = (table_ref[i, mi] for i in range(4))
    tile = pl.multiple_of(tile, ROW_ALIGN)
    half = g // 2
    row, col = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)

    def x_halves(x_smem):
        # B operands [G/2, BM]: the token tile read K-major (as int8 wgmma requires).
        return [x_smem.at[:, pl.ds(j * half, half)].transpose((1, 0)) for j in range(2)]

    def split(smems):  # the pipeline's step refs: (w, s) per weight, the token tile
        return smems[0 : 2 * nw : 2], smems[1 : 2 * nw : 2], smems[2 * nw]

    def bf16_step(acc_refs, idx, *smems):
        # Dequantised halves go to wd_smem slot k % 2: the wgmmas of step k - 1 may still read the other slot; those
        # of step k - 2 (same slot) are done (the wait below leaves only this step's 2 nw groups in flight).
        w_smems, s_smems, x_smem = split(smems)
        slot = lax.rem(idx[0], 2)
        for i in range(nw):
            lo, hi = _unpack(plgpu.load(w_smems[i], layout=plgpu.Layout.WGMMA))
            s = lax.broadcast_in_dim(plgpu.load(s_smems[i].at[0], layout=row), (BN, half), [0])  # f32 [BN, G/2]
            for j, v in enumerate((lo, hi)):
                wd_smem[slot, i, j] = (v.astype(jnp.float32) * s).astype(jnp.bfloat16)
        plgpu.commit_smem()
        for i in range(nw):
            for j, xh in enumerate(x_halves(x_smem)):
                plgpu.wgmma(acc_refs[i], wd_smem.at[slot, i, j], xh)
        plgpu.wgmma_wait(2 * nw)

    def int8_step(idx, *smems_and_carry):
        *smems, accs = smems_and_carry
        w_smems, s_smems, x_smem = split(smems)
        for i in range(nw):
            lo, hi = _unpack(plgpu.load(w_smems[i], layout=plgpu.Layout.WGMMA))
            wd_smem[0, i, 0] = lo.astype(jnp.int8)
            wd_smem[0, i, 1] = hi.astype(jnp.int8)
        plgpu.commit_smem()

        def group(*rs):  # int8 x int8 -> int32 over this K group; the group scales apply to the int32 sums
            for i in range(nw):
                for j, xh in enumerate(x_halves(x_smem)):
                    plgpu.wgmma(rs[i], wd_smem.at[0, i, j], xh)
            return tuple(r[...] for r in rs)

        parts = pl.run_scoped(group, *[plgpu.ACC((BN, bm), jnp.int32)] * nw)
        new = []
        for i in range(nw):
            s = lax.broadcast_in_dim(plgpu.load(s_smems[i].at[0], layout=row), (BN, bm), [0])
            new.append(accs[i] + parts[i].astype(jnp.float32) * s)
        return tuple(new)

    x_item = 2 if act == "bf16" else 1
    rel = 1 if act == "bf16" else 0  # bf16: a slot is refilled only once the step after it has waited on its wgmmas
    w_spec = plgpu.BlockSpec((BN, half), lambda k: (ni, k), transforms=_transforms(half, 1), delay_release=rel)
    s_spec = plgpu.BlockSpec((1, BN), lambda k: (k, ni), delay_release=rel)
    in_specs = [w_spec, s_spec] * nw
    # The token tile: bm rows of the unpadded x from row `tile` on (an element offset, a multiple of 8, not a block
    # index); rows outside this block's group are computed and never stored, rows past M arrive as zeros.
    in_specs.append(
        plgpu.BlockSpec(
            (pl.Element(bm), g), lambda k: (tile, k), transforms=_transforms(half, x_item), delay_release=rel
        )
    )
    operands = [r.at[e] for pair in zip(w_refs, s_refs, strict=True) for r in pair] + [x_ref]

    def store(out):  # out^T [BN, BM] f32 -> the tile's rows of out [M, N], transposed on the way into smem
        o_smem.transpose((1, 0))[...] = out.astype(jnp.bfloat16)

    @pl.when(jnp.logical_and(e >= 0, e < n_experts))
    def _():
        if act == "bf16":

            def scope(*acc_refs):
                step = functools.partial(bf16_step, acc_refs)
                plgpu.emit_pipeline(step, grid=(k_groups,), in_specs=in_specs, max_concurrent_steps=stages)(*operands)
                return tuple(r[...] for r in acc_refs)

            accs = pl.run_scoped(scope, *[plgpu.ACC((BN, bm), jnp.float32)] * nw)
        else:
            # The token scales [BM] f32, the same for every K group: one copy into their own buffer. (Pipelined as
            # a [BM] block they sat at BM x 4 B strides, and a TMA into smem needs 128-byte alignment: at BM = 16
            # every other stage was misaligned, CUDA_ERROR_MISALIGNED_ADDRESS on the H200.)
            plgpu.copy_gmem_to_smem(xs_ref.at[pl.ds(tile, bm)], xs_smem, xs_bar)
            zero = plgpu.layout_cast(jnp.zeros((BN, bm), jnp.float32), plgpu.Layout.WGMMA)
            accs = plgpu.emit_pipeline(
                int8_step, grid=(k_groups,), in_specs=in_specs, max_concurrent_steps=stages, init_carry=(zero,) * nw
            )(*operands)
            plgpu.barrier_wait(xs_bar)
            xs = lax.broadcast_in_dim(plgpu.load(xs_smem, layout=col), (BN, bm), [1])
            accs = tuple(a * xs for a in accs)
        store(accs[0] if nw == 1 else accs[0] * accs[1] / (1.0 + jnp.exp(-accs[0])))  # silu(gate) * up, in f32

    @pl.when(e == n_experts)  # rows past sum(group_sizes): zeros
    def _():
        store(plgpu.layout_cast(jnp.zeros((BN, bm), jnp.float32), plgpu.Layout.WGMMA))

    @pl.when(e >= 0)
    def _():
        # Only rows [off, off + count) of the tile are this block's (the others belong to the neighbouring groups'
        # blocks). A TMA box has a static size, so they go out as a ladder of power-of-two row counts (count's binary
        # digits), each from the smem row after the last (rows are BN x 2 = 128 B: every start stays TMA-aligned).
        start, rows = off, 1 << (bm.bit_length() - 1)
        plgpu.commit_smem()
        while rows:

            @pl.when(count & rows != 0)
            def _(start=start, rows=rows):
                dst = o_ref.at[pl.ds(tile + start, rows), pl.ds(ni * BN, BN)]
                plgpu.copy_smem_to_gmem(o_smem.at[pl.ds(start, rows)], dst)

            start, rows = start + (count & rows), rows // 2
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


ROW_ALIGN = 8  # a token tile starts at a multiple of 8 rows: its smem copy is tiled in 8-row tiles, and the TMA of a
# tiled copy addresses x in whole tiles (Mosaic's layout inference rejects other dynamic row offsets)


def _cumsum(v):
    """Inclusive cumsum of a short vector as a masked sum over [n, n] (XLA fuses it with its neighbours; a cumsum is a
    kernel of its own)."""
    i = jnp.arange(v.shape[0])
    return jnp.sum(jnp.where(i[None, :] <= i[:, None], v[None, :], 0), axis=1, dtype=v.dtype)


def block_table(group_sizes, m: int, bm: int):
    """The token blocks of a call, from group_sizes [E] (a few tiny XLA ops on [E + 1] and [blocks] arrays, no loops):
    int32 [4, blocks] with, per block, its expert (E for rows past sum(group_sizes), which get zeros; -1 for unused
    blocks), the first row of x its TMA tile loads (tile, a multiple of 8; rows past M load as zeros), the first row
    of the tile that is the block's (off), and how many are (count, 1..bm). A group's blocks tile its rows from its
    first row rounded down to a multiple of 8, so a group of g rows has at most ceil((g + 7) / bm) blocks; `blocks`
    bounds their sum statically."""
    e = group_sizes.shape[0]
    blocks = -(-(m + (ROW_ALIGN - 1) * (e + 1)) // bm) + e + 1
    gs = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    sizes = jnp.append(gs, jnp.maximum(m - gs.sum(), 0))  # [E + 1]: the rows past the groups as group E
    cs = _cumsum(sizes)
    first, ends = jnp.minimum(cs - sizes, m), jnp.minimum(cs, m)  # each group's rows (clipped to x's)
    base = first // ROW_ALIGN * ROW_ALIGN
    nb = jnp.where(ends > first, (ends - base + bm - 1) // bm, 0)
    bend = _cumsum(nb)
    b = jnp.arange(blocks, dtype=jnp.int32)
    expert = jnp.sum(bend[None, :] <= b[:, None], axis=1, dtype=jnp.int32)  # [blocks]; E + 1: unused
    ex = jnp.minimum(expert, e)
    tile = base[ex] + (b - (bend - nb)[ex]) * bm
    lo, hi = jnp.maximum(tile, first[ex]), jnp.minimum(tile + bm, ends[ex])
    expert = jnp.where((expert <= e) & (hi > lo), expert, -1)
    return jnp.stack([expert, tile, lo - tile, jnp.maximum(hi - lo, 0)]).astype(jnp.int32)


SMEM_LIMIT = 227 * 1024  # bytes of shared memory a CTA may opt into on Hopper (H100, H200)


def smem_bytes(act: str, bm: int, stages: int, g: int = 128, nw: int = 1) -> int:
    """Shared memory of one CTA: per pipeline stage, per weight (nw: 2 for gate + up), the packed tile [64, G/2] int8
    and its scales [64] f32, and the token tile [BM, G] (bf16 or int8); per weight the unpacked halves (bf16: two
    slots x two halves [64, G/2]; int8: one slot); the output tile [64, BM] bf16; int8: the token scales [BM] f32
    (a buffer of their own, which Mosaic aligns to 1 KiB). An upper bound on what Mosaic allocates (tests/test_quant.py
    checks it). Every pipelined block is a multiple of 128 bytes (a TMA's smem destination must be 128-byte aligned,
    and a pipeline buffer holds its stages' blocks back to back)."""
    x_item = 2 if act == "bf16" else 1
    per_stage = nw * (BN * g // 2 + BN * 4) + bm * g * x_item
    unpacked = nw * (2 if act == "bf16" else 1) * 2 * BN * (g // 2) * x_item
    token_scales = -(-bm * 4 // 1024) * 1024 if act == "int8" else 0
    return stages * per_stage + unpacked + BN * bm * 2 + token_scales + 1024  # + barriers (Mosaic adds < 600 B)


def default_stages(act: str, bm: int, g: int = 128, nw: int = 1) -> int:
    """Pipeline depth: 4 K groups in flight (enough bytes in flight to stream the weights in the decode regime),
    fewer when the smem budget is smaller (emit_pipeline itself caps the depth at the number of K groups)."""
    stages = 4
    while stages > 2 and smem_bytes(act, bm, stages, g, nw) > SMEM_LIMIT:
        stages -= 1
    return stages


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
    if g % 64 or n % BN:
        raise ValueError(f"the kernel needs the int4 group (={g}) a multiple of 64 and N (={n}) of {BN}")
    if group_sizes.shape != (e,):
        raise ValueError(f"group_sizes must be [E={e}], got {group_sizes.shape}")


def _run(x, weights, group_sizes, act, interpret, block_m, stages):
    """The kernel over weights = ((q, scale),) or ((q_gate, s_gate), (q_up, s_up)) -> [M, N] bf16."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    for q, scale in weights:
        _check(x, q, scale, group_sizes, act)
    if len(weights) == 2 and weights[0][0].shape != weights[1][0].shape:
        raise ValueError(f"gate and up differ: {weights[0][0].shape} vs {weights[1][0].shape}")
    nw = len(weights)
    m, k = x.shape
    n = weights[0][0].shape[1]
    g = k // weights[0][1].shape[1]
    bm = block_m or default_block_m(m, group_sizes.shape[0])
    if bm % 16 or not 16 <= bm <= 256:
        raise ValueError(f"block_m must be a multiple of 16 in [16, 256], got {bm}")
    stages = stages or default_stages(act, bm, g, nw)
    if act == "bf16" and stages < 2:
        raise ValueError("w4a16 needs stages >= 2 (a token tile is released one step late)")
    if smem_bytes(act, bm, stages, g, nw) > SMEM_LIMIT:
        raise ValueError(
            f"block_m={bm}, stages={stages}: {smem_bytes(act, bm, stages, g, nw)} B of smem > {SMEM_LIMIT}"
        )
    args = kernel_operands(x, weights, group_sizes, act, bm)
    blocks = args[0].shape[1]
    wd = jnp.bfloat16 if act == "bf16" else jnp.int8
    kern = plgpu.kernel(
        functools.partial(_kernel, act, g, bm, k // g, stages, nw, group_sizes.shape[0]),
        out_type=jax.ShapeDtypeStruct((max(m, bm), n), jnp.bfloat16),
        grid=(n // BN, blocks),
        grid_names=("n", "m"),
        scratch_types=(
            plgpu.SMEM(
                (2 if act == "bf16" else 1, nw, 2, BN, g // 2),
                wd,
                transforms=_transforms(g // 2, jnp.dtype(wd).itemsize),
            ),
            plgpu.SMEM((bm, BN), jnp.bfloat16),  # the output tile, untiled: its row ranges go out by TMA
            *([plgpu.SMEM((bm,), jnp.float32), plgpu.Barrier()] if act == "int8" else []),
        ),
    )
    if interpret:
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(num_tma_threads_per_device=4)):
            out = kern(*args)
    else:
        out = kern(*args)
    return out[:m]  # [M, N] (a slice only when M < BM)


def kernel_operands(x, weights, group_sizes, act: str, bm: int):
    """The wrapper's XLA work before the kernel, all of it: the block table (`block_table`), q bitcast to int8 (free),
    and w4a8's per-token quantisation of x (one fused pass: [M, K] int8 and [M] f32 scales). x goes in unpadded: a
    token tile past its last row is zero-filled by the TMA (only when M < BM is x padded to one block). The weight
    scales are used as stored ([E, K/G, N]). The token scales are padded by BM (a few bytes: their copy into smem is a
    plain [BM] slice, which must stay in bounds)."""
    m = x.shape[0]
    pad = ((0, max(bm - m, 0)), (0, 0))
    args = [block_table(group_sizes, m, bm)]
    for q, scale in weights:
        args += [lax.bitcast_convert_type(q, jnp.int8), scale]
    if act == "int8":
        xq, xs = quantize_int8(x)  # [M, K] int8, [M] f32
        args += [jnp.pad(xq, pad), jnp.pad(xs, (0, bm + ROW_ALIGN))]
    else:
        args.append(jnp.pad(x, pad))
    return args


@functools.partial(jax.jit, static_argnames=("act", "interpret", "block_m", "stages"))
def int4_ragged_dot(
    x, q, scale, group_sizes, act: str = "bf16", interpret: bool = False, block_m: int | None = None, stages=None
):
    """ragged_dot(x [M, K] bf16, int4 experts (q [E, N, K/2] uint8, scale [E, N, K/G] f32), group_sizes [E]) ->
    [M, N] bf16, on the Mosaic GPU kernel (`interpret`: Mosaic GPU's interpreter, on any backend). `block_m` (token
    rows per CTA, 16..128, a multiple of 16) and `stages` (pipeline depth) default by the regime."""
    return _run(x, ((q, scale),), group_sizes, act, interpret, block_m, stages)


@functools.partial(jax.jit, static_argnames=("act", "interpret", "block_m", "stages"))
def int4_gated_ragged_dot(
    x, gate, up, group_sizes, act: str = "bf16", interpret: bool = False, block_m: int | None = None, stages=None
):
    """silu(ragged_dot(x, Wg)) * ragged_dot(x, Wu) in one kernel (an expert's gate/up projection): gate and up are
    (q, scale) pairs as in int4_ragged_dot; the product is formed in f32 and rounded to bf16 once."""
    return _run(x, (tuple(gate), tuple(up)), group_sizes, act, interpret, block_m, stages)


def int4_gated_reference(x, gate, up, group_sizes, act="bf16"):
    """The gated kernel's function in plain jnp: the two projections as in int4_ragged_dot_reference (bf16 outputs),
    then silu(gate) * up in f32."""
    yg = int4_ragged_dot_reference(x, *gate, group_sizes, act).astype(jnp.float32)
    yu = int4_ragged_dot_reference(x, *up, group_sizes, act).astype(jnp.float32)
    return (jax.nn.silu(yg) * yu).astype(x.dtype)
