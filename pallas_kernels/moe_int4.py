"""Int4 MoE grouped GEMM (w4a16, w4a8): a Mosaic GPU (Hopper) kernel, its wrapper, and the pure-jnp reference.

The function is `jax.lax.ragged_dot(x, W, group_sizes)` with W the int4 experts of a `hcfjax.quant.QWeight`:
x [M, K] rows sorted by expert, q [E, N, K/2] packed int4, scale [E, N, K/G] f32 (G = 128), group_sizes [E].
hcfjax/quant.py documents the layout; within each K group of G, byte j holds k = j (low nibble) and k = j + G/2
(high nibble), so one group's packed bytes unpack into two contiguous K halves without any shuffle.

Kernel layout (the product is computed transposed, out^T = W^T x^T, so the weight tile is wgmma's A operand):
  grid (N/64, padded token blocks). The wrapper pads each expert's rows to a multiple of the token block BM, so a
  token block belongs to one expert (block_expert, -1 for unused blocks, which exit at once). Per K group a pipeline
  step TMA-loads the packed tile [64, G/2], the scales [64] and the token tile [BM, G]; the tile is unpacked with two
  arithmetic shifts in registers into the two K halves, then
    w4a16: scaled in f32, rounded to bf16, stored to smem, two bf16 wgmmas into the f32 accumulator [64, BM];
    w4a8:  stored to smem as int8, two int8 wgmmas into a fresh int32 accumulator (tokens pre-quantised per token),
           added to the f32 accumulator times the group scales; the token scales multiply the output in the wrapper.
  The bf16 tile out^T [64, BM] goes back by TMA; the wrapper gathers the rows back (transpose + gather in XLA).
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


def _block_m(m: int, e: int) -> int:
    """Token block: small in the decode regime (few tokens per expert), large when the tensor cores are the bound."""
    per_expert = m / max(e, 1)
    return 16 if per_expert <= 16 else 64 if per_expert <= 64 else 128


def _swizzle(row_bytes: int) -> int:
    for s in (128, 64, 32):
        if row_bytes % s == 0:
            return s
    raise ValueError(f"tile rows of {row_bytes} bytes cannot be swizzled")


def _transforms(cols: int, itemsize: int):
    import jax.experimental.pallas.mosaic_gpu as plgpu

    sw = _swizzle(cols * itemsize)
    return (plgpu.TilingTransform((8, sw // itemsize)), plgpu.SwizzleTransform(sw))


def _mma(acc, a_smem, b_smem, dtype, interpret: bool):
    """acc + A @ B with A, B in smem. As in mla_decode: the accumulator is fed to wgmma in place on the GPU; GPU
    interpret mode has no run_state, so there it is a fresh accumulator added in registers (the same arithmetic)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if interpret:

        def fresh(r):
            plgpu.wgmma(r, a_smem, b_smem)
            return r[...]

        return acc + pl.run_scoped(fresh, plgpu.ACC(acc.shape, dtype))
    return pl.run_state(lambda r: plgpu.wgmma(r, a_smem, b_smem))(plgpu.ACC.init(acc))


