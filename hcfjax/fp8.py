"""DeepSeek's fp8 weights kept fp8: the pytree type, activation quantisation, and the w8a8 fp8 matmuls.

An `Fp8Weight` stands for a logical weight W [..., K, N] (the params' [in, out] convention; leading dims stack layers
and experts). It holds the checkpoint's tensors as shipped:

    q      float8_e4m3fn [..., N, K]        `X.weight`, output-major [out, in]
    scale_inv  f32       [..., N/B, K/B]    `X.weight_scale_inv`, one per B x B block (B = 128; partial blocks at
                                             the edges count): W[k, n] = q[n, k] * scale_inv[n // B, k // B]

Activations are quantised dynamically per token and B-channel group, as DeepSeek's `act_quant`: s = amax / 448 (the
e4m3 maximum), x / s rounded to e4m3 (scale_fmt "ue8m0": s rounded up to a power of two). The product is DeepSeek's
`fp8_gemm`: per K block b, the fp8 x fp8 dot accumulated in f32, times the token's scale of group b and the weight's
scale of block (n // B, b), summed over the blocks. Where opts.mode("moe") takes the kernel (a GPU, whole K
blocks), that is pallas_kernels/moe_fp8.py: per K block one fp8 wgmma, promoted to the f32 sum with both scales,
for the experts (`ragged_dot`, `gated_ragged_dot`) and the dense linears (`matmul`: one expert). Elsewhere the same
sum in XLA (the reference): `lax.dot_general` / `lax.ragged_dot` with float8_e4m3fn operands and
preferred_element_type f32, in a loop over the K blocks that carries one [M, N] f32 sum (no [K/B, M, N] partial
products: a prefill chunk's would not fit). XLA runs each block as its own GEMM of K = 128, 3-12x slower than bf16
on the H200, so the reference is for CPUs and checks. DeepSeek's shapes are whole blocks along K; elsewhere (small
test models) the last block is partial, quantised by itself and zero-padded for the product.

Dimension letters: M rows (tokens), K in, N out, E experts, B block.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax

from hcfjax.options import DEFAULT, Options

BLOCK = 128  # DeepSeek's weight blocks (128 x 128) and activation groups (1 x 128)
E4M3_MAX = 448.0
DTYPE = jnp.float8_e4m3fn


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Weight:
    q: jax.Array  # [..., N, K] float8_e4m3fn
    scale_inv: jax.Array  # [..., N/B, K/B] f32 (DeepSeek's name: it undoes the quantisation's division)
    scale_fmt: str | None = dataclasses.field(metadata=dict(static=True), default=None)  # activation scales

    @property
    def k(self) -> int:
        return self.q.shape[-1]

    @property
    def n(self) -> int:
        return self.q.shape[-2]

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical weight's shape [..., K, N] (so code that reads `w.shape` works unchanged)."""
        return (*self.q.shape[:-2], self.k, self.n)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __rmatmul__(self, x: jax.Array) -> jax.Array:
        """x @ w on the reference (the model calls `hcfjax.quant.linear`, which takes its options)."""
        return matmul(x, self)


