"""Int4 MoE grouped GEMM (w4a16, w4a8): a Mosaic GPU (Hopper) kernel, its wrapper, and the pure-jnp reference.

The function is `jax.lax.ragged_dot(x, W, group_sizes)` with W the int4 experts of a `hcfjax.quant.QWeight`:
x [M, K] rows sorted by expert, q [E, N, K/2] packed int4, scale [E, N, K/G] f32 (G = 128), group_sizes [E].
hcfjax/quant.py documents the layout; within each K group of G, byte j holds k = j (low nibble) and k = j + G/2
(high nibble), so one group's packed bytes unpack into two contiguous K halves without any shuffle.

Kernel layout (the product is computed transposed, out^T = W^T x^T, so the weight tile is wgmma's A operand and the
token tile, read K-major, its B operand, as int8 wgmma requires):
  grid (N/64, padded token blocks). The wrapper pads each expert's rows to a multiple of the token block BM, so a
  token block belongs to one expert (block_expert, -1 for unused blocks, which exit at once). A pipeline of `stages`
  steps over the K groups TMA-loads per group the packed tile [64, G/2], its scales [64] and the token tile [BM, G];
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
  The bf16 tile out^T [64, BM] goes back by TMA; the wrapper gathers the rows back (transpose + gather in XLA).
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
    return x.dtype == jnp.bfloat16 and q.shape[-2] % BN == 0 and (k // scale.shape[-1]) % 64 == 0


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


def _kernel(act, g, bm, k_groups, stages, nw, block_expert_ref, *refs):
    """nw = 1: out^T = W^T x^T; nw = 2 (gate, up): out^T = silu(Wg^T x^T) * (Wu^T x^T), both from one token tile."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    w_refs, s_refs = refs[0 : 2 * nw : 2], refs[1 : 2 * nw : 2]
    x_ref, *rest = refs[2 * nw :]
    if act == "int8":
        xs_ref, o_ref, wd_smem, o_smem, xs_smem, xs_bar = rest
    else:
        o_ref, wd_smem, o_smem = rest
    ni, mi = lax.axis_index("n"), lax.axis_index("m")
    e = block_expert_ref[mi]
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
    in_specs.append(
        plgpu.BlockSpec((bm, g), lambda k: (mi, k), transforms=_transforms(half, x_item), delay_release=rel)
    )
    operands = [r.at[e] for pair in zip(w_refs, s_refs, strict=True) for r in pair] + [x_ref]

    @pl.when(e >= 0)
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
            plgpu.copy_gmem_to_smem(xs_ref.at[pl.ds(mi * bm, bm)], xs_smem, xs_bar)
            zero = plgpu.layout_cast(jnp.zeros((BN, bm), jnp.float32), plgpu.Layout.WGMMA)
            accs = plgpu.emit_pipeline(
                int8_step, grid=(k_groups,), in_specs=in_specs, max_concurrent_steps=stages, init_carry=(zero,) * nw
            )(*operands)
            plgpu.barrier_wait(xs_bar)
            xs = lax.broadcast_in_dim(plgpu.load(xs_smem, layout=col), (BN, bm), [1])
            accs = tuple(a * xs for a in accs)
        out = accs[0] if nw == 1 else accs[0] * accs[1] / (1.0 + jnp.exp(-accs[0]))  # silu(gate) * up, in f32
        o_smem[...] = out.astype(jnp.bfloat16)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[pl.ds(ni * BN, BN), pl.ds(mi * bm, bm)])
        plgpu.wait_smem_to_gmem(0)


def _pad_rows(group_sizes, m: int, bm: int):
    """Row r of the sorted input -> its row in the expert-padded layout (dst [M], M_pad for rows past the groups),
    and the expert of each padded block (block_expert [blocks], -1 when unused)."""
    e = group_sizes.shape[0]
    blocks = -(-m // bm) + e  # static upper bound on the padded blocks
    padded = (group_sizes + bm - 1) // bm * bm
    pstart = jnp.cumsum(padded) - padded
    start = jnp.cumsum(group_sizes) - group_sizes
    r = jnp.arange(m)
    expert = jnp.searchsorted(jnp.cumsum(group_sizes), r, side="right")
    valid = expert < e
    ex = jnp.minimum(expert, e - 1)
    dst = jnp.where(valid, pstart[ex] + r - start[ex], blocks * bm)
    b0 = jnp.arange(blocks) * bm
    block_expert = jnp.searchsorted(jnp.cumsum(padded), b0, side="right")
    block_expert = jnp.where(block_expert < e, block_expert, -1).astype(jnp.int32)
    return dst, block_expert, blocks


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
    if scale.shape[:2] != (e, n) or k % scale.shape[2]:
        raise ValueError(f"scale must be [E={e}, N={n}, K/G], got {scale.shape}")
    g = k // scale.shape[2]
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
    g = k // weights[0][1].shape[2]
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
    args, dst, blocks = kernel_operands(x, weights, group_sizes, act, bm)
    wd = jnp.bfloat16 if act == "bf16" else jnp.int8
    kern = plgpu.kernel(
        functools.partial(_kernel, act, g, bm, k // g, stages, nw),
        out_type=jax.ShapeDtypeStruct((n, blocks * bm), jnp.bfloat16),
        grid=(n // BN, blocks),
        grid_names=("n", "m"),
        scratch_types=(
            plgpu.SMEM(
                (2 if act == "bf16" else 1, nw, 2, BN, g // 2),
                wd,
                transforms=_transforms(g // 2, jnp.dtype(wd).itemsize),
            ),
            plgpu.SMEM((BN, bm), jnp.bfloat16, transforms=_transforms(bm, 2)),
            *([plgpu.SMEM((bm,), jnp.float32), plgpu.Barrier()] if act == "int8" else []),
        ),
    )
    if interpret:
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(num_tma_threads_per_device=4)):
            out_t = kern(*args)
    else:
        out_t = kern(*args)
    return unpad(out_t, dst)


def kernel_operands(x, weights, group_sizes, act: str, bm: int):
    """The wrapper's XLA work before the kernel: (the kernel's operands, dst, blocks). Rows are padded by expert to
    whole token blocks (w4a8: quantised per token first), the scales transposed to [E, K/G, N]."""
    m, k = x.shape
    dst, block_expert, blocks = _pad_rows(group_sizes.astype(jnp.int32), m, bm)
    args = [block_expert]
    for q, scale in weights:
        args.append(lax.bitcast_convert_type(q, jnp.int8))
        args.append(jnp.swapaxes(scale, 1, 2))  # [E, K/G, N]: a CTA's 64 scales of one group are contiguous
    if act == "int8":
        xq, xs = quantize_int8(x)  # [M, K] int8, [M] f32
        args.append(jnp.zeros((blocks * bm, k), jnp.int8).at[dst].set(xq, mode="drop"))
        args.append(jnp.zeros((blocks * bm,), jnp.float32).at[dst].set(xs, mode="drop"))
    else:
        args.append(jnp.zeros((blocks * bm, k), x.dtype).at[dst].set(x, mode="drop"))  # [blocks * BM, K]
    return args, dst, blocks


def unpad(out_t, dst):
    """The kernel's out^T [N, blocks * BM] -> [M, N] in the caller's row order (the wrapper's XLA work after it)."""
    return jnp.take(out_t.T, dst, axis=0, mode="fill", fill_value=0)


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