def _kernel(act, g, bm, k_groups, interpret, block_expert_ref, w_ref, s_ref, x_ref, o_ref, wd_smem, o_smem):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    ni, mi = lax.axis_index("n"), lax.axis_index("m")
    e = block_expert_ref[mi]
    half = g // 2
    wgmma_layout = plgpu.Layout.WGMMA
    row = plgpu.Layout.WGMMA.reduce(1)

    @pl.when(e >= 0)
    def _():
        def step(_, w_smem, s_smem, x_smem, acc):
            p = plgpu.load(w_smem, layout=wgmma_layout)  # int8 [BN, G/2], two int4 per byte
            lo = lax.shift_right_arithmetic(lax.shift_left(p, jnp.int8(4)), jnp.int8(4))  # k = j
            hi = lax.shift_right_arithmetic(p, jnp.int8(4))  # k = j + G/2
            s = plgpu.load(s_smem.at[0], layout=row)  # f32 [BN]
            x_lo = x_smem.at[:, pl.ds(0, half)].transpose((1, 0))
            x_hi = x_smem.at[:, pl.ds(half, half)].transpose((1, 0))
            if act == "bf16":
                wd_smem[0] = (lo.astype(jnp.float32) * s[:, None]).astype(jnp.bfloat16)
                wd_smem[1] = (hi.astype(jnp.float32) * s[:, None]).astype(jnp.bfloat16)
                plgpu.commit_smem()
                acc = _mma(acc, wd_smem.at[0], x_lo, jnp.float32, interpret)
                return _mma(acc, wd_smem.at[1], x_hi, jnp.float32, interpret)
            wd_smem[0] = lo
            wd_smem[1] = hi
            plgpu.commit_smem()

            def group(r):
                plgpu.wgmma(r, wd_smem.at[0], x_lo)
                plgpu.wgmma(r, wd_smem.at[1], x_hi)
                return r[...]

            part = pl.run_scoped(group, plgpu.ACC((BN, bm), jnp.int32))
            return acc + part.astype(jnp.float32) * s[:, None]

        x_item = 2 if act == "bf16" else 1
        acc0 = plgpu.layout_cast(jnp.zeros((BN, bm), jnp.float32), wgmma_layout)
        acc = plgpu.emit_pipeline(
            step,
            grid=(k_groups,),
            in_specs=[
                plgpu.BlockSpec((BN, half), lambda k: (ni, k), transforms=_transforms(half, 1)),
                plgpu.BlockSpec((1, BN), lambda k: (k, ni)),
                plgpu.BlockSpec((bm, g), lambda k: (mi, k), transforms=_transforms(half, x_item)),
            ],
            max_concurrent_steps=2,
            init_carry=acc0,
        )(w_ref.at[e], s_ref.at[e], x_ref)
        o_smem[...] = acc.astype(jnp.bfloat16)
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


@functools.partial(jax.jit, static_argnames=("act", "interpret", "block_m"))
def int4_ragged_dot(x, q, scale, group_sizes, act: str = "bf16", interpret: bool = False, block_m: int | None = None):
    """ragged_dot(x [M, K] bf16, int4 experts (q [E, N, K/2] uint8, scale [E, N, K/G] f32), group_sizes [E]) ->
    [M, N] bf16, on the Mosaic GPU kernel (`interpret`: Mosaic GPU's interpreter, on any backend)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

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
    bm = block_m or _block_m(m, e)
    dst, block_expert, blocks = _pad_rows(group_sizes.astype(jnp.int32), m, bm)
    if act == "int8":
        xq, xs = quantize_int8(x)
    else:
        xq, xs = x, None
    x_pad = jnp.zeros((blocks * bm, k), xq.dtype).at[dst].set(xq, mode="drop")
    w = lax.bitcast_convert_type(q, jnp.int8)
    st = jnp.swapaxes(scale, 1, 2)  # [E, K/G, N]: a CTA's 64 scales of one group are contiguous
    wd = jnp.bfloat16 if act == "bf16" else jnp.int8
    kern = plgpu.kernel(
        functools.partial(_kernel, act, g, bm, k // g, interpret),
        out_type=jax.ShapeDtypeStruct((n, blocks * bm), jnp.bfloat16),
        grid=(n // BN, blocks),
        grid_names=("n", "m"),
        scratch_types=(
            plgpu.SMEM((2, BN, g // 2), wd, transforms=_transforms(g // 2, jnp.dtype(wd).itemsize)),
            plgpu.SMEM((BN, bm), jnp.bfloat16, transforms=_transforms(bm, 2)),
        ),
    )
    if interpret:
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(num_tma_threads_per_device=4)):
            out_t = kern(block_expert, w, st, x_pad)
    else:
        out_t = kern(block_expert, w, st, x_pad)
    y = jnp.take(out_t.T, dst, axis=0, mode="fill", fill_value=0)  # [M, N]
    if xs is not None:
        y = (y.astype(jnp.float32) * xs[:, None]).astype(jnp.bfloat16)
    return y