def scale_shape(n: int, k: int) -> tuple[int, int]:
    """The block scales of an [N, K] weight: one per B x B block, partial blocks at the edges included."""
    return -(-n // BLOCK), -(-k // BLOCK)


def _pad_k(a: jax.Array) -> jax.Array:
    """[..., K] -> [..., K'] zero-padded to whole blocks (K' = K where K is a multiple of B)."""
    extra = -a.shape[-1] % BLOCK
    return a if not extra else jnp.pad(a, [(0, 0)] * (a.ndim - 1) + [(0, extra)])


def quantize_act(x: jax.Array, scale_fmt: str | None = None) -> tuple[jax.Array, jax.Array]:
    """DeepSeek's act_quant: x [..., K] -> (q [..., K] e4m3, s [..., K/B] f32) with x ~ q * s per B channels (a
    partial last group is quantised by itself)."""
    xp = _pad_k(x.astype(jnp.float32))
    xg = xp.reshape(*x.shape[:-1], xp.shape[-1] // BLOCK, BLOCK)
    s = jnp.maximum(jnp.max(jnp.abs(xg), axis=-1), 1e-12) / E4M3_MAX  # [..., K/B]; all-zero groups give q = 0
    if scale_fmt == "ue8m0":
        s = jnp.exp2(jnp.ceil(jnp.log2(s)))
    q = (xg / s[..., None]).astype(DTYPE).reshape(xp.shape)
    return q[..., : x.shape[-1]], s


@jax.jit
def quantize(w: jax.Array) -> Fp8Weight:
    """W [..., K, N] (float) -> Fp8Weight, per B x B block as DeepSeek quantises: scale = amax / 448."""
    k, n = w.shape[-2:]
    nb, kb = scale_shape(n, k)
    wt = jnp.swapaxes(w.astype(jnp.float32), -1, -2)  # [..., N, K]
    pad = [(0, 0)] * (wt.ndim - 2) + [(0, nb * BLOCK - n), (0, kb * BLOCK - k)]
    blocks = jnp.pad(wt, pad).reshape(*wt.shape[:-2], nb, BLOCK, kb, BLOCK)
    scale = jnp.maximum(jnp.max(jnp.abs(blocks), axis=(-3, -1)), 1e-12) / E4M3_MAX  # [..., N/B, K/B]
    q = (blocks / scale[..., :, None, :, None]).astype(DTYPE).reshape(*wt.shape[:-2], nb * BLOCK, kb * BLOCK)
    return Fp8Weight(q[..., :n, :k], scale)


def block_scales(scale: jax.Array, n: int, k: int) -> jax.Array:
    """Block scales [..., N/B, K/B] -> one per weight element [..., N, K]."""
    s = jnp.repeat(jnp.repeat(scale, BLOCK, axis=-2), BLOCK, axis=-1)
    return s[..., :n, :k]


def dequantize(w: Fp8Weight, dtype=jnp.float32) -> jax.Array:
    """Fp8Weight -> W [..., K, N] in dtype."""
    wf = w.q.astype(jnp.float32) * block_scales(w.scale_inv, w.n, w.k)
    return jnp.swapaxes(wf, -1, -2).astype(dtype)


def _block(a: jax.Array, i) -> jax.Array:
    """K block i of a [..., K] array: [..., B]."""
    return lax.dynamic_slice_in_dim(a, i * BLOCK, BLOCK, axis=-1)


def _out_scales(scale: jax.Array, i, n: int) -> jax.Array:
    """The weight's scales of K block i, one per output: [..., N/B, K/B] -> [..., N]."""
    s = lax.dynamic_index_in_dim(scale, i, axis=-1, keepdims=False)
    return jnp.repeat(s, BLOCK, axis=-1)[..., :n]


def _sum_blocks(k: int, partial) -> jax.Array:
    """sum over K blocks of partial(i) ([M, N] f32). The first block starts the sum: a carry made from the inputs
    has their type inside shard_map (varying over the EP axis), where a zeros carry would not match."""
    return lax.fori_loop(1, -(-k // BLOCK), lambda i, y: y + partial(i), partial(0))


def kernel_mode(opts: Options, w: Fp8Weight) -> str:
    """opts.mode("moe") for this weight: the kernel takes whole 128-channel K blocks and N in 64-row tiles."""
    from pallas_kernels.moe_fp8 import supports

    return opts.mode("moe", supports(w.k, w.n))


def _kernel_x(x: jax.Array, w: Fp8Weight) -> tuple[jax.Array, jax.Array]:
    """x [M, K] -> the kernel's tokens: e4m3 [M, K] and scales K-block-major [K/B, M] (one fused pass)."""
    xq, xs = quantize_act(x, w.scale_fmt)
    return xq, xs.T


def matmul(x: jax.Array, w: Fp8Weight, opts: Options = DEFAULT) -> jax.Array:
    """x [..., K] @ W [K, N] -> [..., N] in x's dtype (one unstacked weight): DeepSeek's fp8_gemm."""
    if w.q.ndim != 2:
        raise ValueError(f"fp8 matmul takes one [N, K] weight, got q {w.q.shape} (stacked weights: ragged_dot)")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, w.k)
    mode = kernel_mode(opts, w)
    if mode != "reference":
        from pallas_kernels.moe_fp8 import fp8_ragged_dot

        one = jnp.full((1,), x2.shape[0], jnp.int32)
        y = fp8_ragged_dot(*_kernel_x(x2, w), w.q[None], w.scale_inv[None], one, interpret=mode == "interpret")
        return y.reshape(*lead, w.n).astype(x.dtype)
    xq, xs = quantize_act(x2, w.scale_fmt)  # [M, K] e4m3, [M, K/B] f32
    xq, wq = _pad_k(xq), _pad_k(w.q)

    def partial(i):
        acc = lax.dot_general(
            _block(xq, i), _block(wq, i), (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )  # [M, N]: an fp8 x fp8 dot, f32 accumulation
        return acc * lax.dynamic_index_in_dim(xs, i, axis=-1) * _out_scales(w.scale_inv, i, w.n)

    return _sum_blocks(w.k, partial).reshape(*lead, w.n).astype(x.dtype)


def gated_matmul(x: jax.Array, gate: Fp8Weight, up: Fp8Weight, opts: Options = DEFAULT) -> jax.Array:
    """silu(x @ gate) * (x @ up) (a dense or shared-expert MLP's first half): one fused kernel where it runs."""
    mode = kernel_mode(opts, gate) if gate.q.shape == up.q.shape and gate.q.ndim == 2 else "reference"
    if mode == "reference":
        return jax.nn.silu(matmul(x, gate, opts)) * matmul(x, up, opts)
    from pallas_kernels.moe_fp8 import fp8_gated_ragged_dot

    x2 = x.reshape(-1, gate.k)
    one = jnp.full((1,), x2.shape[0], jnp.int32)
    pairs = [(w.q[None], w.scale_inv[None]) for w in (gate, up)]
    y = fp8_gated_ragged_dot(*_kernel_x(x2, gate), *pairs, one, interpret=mode == "interpret")
    return y.reshape(*x.shape[:-1], gate.n).astype(x.dtype)


def ragged_dot(x: jax.Array, w: Fp8Weight, group_sizes: jax.Array, opts: Options = DEFAULT) -> jax.Array:
    """The `jax.lax.ragged_dot` contract over fp8 experts: x [M, K] rows sorted by expert, w: Fp8Weight of
    [E, K, N], group_sizes [E] (sum <= M; rows past the sum give 0) -> [M, N] in x's dtype. On the kernel where
    opts.mode("moe") says so; else per K block one `lax.ragged_dot` of e4m3 operands (as the int8 experts run,
    pallas_kernels/quant_reference.py), scaled per row by its token's group scale and its expert's block scales."""
    mode = kernel_mode(opts, w)
    if mode != "reference":
        from pallas_kernels.moe_fp8 import fp8_ragged_dot

        y = fp8_ragged_dot(*_kernel_x(x, w), w.q, w.scale_inv, group_sizes, interpret=mode == "interpret")
        return y.astype(x.dtype)
    e, m = w.q.shape[0], x.shape[0]
    xq, xs = quantize_act(x, w.scale_fmt)  # [M, K], [M, K/B]
    xq, wq = _pad_k(xq), _pad_k(w.q)
    # Each row's expert, to pick its weight scales; rows past the groups map to a clamped expert (their dots are 0).
    # compare_all: jnp.searchsorted's default is a while loop, a host round trip per step on XLA GPU.
    ends = jnp.cumsum(group_sizes)
    rows = jnp.minimum(jnp.searchsorted(ends, jnp.arange(m), side="right", method="compare_all"), e - 1)

    def partial(i):
        wi = jnp.swapaxes(_block(wq, i), -1, -2)  # [E, B, N]
        acc = lax.ragged_dot(_block(xq, i), wi, group_sizes, preferred_element_type=jnp.float32)  # [M, N]
        ws = lax.dynamic_index_in_dim(w.scale_inv, i, axis=-1, keepdims=False)[rows]  # [M, N/B]
        return acc * lax.dynamic_index_in_dim(xs, i, axis=-1) * jnp.repeat(ws, BLOCK, axis=-1)[:, : w.n]

    return _sum_blocks(w.k, partial).astype(x.dtype)


def gated_ragged_dot(x: jax.Array, gate: Fp8Weight, up: Fp8Weight, group_sizes: jax.Array, opts=DEFAULT):
    """silu(ragged_dot(x, gate)) * ragged_dot(x, up) over fp8 experts: one fused kernel where it runs."""
    mode = kernel_mode(opts, gate) if gate.q.shape == up.q.shape else "reference"
    if mode == "reference":
        return jax.nn.silu(ragged_dot(x, gate, group_sizes, opts)) * ragged_dot(x, up, group_sizes, opts)
    from pallas_kernels.moe_fp8 import fp8_gated_ragged_dot

    pairs = [(w.q, w.scale_inv) for w in (gate, up)]
    y = fp8_gated_ragged_dot(*_kernel_x(x, gate), *pairs, group_sizes, interpret=mode == "interpret")
    return y.astype(x.dtype)


def nbytes(w: Fp8Weight) -> int:
    return math.prod(w.q.shape) + w.scale_inv.nbytes


# ---- checkpoints -----------------------------------------------------------------------------------------------

# The linears DeepSeek ships in fp8 that stay fp8 on the device: MLA's projections and every MLP (dense, shared,
# routed experts). kv_b is fp8 on disk too but is dequantised on load: it is held as W_UK and W_UV, which the
# absorbed decode folds into the query and the output (DeepSeek's own inference code dequantises it there).
# Embeddings, norms, routers, LM heads and the MTP combiner are bf16 in DeepSeek's checkpoints.
LINEARS = ("q_a", "q_b", "q", "kv_a", "o", "gate", "up", "down")
QUANT = (8, "fp8")  # tensor_specs.TensorSpec.quant of an Fp8Weight's `q`


def checkpoint_specs(specs: list) -> list:
    """The name table (tensor_specs.TensorSpec) of a DeepSeek fp8 checkpoint loaded as fp8: each LINEARS `X.weight`
    [N, K] is e4m3 and `X.weight_scale_inv` f32 [N/B, K/B], both kept as stored, at params paths (..., 'q') and
    (..., 'scale_inv') of one Fp8Weight."""
    out = []
    for s in specs:
        if not (s.linear and s.path[-1] in LINEARS):
            out.append(s)
            continue
        blocks = scale_shape(*s.shape)
        out.append(
            dataclasses.replace(
                s, path=s.path + ("q",), pshape=s.shape, linear=False, dtype="float8_e4m3fn", quant=QUANT
            )
        )
        out.append(
            dataclasses.replace(
                s,
                name=s.name + "_scale_inv",
                path=s.path + ("scale_inv",),
                shape=blocks,
                pshape=blocks,
                linear=False,
                dtype="float32",
            )
        )
    return out
