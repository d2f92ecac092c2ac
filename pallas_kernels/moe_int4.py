"""Int4 MoE grouped GEMM (w4a16, w4a8): a Mosaic GPU (Hopper) kernel, its wrapper, and the pure-jnp reference.

The function is `jax.lax.ragged_dot(x, W, group_sizes)` with W the int4 experts of a `hcfjax.quant.QWeight`:
x [M, K] rows sorted by expert, q [E, N, K/2] packed int4, scale [E, K/G, N] f32 (G = 128), group_sizes [E].
hcfjax/quant.py documents the layout; within each K group of G, byte j holds k = j (low nibble) and k = j + G/2
(high nibble), so one group's packed bytes unpack into two contiguous K halves without any shuffle.

Kernel layout (the product is computed transposed, out^T = W^T x^T, so the weight tile is wgmma's A operand and the
token tile, read K-major, its B operand, as int8 wgmma requires):
  grid (N/bn, token blocks); a CTA is one warpgroup (with Tiling.wgs = 2, the fused kernel's prefill default: two
  compute warpgroups with bn/2 weight rows each against one token tile, and a third that issues the pipeline's
  TMAs). x is not copied (only padded to whole 8-row tiles when M is not a multiple of 8): each CTA finds its
  token block from group_sizes (`block_info`, a few scalar ops per expert): its expert and a bm-row tile of x at a
  row offset (a multiple of 8); the block owns the rows of its tile that are its expert's (a tile may reach into the
  neighbouring groups, whose rows it computes and drops; past M the TMA loads zeros). Rows past sum(group_sizes)
  form one more group whose blocks store zeros; unused blocks exit at once. `Tiling` says how big a CTA's tile is
  and how deep its pipeline; with Tiling.narrow (w4a8 prefill) a block that needs fewer rows than bm (a group's
  last) runs the same code at the narrowest multiple of 16 that holds them (`block_widths`).
  A pipeline of `stages` steps over the K groups (`gps` groups a step) TMA-loads per step the packed tiles
  [bn, gps G/2], their scales [gps, bn] (contiguous: the scales are stored K-group-major) and the token tile
  [bm, gps G]. Each 64-row packed tile is loaded into registers in the layout of a wgmma A operand and unpacked there
  with integer and bf16x2 ops (int4_unpack.py: no conversion instructions, no smem round trip), then
    w4a16: two bf16 wgmmas (the group's K halves, weights scaled in bf16) accumulate into f32 accumulators that live
           across the pipeline;
    w4a8:  two int8 wgmmas (16 q x int8 tokens, pre-quantised per token) into int32 accumulators started at MAGIC,
           so that the int32 sum's bits read as the f32 1.5 * 2^23 + sum (no int -> float conversion), then added to
           the f32 accumulators times the group scales / 16; the token scales ([bm] f32, copied once into a buffer of
           their own) multiply the result at the end (per-group token scales, the down projection's in the model:
           each group's partial times both scales, in two FFMAs).
  Each step waits for its wgmmas (their A registers are then free; w4a8 still reads the step's scales from the slot
  in its fold, and fences before the slot's refill); a CTA's unpacking overlaps other CTAs' MMAs (2 to 4 CTAs per
  SM).
  int4_gated_ragged_dot runs the same loop over two weights (gate, up) with two sets of accumulators and one token
  tile, and writes silu(gate) * up (f32, rounded once): the expert MLP's first half in one kernel.
  Split-K (Tiling.splits > 1, decode calls with few output tiles): a third grid axis gives each CTA a slice of the
  K groups, and the CTA stores its f32 partials (gate and up side by side, before SiLU) to [splits, M, nw N], which
  the wrapper sums in one XLA fusion.
  The f32 tile out^T [bn, bm] is stored transposed into an untiled bf16 smem tile [bm, bn] that reuses the
  pipeline's buffers, and only the block's rows go to out [M, N] in x's row order, by TMA stores of power-of-two row
  counts (as jax's ragged_dot_mgpu.py does: a TMA box has a static size). No XLA pass after the kernel; before it
  only, for w4a8, the per-token int8 quantisation of x (one fused pass; in the kernel it would be
  redone by every one of the N/bn CTAs that share a token tile, and each needs the token's max over all of K first).
Shared memory per CTA is `smem_bytes`; docs/kernels.md has the configurations and the reasoning behind `default_tiling`.

w4a16 with few rows per expert (`digits_pay`) runs on the w4a8 kernel instead (`int4_ragged_dot_digits`): each row of
x becomes two rows of int8 digits, the row and its quantisation residual, both quantised per 128 channels, and each
pair's products are summed in the epilogue (Tiling.pairs, before gate/up's SiLU: the fused kernel runs w4a16's
gate/up too). Unpacking for the int8 MMAs costs a fraction of the bf16 one, and while the doubled rows still fit
16-row token blocks the MMAs take no more columns.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import lowering_cache
from pallas_kernels.int8_quant import dequantize_int8_groups, quantize_int8, quantize_int8_groups
from pallas_kernels.moe_int4_kernel import kernel_body, smem_transforms
from pallas_kernels.moe_int4_tiling import (
    BN,
    KC,
    QGROUP,
    ROW_ALIGN,
    Tiling,
    a_tiles,
    check_tiling,
    default_tiling,
    digits_pay,
    k_steps,
    num_blocks,
    xs_block,
)
from pallas_kernels.quant_reference import ragged_dot_reference

ACTS = ("bf16", "int8")
HS_PAD = 256 + ROW_ALIGN  # rows past M in the quantised output's scales: enough for any down projection's block


def int4_ragged_dot_reference(x, q, scale, group_sizes, act="bf16"):
    """The kernel's function in plain jnp (quant_reference's): x [M, K] -> [M, N] in x's dtype."""
    return ragged_dot_reference(x, q, scale, group_sizes, 4, act)


