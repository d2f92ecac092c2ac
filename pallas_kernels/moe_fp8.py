"""8-bit GEMMs on Hopper's 8-bit tensor cores, Mosaic GPU kernels with their wrappers and plain-jnp references: the
fp8 block-scaled grouped GEMM (DeepSeek's fp8 weights as shipped), and the dense int8 per-channel linear (the int8
linears of w4a8c8 and w8a8, section at the end).

The function is DeepSeek's fp8_gemm over experts, ragged_dot(x, W, group_sizes), with
    x  quantised by the caller per row and 128 channels: xq [M, K] float8_e4m3fn and xs [K/128, M'] f32 (M' >= M;
       K-block-major, so one pipeline step's scales of a token tile are contiguous)
    W  q [E, N, K] float8_e4m3fn (output-major, as the checkpoint stores it) and s [E, N/128, K/128] f32 (the
       checkpoint's `weight_scale_inv`): W[k, n] = q[n, k] * s[n // 128, k // 128]
    out[m, n] = sum over K blocks b of (xq[m, b] . q[e(m), n, b]) * xs[b, m] * s[e(m), n // 128, b]
rows sorted by expert, rows past sum(group_sizes) zero. A dense linear is the one-expert case (E = 1).

Kernel layout (as moe_int4.py's, whose token-block machinery it shares): the product is computed transposed,
out^T = W^T x^T, so a 64-row weight tile is wgmma's A operand and the token tile, read K-major, its B operand (8-bit
wgmma needs both K-major), and a decode block of a few rows costs a 16-column MMA, not a 64-row one.
  grid (N/bn, token blocks); each CTA finds its expert and token tile from group_sizes (`block_info`) and runs a
  pipeline over the K blocks of 128. A step TMA-loads the weight tile [bn, 128] e4m3 (per weight), the token tile
  [bm, 128] e4m3 and the tile's token scales of that block; per 64-row weight tile one fp8 wgmma (K = 128, both
  operands from shared memory) into a fresh f32 accumulator; the block's partial then joins the running f32 sum times
  its tokens' scales (per column) and its weight scale (one scalar: bn <= 128 rows lie in one 128-row block, read
  from global memory at the step's start so that the load overlaps the MMA). This is DeepSeek's per-block
  promotion: no block's partial is ever scaled in fp8 or summed before its scales apply.
  The gated form runs gate and up against one token tile and writes silu(gate) * up (f32, rounded to bf16 once).
  The f32 tile goes out through a transposed bf16 smem tile and TMA stores of the block's rows (`store_rows`).
  Split-K (Fp8Tiling.splits > 1, calls of few output tiles: a decode step's dense linears): a third grid axis gives
  each CTA a slice of the K blocks, and it stores f32 partials (gate and up side by side, before SiLU) to
  [splits, M, nw N], which the wrapper sums in one XLA fusion.

The dense int8 linear (`int8_matmul`, `int8_gated_matmul`):
    xq [M, K] int8 with per-row scales xs [M] f32 (quantize_int8), W as q [N, K] int8 with per-output-channel
    scales s [N] f32 (hcfjax.quant's int8 QWeight): out[m, n] = (xq[m] . q[n]) * xs[m] * s[n]
  The same transposed product, over token blocks of consecutive rows (no groups). Both scales are constant over
  K, so one int32 accumulator per 64-row tile runs over the whole K loop (|sum| <= K 127^2 < 2^31 up to K =
  133,000): the int8 wgmmas of every step accumulate in place, and the scales (copied into smem while the loop
  runs) apply once after it. Split-K as above, any number of splits: the last split's loads past K land zeros.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.moe_int4 import run_grouped
from pallas_kernels.moe_int4_kernel import silu_mul, smem_transforms, store_rows
from pallas_kernels.moe_int4_tiling import BN, ROW_ALIGN, block_info, num_blocks, xs_block

BLOCK = 128  # DeepSeek's weight blocks (128 x 128) and activation groups (1 x 128): one wgmma's K
FP8 = jnp.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class Fp8Tiling:
    bm: int  # token rows per block: the wgmma N, a multiple of 16 in [16, 256]
    bn: int = BN  # weight rows per CTA: 64 or 128 (inside one 128-row scale block)
    stages: int = 4  # pipeline steps in flight
    splits: int = 1  # K splits (split-K): CTAs per output tile, each over 1/splits of the K blocks, writing f32
    # partials [splits, M, nw N] that the wrapper sums (then forms gate/up's SiLU product)


SMS = 132  # streaming multiprocessors of an H100 / H200
CTAS_PER_SM = 2  # a CTA's pipeline takes about 100 KiB of the SM's 228 KiB of shared memory
MIN_SPLIT_STEPS = 8  # K blocks per split at least: the pipeline's fill and drain amortised


def default_tiling(m: int, e: int, nw: int, n: int = 0, k: int = 0) -> Fp8Tiling:
    """Token blocks about as wide as a group's rows (the mean over the groups that can have rows), in multiples of
    16: a decode block of a few routed rows runs 16 columns. Each running sum and each step's partial are bm / 2
    registers a thread per 64-row tile: bm <= 128 with one weight, <= 64 with gate and up (four tiles).
    Split-K where the output tiles are too few to fill the SMs' CTA slots (a decode step's dense linears: V3's q_a
    is 24 tiles of 64 rows, kv_a 9): as many splits (up to 8, each of at least 8 K blocks) as stay within them,
    since a memory-bound CTA streams its weight rows one K block after another."""
    rows = m / max(min(m, e), 1)
    bm = min(max(-(-int(rows + ROW_ALIGN - 1) // 16) * 16, 16), 128 if nw == 1 else 64)
    tiles = (n // BN) * max(min(m, e), 1) * -(-int(rows + ROW_ALIGN - 1) // bm)
    kb = k // BLOCK
    fits = [s for s in (2, 4, 8) if kb % s == 0 and kb // s >= MIN_SPLIT_STEPS and tiles * s <= SMS * CTAS_PER_SM]
    return Fp8Tiling(bm=bm, splits=max(fits, default=1))


def supports(k: int, n: int) -> bool:
    """Whether the kernel takes a [K -> N] product: whole 128-channel blocks along K, N in 64-row tiles."""
    return k % BLOCK == 0 and n % BN == 0


def _check(xq, xs, weights, group_sizes, t: Fp8Tiling):
    m, k = xq.shape
    if xq.dtype != FP8:
        raise ValueError(f"xq must be float8_e4m3fn, got {xq.dtype}")
    if xs.dtype != jnp.float32 or xs.ndim != 2 or xs.shape[0] != k // BLOCK or xs.shape[1] < m:
        raise ValueError(f"xs must be f32 [K/128={k // BLOCK}, M' >= {m}], got {xs.dtype} {xs.shape}")
    for q, s in weights:
        e, n, k2 = q.shape
        if q.dtype != FP8 or k2 != k:
            raise ValueError(f"q must be float8_e4m3fn [E, N, K={k}], got {q.dtype} {q.shape}")
        if s.shape != (e, -(-n // BLOCK), k // BLOCK) or s.dtype != jnp.float32:
            raise ValueError(f"s must be f32 [E, N/128, K/128] = {(e, -(-n // BLOCK), k // BLOCK)}, got {s.shape}")
        if not supports(k, n):
            raise ValueError(f"the kernel needs K (={k}) a multiple of {BLOCK} and N (={n}) of {BN}")
        if group_sizes.shape != (e,):
            raise ValueError(f"group_sizes must be [E={e}], got {group_sizes.shape}")
    _check_pair_and_blocks(weights, weights[0][0].shape[1], t)
    if t.splits < 1 or (k // BLOCK) % t.splits:
        raise ValueError(f"tiling {t}: the splits must divide the {k // BLOCK} K blocks")


def _check_pair_and_blocks(weights, n: int, t: Fp8Tiling):
    """Both kernels: gate and up of one shape, and the tiling's blocks within the MMAs' limits and dividing N."""
    if weights[0][0].shape != weights[-1][0].shape:
        raise ValueError(f"gate and up differ: {weights[0][0].shape} vs {weights[-1][0].shape}")
    if t.bn not in (64, 128) or n % t.bn or t.bm % 16 or not 16 <= t.bm <= 256:
        raise ValueError(f"tiling {t}: bn 64 or 128 dividing N, bm a multiple of 16 in [16, 256]")


def _body(nw: int, ksteps: int, m: int, n_experts: int, t: Fp8Tiling, gs_ref, *refs):
    """One CTA: its token block against bn weight rows of its expert, over the K blocks (the module's docstring)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    w_refs, s_refs = refs[0 : 2 * nw : 2], refs[1 : 2 * nw : 2]
    x_ref, xs_ref, o_ref = refs[2 * nw :]
    sizes = [gs_ref[i] for i in range(n_experts)]
    ni, mi, k0 = lax.axis_index("n"), lax.axis_index("m"), lax.axis_index("k") * ksteps
    e, tile, off, count = block_info(sizes, mi, m, t.bm)
    tile = pl.multiple_of(tile, ROW_ALIGN)
    tiles, nb = t.bn // BN, ni * t.bn // BLOCK  # 64-row tiles per weight; the CTA's row block of the scales
    col = plgpu.Layout.WGMMA.reduce(0)
    store = functools.partial(_store, o_ref=o_ref, nw=nw, t=t, ni=ni, tile=tile, off=off, count=count)

    def zero():
        return plgpu.layout_cast(jnp.zeros((BN, t.bm), jnp.float32), plgpu.Layout.WGMMA)

    def step(idx, *smems_and_carry):
        *smems, accs = smems_and_carry
        w_smems, x_smem, xs_smem = smems[:nw], smems[nw], smems[nw + 1]
        kb = k0 + idx[0]
        w_scales = [s_refs[i][e, nb, kb] for i in range(nw)]  # issued before the MMAs, used after them
        xt = x_smem.transpose((1, 0))  # [128, bm]: K-major B

        def partials(*rs):  # each tile's partial of this K block, all wgmmas issued before the one wait
            for i in range(nw):
                for h in range(tiles):
                    plgpu.wgmma(rs[i * tiles + h], w_smems[i].at[pl.ds(h * BN, BN)], xt)
            return tuple(r[...] for r in rs)

        parts = pl.run_scoped(partials, *[plgpu.ACC((BN, t.bm), jnp.float32)] * (nw * tiles))
        sx = lax.broadcast_in_dim(plgpu.load(xs_smem.at[0, pl.ds(0, t.bm)], layout=col), (BN, t.bm), [1])
        out = [accs[a] + parts[a] * (sx * w_scales[a // tiles]) for a in range(nw * tiles)]
        plgpu.commit_smem()  # the generic reads of the slot's scales ordered before its refill by TMA
        return tuple(out)

    fp8_tile = smem_transforms(BLOCK, 1)
    in_specs = [plgpu.BlockSpec((t.bn, BLOCK), lambda k: (ni, k0 + k), transforms=fp8_tile)] * nw
    in_specs += [
        plgpu.BlockSpec((pl.Element(t.bm), BLOCK), lambda k: (tile, k0 + k), transforms=fp8_tile),
        plgpu.BlockSpec((1, pl.Element(xs_block(t.bm))), lambda k: (k0 + k, tile)),
    ]

    @pl.when(jnp.logical_and(e >= 0, e < n_experts))
    def _():
        pipeline = plgpu.emit_pipeline(
            step, grid=(ksteps,), in_specs=in_specs, max_concurrent_steps=t.stages, init_carry=(zero(),) * (nw * tiles)
        )
        store(pipeline(*[w.at[e] for w in w_refs], x_ref, xs_ref))

    @pl.when(e == n_experts)  # rows past sum(group_sizes): zeros
    def _():
        store([zero()] * tiles * nw)


def _store(accs, *, o_ref, nw: int, t: Fp8Tiling, ni, tile, off, count):
    """A CTA's f32 tiles (per weight, per 64-row tile) -> rows [off, off + count) of its block (from row tile) of
    the output: bf16 [M, N], gate/up's SiLU product formed first; with split-K this split's f32 partials of each
    weight, [M, nw N] of o_ref [splits, M, nw N]."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    tiles, partial = t.bn // BN, t.splits > 1
    o_gmem, o_dtype = (o_ref.at[lax.axis_index("k")], jnp.float32) if partial else (o_ref, jnp.bfloat16)
    n_out, n_cols = (nw, o_gmem.shape[1] // nw) if partial else (1, o_gmem.shape[1])
    if nw == 2 and not partial:
        accs = silu_mul(accs, tiles)

    def scope(o_smem):  # [n_out, bm, bn]
        for i in range(n_out):
            for h, out in enumerate(accs[i * tiles : (i + 1) * tiles]):
                if partial:  # Mosaic infers a transposed store's layout for 16-bit values only; f32 is cast
                    out = plgpu.layout_cast(out, plgpu.Layout.WGMMA_TRANSPOSED)
                o_smem.at[i, :, pl.ds(h * BN, BN)].transpose((1, 0))[...] = out.astype(o_dtype)
        plgpu.commit_smem()
        cols = [pl.ds(i * n_cols + ni * t.bn, t.bn) for i in range(n_out)]
        store_rows(o_smem, o_gmem, cols, tile, off, count, t.bm)

    pl.run_scoped(scope, plgpu.SMEM((n_out, t.bm, t.bn), o_dtype))


def _kernel(body, name: str, body_args, out_type, grid):
    """The kernel of one launch (`body` and its static arguments, the first of them the weights' count), from
    static arguments only (lowering_cache may build it in another process)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    return plgpu.kernel(
        functools.partial(body, *body_args),
        out_type=out_type,
        grid=grid,
        grid_names=("n", "m", "k"),
        kernel_name=f"{name}{'_gated' if body_args[0] == 2 else ''}",  # in profiles, ncu
    )


def _run(xq, xs, weights, group_sizes, interpret: bool, tiling: Fp8Tiling | None):
    """The kernel over weights = ((q, s),) or ((q_gate, s_gate), (q_up, s_up)) -> [M, N] bf16."""
    (m, k), (e, n, _), nw = xq.shape, weights[0][0].shape, len(weights)
    t = tiling or default_tiling(m, e, nw, n, k)
    _check(xq, xs, weights, group_sizes, t)
    rows = max(t.bm, -(-m // ROW_ALIGN) * ROW_ALIGN)  # whole 8-row tiles, one block at least (the TMA's box)
    cols = -(-(m + xs_block(t.bm) + ROW_ALIGN) // 4) * 4  # a step's scale block stays in bounds; 16-byte rows
    args = [group_sizes.astype(jnp.int32)]
    for q, s in weights:
        args += [q, s]
    args += [jnp.pad(xq, ((0, rows - m), (0, 0))), jnp.pad(xs, ((0, 0), (0, max(cols - xs.shape[1], 0))))]
    out_type = (
        jax.ShapeDtypeStruct((rows, n), jnp.bfloat16)
        if t.splits == 1
        else jax.ShapeDtypeStruct((t.splits, rows, nw * n), jnp.float32)
    )
    body_args = (nw, k // BLOCK // t.splits, m, e, t)
    kern = functools.partial(
        _kernel, _body, "moe_fp8", body_args, out_type, (n // t.bn, num_blocks(m, e, t.bm), t.splits)
    )
    return run_grouped(("moe_fp8", body_args), kern, args, out_type, interpret, t.splits, nw)[:m]


@functools.partial(jax.jit, static_argnames=("interpret", "tiling"))
def fp8_ragged_dot(xq, xs, q, s, group_sizes, interpret: bool = False, tiling: Fp8Tiling | None = None):
    """ragged_dot of fp8 tokens (xq [M, K] e4m3, xs [K/128, M'] f32) over fp8 experts (q [E, N, K] e4m3, s [E, N/128,
    K/128] f32), group_sizes [E] -> [M, N] bf16, on the Mosaic GPU kernel (`interpret`: its interpreter, any
    backend)."""
    return _run(xq, xs, ((q, s),), group_sizes, interpret, tiling)


@functools.partial(jax.jit, static_argnames=("interpret", "tiling"))
def fp8_gated_ragged_dot(xq, xs, gate, up, group_sizes, interpret: bool = False, tiling: Fp8Tiling | None = None):
    """silu(ragged_dot(x, Wg)) * ragged_dot(x, Wu) in one kernel, gate and up (q, s) pairs as in fp8_ragged_dot: an
    expert's gate/up projection, the product formed in f32 and rounded to bf16 once."""
    return _run(xq, xs, (tuple(gate), tuple(up)), group_sizes, interpret, tiling)


def fp8_ragged_dot_reference(xq, xs, q, s, group_sizes):
    """The kernel's function in plain jnp, in f32 (the scales are constant over each block, so dequantising first
    is the same sum): -> [M, N] f32."""
    m, k = xq.shape
    x = xq.astype(jnp.float32) * jnp.repeat(xs[:, :m].T, BLOCK, axis=1)
    n = q.shape[1]
    w = q.astype(jnp.float32) * jnp.repeat(jnp.repeat(s, BLOCK, axis=1), BLOCK, axis=2)[:, :n, :k]
    return lax.ragged_dot(x, jnp.swapaxes(w, 1, 2), group_sizes, precision=lax.Precision.HIGHEST)


# int8 weights per output channel (w4a8c8 / w8a8's dense linears).

INT8_MAX_ROWS = 1024  # dense int8 linears of more rows (prefill chunks) stay on XLA's int8 GEMMs
MIN_INT8_SPLIT_STEPS = 4  # K blocks per split at least, for the dense int8 kernel's split-K


def int8_tiling(m: int, nw: int, n: int, k: int) -> Fp8Tiling:
    """A dense int8 call's tiling: token blocks of the rows rounded up to 16 (at most 128, 64 with gate and up), 64
    weight rows a CTA, and split-K where the output tiles leave SMs idle (a decode step's linears are a few output
    tiles over many K blocks: V2-Lite's kv_a at 64 rows is 9 tiles over 16): as many splits as keep the CTAs, each
    weight tile counted (gate and up count twice), within one an SM, each split 4 K blocks at least. More splits,
    or two CTAs an SM, measured slower: the partials' sum is a pass over [splits, M, N] f32 (docs/kernels.md). A
    split count need not divide the K blocks: the last split's loads past K land zeros, which add nothing."""
    bm = min(max(-(-m // 16) * 16, 16), 128 if nw == 1 else 64)
    tiles, kb = n // BN * -(-m // bm) * nw, k // BLOCK
    splits = 1
    for s in range(2, kb + 1):
        if (split_steps(kb, s) or 0) >= MIN_INT8_SPLIT_STEPS and tiles * s <= SMS:
            splits = s
    return Fp8Tiling(bm=bm, bn=BN, stages=min(4, split_steps(kb, splits)), splits=splits)


def split_steps(kb: int, splits: int) -> int | None:
    """The K blocks each of `splits` splits of kb K blocks runs (the last split's loads past K land zeros), or None
    where some split would have none."""
    if splits < 1:
        return None
    steps = -(-kb // splits)
    return steps if (splits - 1) * steps < kb else None


def _check_int8(xq, xs, weights, t: Fp8Tiling):
    m, k = xq.shape
    if xq.dtype != jnp.int8 or xs.shape != (m,) or xs.dtype != jnp.float32:
        raise ValueError(
            f"tokens must be int8 [M, K] with f32 [M] scales, got {xq.dtype} {xq.shape}, {xs.dtype} {xs.shape}"
        )
    for q, s in weights:
        if q.dtype != jnp.int8 or q.ndim != 2 or q.shape[1] != k:
            raise ValueError(f"q must be int8 [N, K={k}], got {q.dtype} {q.shape}")
        if s.size != q.shape[0] or s.dtype != jnp.float32:
            raise ValueError(f"s must be f32 per output channel ({q.shape[0]} values), got {s.dtype} {s.shape}")
        if not supports(k, q.shape[0]):
            raise ValueError(f"the kernel needs K (={k}) a multiple of {BLOCK} and N (={q.shape[0]}) of {BN}")
    _check_pair_and_blocks(weights, weights[0][0].shape[0], t)
    if split_steps(k // BLOCK, t.splits) is None:
        raise ValueError(f"tiling {t}: each of the splits needs one of the {k // BLOCK} K blocks at least")


def _int8_body(nw: int, ksteps: int, m: int, t: Fp8Tiling, *refs):
    """One CTA of the dense int8 kernel: token block mi (rows [mi bm, mi bm + bm)) against bn weight rows, over its
    split's K blocks, the wgmmas accumulating in int32 in place; the per-row and per-channel scales apply once after
    the loop (copied into smem while it runs)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    w_refs, s_refs = refs[0 : 2 * nw : 2], refs[1 : 2 * nw : 2]
    x_ref, xs_ref, o_ref = refs[2 * nw :]
    ni, mi, k0 = lax.axis_index("n"), lax.axis_index("m"), lax.axis_index("k") * ksteps
    tile = pl.multiple_of(mi * t.bm, 16)
    tiles = t.bn // BN
    row, col = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)

    def step(acc_refs, idx, *smems):
        xt = smems[nw].transpose((1, 0))  # [128, bm]: K-major B
        for i in range(nw):
            for h in range(tiles):
                plgpu.wgmma(acc_refs[i * tiles + h], smems[i].at[pl.ds(h * BN, BN)], xt)
        plgpu.wgmma_wait(0)  # the step's slots are refilled after the body

    int8_tile = smem_transforms(BLOCK, 1)
    in_specs = [plgpu.BlockSpec((t.bn, BLOCK), lambda k: (ni, k0 + k), transforms=int8_tile)] * nw
    in_specs.append(plgpu.BlockSpec((t.bm, BLOCK), lambda k: (mi, k0 + k), transforms=int8_tile))

    def scope(ws_smem, xs_smem, bars):
        for i in range(nw):  # the scales land while the loop runs
            plgpu.copy_gmem_to_smem(s_refs[i].at[pl.ds(ni * t.bn, t.bn)], ws_smem.at[i], bars.at[i])
        plgpu.copy_gmem_to_smem(xs_ref.at[pl.ds(tile, t.bm)], xs_smem, bars.at[nw])

        def loop(*acc_refs):
            plgpu.emit_pipeline(
                functools.partial(step, acc_refs), grid=(ksteps,), in_specs=in_specs, max_concurrent_steps=t.stages
            )(*w_refs, x_ref)
            return tuple(r[...] for r in acc_refs)

        sums = pl.run_scoped(loop, *[plgpu.ACC((BN, t.bm), jnp.int32)] * (nw * tiles))
        for i in range(nw + 1):
            plgpu.barrier_wait(bars.at[i])
        xs = lax.broadcast_in_dim(plgpu.load(xs_smem, layout=col), (BN, t.bm), [1])
        accs = []
        for a, v in enumerate(sums):
            ws = plgpu.load(ws_smem.at[a // tiles, pl.ds((a % tiles) * BN, BN)], layout=row)
            accs.append(v.astype(jnp.float32) * lax.broadcast_in_dim(ws, (BN, t.bm), [0]) * xs)
        _store(accs, o_ref=o_ref, nw=nw, t=t, ni=ni, tile=tile, off=0, count=jnp.minimum(t.bm, m - tile))

    pl.run_scoped(
        scope,
        plgpu.SMEM((nw, t.bn), jnp.float32),
        plgpu.SMEM((t.bm,), jnp.float32),
        plgpu.Barrier(num_barriers=nw + 1),
    )


def _run_int8(xq, xs, weights, interpret: bool, tiling: Fp8Tiling | None, partials: bool = False):
    """The dense int8 kernel over weights = ((q, s),) or ((q_gate, s_gate), (q_up, s_up)) -> [M, N] bf16, or with
    `partials` (one weight) and a tiling that splits K its f32 partials [splits, M', N] over whole token blocks."""
    (m, k), (n, _), nw = xq.shape, weights[0][0].shape, len(weights)
    if partials and nw != 1:
        raise ValueError("the dense int8 kernel gives split-K partials of one weight's product, not gate and up's")
    t = tiling or int8_tiling(m, nw, n, k)
    _check_int8(xq, xs, weights, t)
    rows = -(-m // t.bm) * t.bm  # whole token blocks: each block's rows and scales load in bounds
    args = []
    for q, s in weights:
        args += [q, s.reshape(n)]
    args += [jnp.pad(xq, ((0, rows - m), (0, 0))), jnp.pad(xs, (0, rows - m))]
    out_type = (
        jax.ShapeDtypeStruct((rows, n), jnp.bfloat16)
        if t.splits == 1
        else jax.ShapeDtypeStruct((t.splits, rows, nw * n), jnp.float32)
    )
    body_args = (nw, split_steps(k // BLOCK, t.splits), m, t)
    kern = functools.partial(
        _kernel, _int8_body, "dense_int8", body_args, out_type, (n // t.bn, rows // t.bm, t.splits)
    )
    out = run_grouped(("dense_int8", body_args), kern, args, out_type, interpret, t.splits, nw, not partials)
    return out if partials and t.splits > 1 else out[:m]


@functools.partial(jax.jit, static_argnames=("interpret", "tiling", "partials"))
def int8_matmul(xq, xs, q, s, interpret: bool = False, tiling: Fp8Tiling | None = None, partials: bool = False):
    """A dense int8 linear: xq [M, K] int8 with per-row scales xs [M] f32 (quantize_int8) times W stored as q [N, K]
    int8 with per-output-channel scales s ([N] or [1, N] f32) -> [M, N] bf16, on the Mosaic GPU kernel (`interpret`:
    its interpreter, any backend). partials: where the tiling splits K (`int8_tiling`), the splits' f32 partial
    products [splits, M', N] instead, unsummed, over the kernel's whole token blocks (M' >= M rows, those past M
    padding: cutting them off would be a copy). Their sum in split order, rounded to bf16, is the product (XLA's
    sum of them is a loop fusion, which adds in index order)."""
    return _run_int8(xq, xs, ((q, s),), interpret, tiling, partials)


@functools.partial(jax.jit, static_argnames=("interpret", "tiling"))
def int8_gated_matmul(xq, xs, gate, up, interpret: bool = False, tiling: Fp8Tiling | None = None):
    """silu(x @ Wg) * (x @ Wu) in one kernel, gate and up (q, s) pairs as in int8_matmul (a SwiGLU MLP's first half:
    the product formed in f32 and rounded to bf16 once)."""
    return _run_int8(xq, xs, (tuple(gate), tuple(up)), interpret, tiling)


def int8_matmul_reference(xq, xs, q, s):
    """int8_matmul's function in plain jnp: the exact int32 products, then both scales, in f32 -> [M, N] f32."""
    acc = lax.dot_general(xq, q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
    return acc.astype(jnp.float32) * xs[:, None] * s.reshape(1, -1)