def supports(x, q, scale) -> bool:
    """Whether the kernel takes these operands (else callers use the reference): bf16 x, N a multiple of 64, the
    int4 group a multiple of 128."""
    k = x.shape[-1]
    return x.dtype == jnp.bfloat16 and q.shape[-2] % BN == 0 and (k // scale.shape[-2]) % (2 * KC) == 0


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
    if g % (2 * KC) or n % BN:
        raise ValueError(f"the kernel needs the int4 group (={g}) a multiple of {2 * KC} and N (={n}) of {BN}")
    if group_sizes.shape != (e,):
        raise ValueError(f"group_sizes must be [E={e}], got {group_sizes.shape}")


def _kernel(body_args, out_type, grid):
    """The kernel of one launch, from static arguments only (lowering_cache may build it in another process)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    act, g, _, nw, _, _, t, _, xgroups, _ = body_args
    a_dtype = jnp.bfloat16 if act == "bf16" else jnp.int8
    a_smem = plgpu.SMEM(
        (a_tiles(t, g, nw), BN, KC), a_dtype, transforms=smem_transforms(KC, jnp.dtype(a_dtype).itemsize)
    )
    fixed = [plgpu.SMEM((t.bm,), jnp.float32), plgpu.Barrier()] if act == "int8" and not xgroups else []
    return plgpu.kernel(
        functools.partial(kernel_body, *body_args),
        out_type=out_type,
        grid=grid,
        grid_names=("n", "m", "k"),
        scratch_types=(*fixed, *([] if t.a_regs else [a_smem])),
        **(dict(num_threads=t.wgs + 1, thread_name="wg") if t.wgs > 1 else {}),
        kernel_name=f"moe_{'w4a8' if act == 'int8' else 'w4a16'}{'_gated' if nw == 2 else ''}",  # in profiles, ncu
    )


def _run(x, weights, group_sizes, act, interpret, tiling, x_q=None, quant_out=False):
    """The kernel over weights = ((q, scale),) or ((q_gate, s_gate), (q_up, s_up)) -> [M, N] bf16, or with quant_out
    (int8 [M, N], scales [N/128, M'] with M' >= M + HS_PAD)."""
    for q, scale in weights:
        _check(x, q, scale, group_sizes, act)
    if len(weights) == 2 and weights[0][0].shape != weights[1][0].shape:
        raise ValueError(f"gate and up differ: {weights[0][0].shape} vs {weights[1][0].shape}")
    nw = len(weights)
    m, k = x.shape
    n = weights[0][0].shape[1]
    g = k // weights[0][1].shape[1]
    e = group_sizes.shape[0]
    xgroups = act == "int8" and x_q is not None and x_q[1].ndim == 2
    if xgroups and (g != QGROUP or x_q[1].shape[0] != k // g):
        raise ValueError(f"per-group x scales {x_q[1].shape} need K groups of {QGROUP} ({k // QGROUP} of them)")
    t = tiling or default_tiling(act, m, n, k // g, e, nw, g, splits=1 if xgroups else None)  # (no split-K there)
    if quant_out and tiling is None and (t.bn < QGROUP or t.wgs > 1):  # a CTA's N tile: whole 128-channel groups
        t = default_tiling(act, m, n, k // g, e, nw, g, bn=QGROUP, wgs=1)
    if interpret:
        t = dataclasses.replace(t, a_regs=False, inline=False)
    check_tiling(t, act, n, k // g, g, nw, interpret, xgroups, quant_out)
    args = kernel_operands(x, weights, group_sizes, act, t.bm, x_q)
    rows = max(m, t.bm)
    out_type = (
        jax.ShapeDtypeStruct((rows, n), jnp.bfloat16)
        if t.splits == 1
        else jax.ShapeDtypeStruct((t.splits, rows, nw * n), jnp.float32)
    )
    if quant_out:
        out_type = (
            jax.ShapeDtypeStruct((rows, n), jnp.int8),
            jax.ShapeDtypeStruct((n // QGROUP, _hs_rows(m)), jnp.float32),
        )
    body_args = (act, g, k_steps(t, k // g), nw, m, e, t, t.inline, xgroups, quant_out)
    kern = functools.partial(_kernel, body_args, out_type, (n // t.bn, num_blocks(m, e, t.bm), t.splits))
    out = run_grouped(("moe_int4", body_args), kern, args, out_type, interpret, t.splits, nw)
    if quant_out:
        return out[0][:m], out[1]  # the scales keep their padding rows: the down projection's blocks read past M
    return out[:m]  # [M, N] (a slice only when M < bm)


def run_grouped(key, kern, args, out_type, interpret: bool, splits: int, nw: int, sum_splits: bool = True):
    """A grouped-GEMM kernel's launch (the int4 and fp8 kernels'): kern() run by Mosaic GPU's interpreter, or
    lowered once per process under `key` (lowering_cache); with split-K (splits > 1) its f32 partials [splits, M,
    nw N] summed, and gate/up's SiLU product formed, in one XLA fusion -> [M, N] bf16 (sum_splits=False: the
    partials as they are, for a consumer that adds them itself)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    if interpret:
        with plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams(num_tma_threads_per_device=4)):
            out = kern()(*args)
    else:
        out = lowering_cache.launch(key, kern, *args, out=out_type)
    if splits == 1 or not sum_splits:
        return out
    out = out.sum(0)
    n = out.shape[1] // nw
    return (jax.nn.silu(out[:, :n]) * out[:, n:] if nw == 2 else out).astype(jnp.bfloat16)


def kernel_operands(x, weights, group_sizes, act: str, bm: int, x_q=None):
    """The wrapper's XLA work before the kernel, all of it: q bitcast to int8 (free), and w4a8's per-token
    quantisation of x (one fused pass: [M, K] int8 and [M] f32 scales) unless the caller gives it as x_q (the
    model quantises its tokens before gathering their top-k copies: 1/k of the rows, fused with the gather). A
    token tile past x's last row is zero-filled by the TMA, so x goes in as it is when M is a multiple of 8 (V3's
    top-8 always is); otherwise it is padded to whole 8-row tiles, one copy of x (the tiled TMA's row count must be
    a multiple of its 8-row tile), and to one block when M < bm. The weight scales are used as stored
    ([E, K/G, N]); each CTA finds its token block from group_sizes itself. The token scales need a block's worth
    past M (a few bytes: their copy into smem is a plain [bm] slice, which must stay in bounds): per-row scales [M']
    and per-group scales [K/G, M'] (x_q from a producer that quantised in groups) are padded only if M' is short of
    that (the gate/up kernel's quantised output and the routing kernels' copies leave HS_PAD rows)."""
    m = x.shape[0]
    pad = ((0, max(bm, -(-m // ROW_ALIGN) * ROW_ALIGN) - m), (0, 0))
    args = [group_sizes.astype(jnp.int32)]
    for q, scale in weights:
        args += [lax.bitcast_convert_type(q, jnp.int8), scale]
    if act == "int8":
        xq, xs = quantize_int8(x) if x_q is None else x_q  # [M, K] int8, [M] f32 or [K/G, M'] f32
        need = m + xs_block(bm) + ROW_ALIGN
        if xs.ndim == 2:
            xs = _pad_rows(xs, need)
        elif xs.shape[0] < need:
            xs = jnp.pad(xs, (0, need - xs.shape[0]))
        args += [jnp.pad(xq, pad), xs]
    else:
        args.append(jnp.pad(x, pad))
    return args


def _hs_rows(m: int) -> int:
    """Columns of the per-group scales the gate/up kernel writes for m rows: m + HS_PAD, rounded up to a multiple of
    32 floats. A TMA source's row stride needs only 16 bytes (4 floats); 32 matches the per-step scale blocks the
    down projection reads (`xs_block`), and was what the H200 runs used."""
    return -(-(m + HS_PAD) // 32) * 32


def _pad_rows(xs, rows: int):
    """Per-group scales [K/G, M'] with at least `rows` columns and a 16-byte row stride."""
    want = -(-max(rows, xs.shape[1]) // 4) * 4
    return xs if xs.shape[1] == want else jnp.pad(xs, ((0, 0), (0, want - xs.shape[1])))


@functools.partial(jax.jit, static_argnames=("act", "interpret", "tiling", "digits"))
def int4_ragged_dot(
    x,
    q,
    scale,
    group_sizes,
    act: str = "bf16",
    interpret: bool = False,
    tiling: Tiling | None = None,
    x_q=None,
    digits: bool = True,
):
    """ragged_dot(x [M, K] bf16, int4 experts (q [E, N, K/2] uint8, scale [E, K/G, N] f32), group_sizes [E]) ->
    [M, N] bf16, on the Mosaic GPU kernel (`interpret`: Mosaic GPU's interpreter, on any backend). `tiling` defaults
    by the regime (`default_tiling`). w4a8: x_q = quantize_int8(x) when the caller has it (x is then only a shape),
    or (int8 [M, K], scales [K/128, M' >= M]) quantised per row and 128 channels (hcfjax.quant.quantize_int8_groups;
    int4_gated_ragged_dot(..., quant_out=True) writes it): each K group's partial is then scaled by its own.
    w4a16 without a tiling runs as int8 digits on the w4a8 kernel where that pays (`digits_pay`) unless not digits."""
    (e, n, _), (m, k), k_groups = q.shape, x.shape, scale.shape[1]
    if act == "bf16" and tiling is None and digits and digits_pay(m, n, k // k_groups, k_groups, e):
        return int4_ragged_dot_digits(x, q, scale, group_sizes, interpret)
    return _run(x, ((q, scale),), group_sizes, act, interpret, tiling, x_q)


def int8_digits(x):
    """x [M, K] -> two int8 digits per value, interleaved by row: (int8 [2M, K], scales [K/128, 2M] f32), rows 2i and
    2i + 1 x's row i quantised per 128 channels and the residual of that quantised the same way: x = d0 s0 + d1 s1 up
    to s1 / 2 <= s0 / 508 (about 1 / 64,500 of each group's largest value, against bf16's 1 / 512 of each value)."""
    m, k = x.shape
    d0, s0 = quantize_int8_groups(x, QGROUP)
    d1, s1 = quantize_int8_groups(x.astype(jnp.float32) - dequantize_int8_groups(d0, s0), QGROUP)
    return jnp.stack([d0, d1], 1).reshape(2 * m, k), jnp.stack([s0, s1], 2).reshape(k // QGROUP, 2 * m)


@functools.partial(jax.jit, static_argnames=("interpret", "tiling"))
def int4_ragged_dot_digits(x, q, scale, group_sizes, interpret: bool = False, tiling: Tiling | None = None):
    """w4a16 on the w4a8 kernel: each row of x as two int8 digits (`int8_digits`, one XLA pass), both through the
    int8 tensor cores with w4a8's cheap unpacking (no bf16 weights formed: q times the group scales in f32, exactly),
    and each row pair's products summed in the kernel's epilogue (Tiling.pairs; the output's odd rows dropped). The
    result differs from the bf16 product by the digits' residual, below 1 / 64,500 of each 128-channel group's
    largest value: closer to the exact product than the w4a16 kernel (bf16 weights) for values within 1/126 of their
    group's largest, further for smaller ones, all well inside bf16's tolerance of the output
    (tests/test_quant_kernel.py)."""
    return _run_digits(x, ((q, scale),), group_sizes, interpret, tiling)


def _run_digits(x, weights, group_sizes, interpret, tiling):
    """The w4a8 kernel over x's int8 digits with Tiling.pairs (each row pair's products summed in the epilogue,
    before gate/up's SiLU): the even rows of its output are the product."""
    (m, k), (e, n, _) = x.shape, weights[0][0].shape
    t = tiling or default_tiling("int8", 2 * m, n, weights[0][1].shape[1], e, len(weights), splits=1)
    x2 = jnp.broadcast_to(jnp.zeros((), x.dtype), (2 * m, k))  # (a shape only: the kernel reads the digits)
    y = _run(x2, weights, 2 * group_sizes, "int8", interpret, dataclasses.replace(t, pairs=True), int8_digits(x))
    return y[::2]


@functools.partial(jax.jit, static_argnames=("act", "interpret", "tiling", "quant_out", "digits"))
def int4_gated_ragged_dot(
    x,
    gate,
    up,
    group_sizes,
    act: str = "bf16",
    interpret: bool = False,
    tiling: Tiling | None = None,
    x_q=None,
    quant_out: bool = False,
    digits: bool = True,
):
    """silu(ragged_dot(x, Wg)) * ragged_dot(x, Wu) in one kernel (an expert's gate/up projection): gate and up are
    (q, scale) pairs as in int4_ragged_dot; the product is formed in f32 and rounded to bf16 once. x_q as in
    int4_ragged_dot. quant_out (w4a8): the product is written quantised per row and 128 channels, as
    (int8 [M, N], scales [N/128, M' >= M + HS_PAD] f32) = quantize_int8_groups of the bf16 product (the scales'
    columns past M are padding), which the down projection takes as its x_q: no XLA pass between the kernels. w4a16
    without a tiling runs as int8 digits on the w4a8 kernel where that pays (`digits_pay`) unless not digits."""
    (e, n, _), (m, k), k_groups = gate[0].shape, x.shape, gate[1].shape[1]
    if act == "bf16" and tiling is None and not quant_out and digits and digits_pay(m, n, k // k_groups, k_groups, e):
        return _run_digits(x, (tuple(gate), tuple(up)), group_sizes, interpret, None)
    return _run(x, (tuple(gate), tuple(up)), group_sizes, act, interpret, tiling, x_q, quant_out)


@functools.partial(jax.jit, static_argnames=("interpret", "tiling"))
def int4_gated_ragged_dot_digits(x, gate, up, group_sizes, interpret: bool = False, tiling: Tiling | None = None):
    """int4_gated_ragged_dot in w4a16 as `int4_ragged_dot_digits` runs it: x's int8 digits through the fused w4a8
    kernel, each row pair's gate and up products summed before the SiLU."""
    return _run_digits(x, (tuple(gate), tuple(up)), group_sizes, interpret, tiling)


def int4_gated_reference(x, gate, up, group_sizes, act="bf16", quant_out=False):
    """The gated kernel's function in plain jnp: the two projections as in int4_ragged_dot_reference (bf16 outputs),
    then silu(gate) * up in f32; quant_out: that product quantised per row and 128 channels (the scales unpadded)."""
    yg = int4_ragged_dot_reference(x, *gate, group_sizes, act).astype(jnp.float32)
    yu = int4_ragged_dot_reference(x, *up, group_sizes, act).astype(jnp.float32)
    h = (jax.nn.silu(yg) * yu).astype(x.dtype)
    return quantize_int8_groups(h, QGROUP) if quant_out else h
