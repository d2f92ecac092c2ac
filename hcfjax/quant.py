"""Quantised weights: the pytree type, quantise/dequantise, and the matmuls that run them.

A `QWeight` stands for a logical weight W [..., K, N] (the params' [in, out] convention; leading dims stack layers
and experts). Its values are stored output-major, K contiguous, exactly as a checkpoint's [out, in] tensor; its
scales K-group-major, like W itself:

    int4 (bits=4):  q      uint8 [..., N, K/2]   per K group of G (128) inputs, G/2 bytes: byte j of group i holds
                                                  k = iG + j in its low nibble and k = iG + j + G/2 in its high
                                                  nibble, two's complement, values in [-7, 7]
                    scale  f32   [..., K/G, N]    symmetric: W[k, n] ~ q[n, k] * scale[k // G, n]
    int8 (bits=8):  q      int8  [..., N, K]      per output channel: G = K, scale f32 [..., 1, N]

Output-major values make a weight tile the A operand of the GPU kernel's transposed product (out^T = W^T x^T),
and packing a group's two halves (not neighbours) together lets the kernel unpack a tile into two contiguous K halves
with two shifts (pallas_kernels/moe_int4.py). K-group-major scales put the kernel's 64 scales of one group and one
output block in 256 contiguous bytes (one TMA), with no per-call transpose. Checkpoints keep the scales [N, K/G]
(`X.weight_scale`, output-major like the weight); loading transposes them once, as it does the weights.

`act` says what the activations do: "bf16" (weight-only: dequantise, then a float matmul) or "int8" (per-token
dynamic symmetric int8 activations, int8 x int8 -> int32 per K group, the weight's group scales and the token's scale
applied to the int32 partial sums). Dimension letters: M rows (tokens), K in, N out, E experts, G group size.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from hcfjax import fp8
from hcfjax.options import DEFAULT, Options
from pallas_kernels import quant_reference
from pallas_kernels.int8_quant import (  # noqa: F401 (re-exported: the model and tests import them from here)
    ACT_GROUP,
    dequantize_int8_groups,
    quantize_int8,
    quantize_int8_groups,
)
from pallas_kernels.int8_quant import grouped as _grouped
from pallas_kernels.quant_reference import pack_int4, unpack_int4  # noqa: F401 (re-exported)

GROUP = 128  # int4 group size along K (symmetric scales)
ACTS = ("bf16", "int8")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QWeight:
    q: jax.Array  # [..., N, K/2] uint8 (int4 packed) or [..., N, K] int8
    scale: jax.Array  # [..., K/G, N] f32
    bits: int = dataclasses.field(metadata=dict(static=True), default=4)
    act: str = dataclasses.field(metadata=dict(static=True), default="bf16")

    @property
    def k(self) -> int:
        return self.q.shape[-1] * (2 if self.bits == 4 else 1)

    @property
    def n(self) -> int:
        return self.q.shape[-2]

    @property
    def group(self) -> int:
        return self.k // self.scale.shape[-2]

    @property
    def shape(self) -> tuple[int, ...]:
        """The logical weight's shape [..., K, N] (so code that reads `w.shape` works unchanged)."""
        return (*self.q.shape[:-2], self.k, self.n)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __rmatmul__(self, x: jax.Array) -> jax.Array:
        """x @ w, so that `x @ p["gate"]` in the model runs a quantised layer unchanged."""
        return matmul(x, self)


def group_size(k: int, bits: int, group: int = GROUP) -> int:
    """The K group of a weight with K inputs: `group` (int4), K itself when K < group, or K (int8, per channel)."""
    if bits == 8:
        return k
    g = min(group, k)
    if k % g or k % 2:
        raise ValueError(f"int4 weights need K (={k}) even and a multiple of the group size {g}")
    return g


@functools.partial(jax.jit, static_argnames=("bits", "act", "group"))
def quantize(w: jax.Array, bits: int = 4, act: str = "bf16", group: int = GROUP) -> QWeight:
    """Symmetric quantisation of w [..., K, N] (float) to a QWeight (see the module docstring for the layout)."""
    if bits not in (4, 8) or act not in ACTS:
        raise ValueError(f"unsupported quantisation bits={bits} act={act!r}")
    k = w.shape[-2]
    g = group_size(k, bits, group)
    qmax = 7 if bits == 4 else 127
    wt = jnp.swapaxes(w.astype(jnp.float32), -1, -2)  # [..., N, K]
    wg = wt.reshape(*wt.shape[:-1], k // g, g)
    scale = jnp.maximum(jnp.max(jnp.abs(wg), axis=-1), 1e-12) / qmax  # [..., N, K/G]
    q = jnp.clip(jnp.round(wg / scale[..., None]), -qmax, qmax).astype(jnp.int8).reshape(wt.shape)
    return QWeight(pack_int4(q, g) if bits == 4 else q, jnp.swapaxes(scale, -1, -2), bits, act)


@functools.partial(jax.jit, static_argnames=("how", "group"))
def quantize_as(w: jax.Array, how: tuple[int, str], group: int = GROUP):
    """w [..., K, N] (float) quantised as a TensorSpec's `quant` says: fp8.QUANT -> Fp8Weight, (bits, act) ->
    QWeight."""
    return fp8.quantize(w) if how == fp8.QUANT else quantize(w, how[0], how[1], group)


def int_values(w: QWeight) -> jax.Array:
    """The integer weights, int8 [..., N, K]."""
    return quant_reference.int_values(w.q, w.scale, w.bits)


def dequantize(w: QWeight, dtype=jnp.float32) -> jax.Array:
    """QWeight -> W [..., K, N] in dtype."""
    return quant_reference.dequantize(w.q, w.scale, w.bits, dtype)


def matmul(x: jax.Array, w: QWeight) -> jax.Array:
    """x [..., K] @ W [K, N] -> [..., N] in x's dtype (one unstacked weight; dense layers)."""
    if w.act == "bf16":
        return jnp.einsum("...K,KN->...N", x, dequantize(w, x.dtype))
    xq, xs = quantize_int8(x)  # [..., K] int8, [...] f32
    g = w.group
    acc = jnp.einsum(
        "...GK,NGK->...GN", _grouped(xq, g), _grouped(int_values(w), g), preferred_element_type=jnp.int32
    )  # int32 partial sums per K group
    y = jnp.einsum("...GN,GN->...N", acc.astype(jnp.float32), w.scale) * xs[..., None]
    return y.astype(x.dtype)


def ragged_dot_reference(x: jax.Array, w: QWeight, group_sizes: jax.Array, x_q=None) -> jax.Array:
    """The `jax.lax.ragged_dot` contract over quantised experts, in plain jnp (the kernel's reference):
    pallas_kernels.quant_reference.ragged_dot_reference on the QWeight's arrays. x [M, K] rows sorted by expert,
    w: QWeight of [E, K, N], group_sizes [E] -> [M, N] in x's dtype; x_q as there (int8 activations only)."""
    return quant_reference.ragged_dot_reference(x, w.q, w.scale, group_sizes, w.bits, w.act, x_q)


def ragged_dot(x: jax.Array, w, group_sizes: jax.Array, x_q=None, opts: Options = DEFAULT) -> jax.Array:
    """Grouped matmul over experts: plain weights -> `jax.lax.ragged_dot`; int4 QWeights -> the Pallas Mosaic GPU
    kernel where opts.mode("moe") says so, else the jnp reference; int8 QWeights -> the reference; fp8 weights ->
    hcfjax.fp8.ragged_dot. x_q: quantize_int8(x), when the caller made it (int8 activations use it)."""
    if isinstance(w, fp8.Fp8Weight):
        return fp8.ragged_dot(x, w, group_sizes, opts)
    if not isinstance(w, QWeight):
        return lax.ragged_dot(x, w, group_sizes)
    mode = _int4_mode(opts, x, w)
    if mode != "reference":
        from pallas_kernels.moe_int4 import int4_ragged_dot

        xq = x_q if w.act == "int8" else None
        interpret = mode == "interpret"
        return int4_ragged_dot(x, w.q, w.scale, group_sizes, w.act, interpret, x_q=xq, digits=opts.int4_digits)
    return ragged_dot_reference(x, w, group_sizes, x_q)


def _int4_mode(opts: Options, x, w) -> str:
    """opts.mode("moe") for an int4 QWeight (the kernel applies where moe_int4.supports the shapes); the reference
    for every other weight."""
    if not (isinstance(w, QWeight) and w.bits == 4):
        return "reference"
    from pallas_kernels.moe_int4 import supports

    return opts.mode("moe", supports(x, w.q, w.scale))


def int8_activations(w) -> bool:
    """Whether a weight takes int8 activations (w4a8, w8a8): callers may then quantise the rows before gathering
    them (`ragged_dot`'s x_q), since per-row quantisation commutes with a row gather."""
    return isinstance(w, QWeight) and w.act == "int8"


def gated_ragged_dot(x: jax.Array, gate, up, group_sizes: jax.Array, x_q=None, quant_out: bool = False, opts=DEFAULT):
    """silu(ragged_dot(x, gate)) * ragged_dot(x, up) (an expert's gate/up projection), in x's dtype. Where the int4
    kernel runs (opts.mode("moe")), int4 QWeights of one kind run one fused Pallas kernel for the activation modes
    in opts.fused_gate_up, and for w4a16 where its int8 digits pay (moe_int4_tiling.digits_pay: the fused w4a8 kernel),
    else two kernel calls; everything else two ragged_dots. x_q as in `ragged_dot`. quant_out: the product as
    quantize_int8_groups gives it (int8, [F/128, M'] scales), written by the fused w4a8 kernel itself where that
    pays (moe_int4_tiling.quant_out_pays: decode, up to ~32 rows per expert), else quantised after it: a down
    projection's x_q."""
    if isinstance(gate, fp8.Fp8Weight) and isinstance(up, fp8.Fp8Weight) and not quant_out:
        return fp8.gated_ragged_dot(x, gate, up, group_sizes, opts)
    same = isinstance(up, QWeight) and isinstance(gate, QWeight) and gate.bits == up.bits and gate.act == up.act
    mode = _int4_mode(opts, x, gate) if same else "reference"
    if mode != "reference" and gate.q.shape == up.q.shape and gate.group == up.group:
        from pallas_kernels.moe_int4 import int4_gated_ragged_dot
        from pallas_kernels.moe_int4_tiling import digits_pay, quant_out_pays

        shape = (x.shape[0], gate.n, gate.group, gate.k // gate.group, group_sizes.shape[0])
        digits = gate.act == "bf16" and opts.int4_digits and digits_pay(*shape)
        if gate.act in opts.fused_gate_up or digits:
            xq = x_q if gate.act == "int8" else None
            call = (gate.act, x.shape[0], gate.n, gate.k // gate.group, group_sizes.shape[0])
            in_kernel = quant_out and gate.act == "int8" and gate.n % ACT_GROUP == 0 and quant_out_pays(*call)
            out = int4_gated_ragged_dot(
                x,
                (gate.q, gate.scale),
                (up.q, up.scale),
                group_sizes,
                act=gate.act,
                interpret=mode == "interpret",
                x_q=xq,
                quant_out=in_kernel,
                digits=opts.int4_digits,
            )
            return out if in_kernel or not quant_out else quantize_int8_groups(out)
    h = jax.nn.silu(ragged_dot(x, gate, group_sizes, x_q, opts)) * ragged_dot(x, up, group_sizes, x_q, opts)
    return quantize_int8_groups(h) if quant_out else h


def linear(x: jax.Array, w, opts: Options = DEFAULT, x_q=None) -> jax.Array:
    """x [..., K] @ W [K, N] for any weight of a dense layer: fp8 weights on the fp8 kernel where opts.mode("moe")
    takes it (`hcfjax.fp8.matmul`), int8 per-channel weights on the dense int8 kernel where it takes them
    (`int8_kernel_mode`), QWeights and arrays otherwise by their matmul. x_q: `quantize_tokens(x)` where the caller
    has it already (the dense int8 kernel takes it instead of quantising x)."""
    if isinstance(w, fp8.Fp8Weight):
        return fp8.matmul(x, w, opts)
    mode = int8_kernel_mode(x, w, opts)
    if mode != "reference":
        return _int8_kernel(x, (w,), mode, x_q)
    return x @ w


def linear_partials(x: jax.Array, w, opts: Options = DEFAULT, x_q=None) -> jax.Array | None:
    """x [..., K] @ W as the dense int8 kernel's split-K partial products, f32 [S, M', N] over x's M rows flattened
    (M' >= M: the rows past M are the kernel's padding), where `linear` runs the product on that kernel and its
    tiling splits K (a decode step's kv_a); else None. Their sum in split order, rounded to x's dtype, is
    `linear`'s result; a consumer that adds them itself (pallas_kernels.latent_write) saves the pass that sums them."""
    from pallas_kernels.moe_fp8 import int8_matmul, int8_tiling

    mode = int8_kernel_mode(x, w, opts)
    flat = x.reshape(-1, x.shape[-1])
    if mode == "reference" or int8_tiling(flat.shape[0], 1, w.n, w.k).splits == 1:
        return None
    xq, xs = _int8_tokens(flat, mode, x_q)
    return int8_matmul(xq, xs, w.q, w.scale, interpret=mode == "interpret", partials=True)


def gated_linear(x: jax.Array, gate, up, opts: Options = DEFAULT, x_q=None) -> jax.Array:
    """silu(x @ gate) * (x @ up), the first half of a SwiGLU MLP: fp8 and int8 per-channel weights fused in one
    kernel where it runs (x_q: `linear`'s)."""
    if isinstance(gate, fp8.Fp8Weight) and isinstance(up, fp8.Fp8Weight):
        return fp8.gated_matmul(x, gate, up, opts)
    mode = int8_kernel_mode(x, gate, opts) if isinstance(up, QWeight) and up.q.shape == gate.q.shape else "reference"
    if mode != "reference":
        return _int8_kernel(x, (gate, up), mode, x_q)
    return jax.nn.silu(x @ gate) * (x @ up)


def int8_kernel_mode(x: jax.Array, w, opts: Options = DEFAULT) -> str:
    """opts.mode("moe") for a dense layer's int8 per-channel weight with int8 activations (w4a8c8's and w8a8's
    linears; pallas_kernels.moe_fp8.int8_matmul) where the kernel suits the call: bf16 tokens (it writes bf16),
    whole 128-channel K blocks, N in 64-row tiles, and up to INT8_MAX_ROWS rows (decode steps; a prefill chunk's
    products stay on XLA's int8 GEMMs).
    Unlike the experts, a forced kernel mode does not force it elsewhere: the same computation runs on XLA there,
    so a model whose small linears the kernel cannot take still runs its experts on the kernel."""
    from pallas_kernels.moe_fp8 import INT8_MAX_ROWS, supports

    if not (isinstance(w, QWeight) and w.bits == 8 and w.act == "int8" and w.q.ndim == 2):
        return "reference"
    if x.dtype != jnp.bfloat16 or not (supports(w.k, w.n) and 0 < math.prod(x.shape[:-1]) <= INT8_MAX_ROWS):
        return "reference"
    return opts.mode("moe")


def token_quant_mode(x: jax.Array, opts: Options = DEFAULT) -> str:
    """Where `quantize_tokens` quantises x [..., K]: on its kernel where the int8 kernels run (opts.mode("moe")) and
    the rows are a decode step's, bf16; else 'reference' (XLA)."""
    from pallas_kernels.int8_rows import MAX_ROWS

    return opts.mode("moe", x.dtype == jnp.bfloat16 and 0 < math.prod(x.shape[:-1]) <= MAX_ROWS)


def quantize_tokens(x: jax.Array, mode: str) -> tuple[jax.Array, jax.Array]:
    """`quantize_int8(x)` for x [..., K], in one kernel (pallas_kernels.int8_rows; mode 'kernel' or 'interpret') where
    XLA runs three. A decode layer's callers (the experts' rows, the dense int8 kernel's) quantise the same tokens
    alike, so XLA keeps one kernel of those that coincide."""
    if mode == "reference":
        return quantize_int8(x)
    from pallas_kernels.int8_rows import quantize_rows

    q, s = quantize_rows(x.reshape(-1, x.shape[-1]), interpret=mode == "interpret")
    return q.reshape(x.shape), s.reshape(x.shape[:-1])


def _int8_kernel(x: jax.Array, weights: tuple, mode: str, x_q=None) -> jax.Array:
    """x [..., K] through the dense int8 kernel: one weight, or gate and up with the SiLU product -> [..., N]. x_q:
    x quantised (`quantize_tokens(x)`), or None to quantise it here."""
    from pallas_kernels.moe_fp8 import int8_gated_matmul, int8_matmul

    flat = x.reshape(-1, x.shape[-1])
    xq, xs = _int8_tokens(flat, mode, x_q)
    interpret = mode == "interpret"
    if len(weights) == 1:
        y = int8_matmul(xq, xs, weights[0].q, weights[0].scale, interpret=interpret)
    else:
        y = int8_gated_matmul(xq, xs, *[(w.q, w.scale) for w in weights], interpret=interpret)
    return y.reshape(*x.shape[:-1], weights[0].n).astype(x.dtype)


def _int8_tokens(flat: jax.Array, mode: str, x_q=None) -> tuple[jax.Array, jax.Array]:
    """The dense int8 kernel's tokens: rows flat [M, K] quantised (int8 [M, K], scales [M]), or x_q as given."""
    return quantize_tokens(flat, mode) if x_q is None else (x_q[0].reshape(flat.shape), x_q[1].reshape(-1))


def nbytes(w) -> int:
    """Bytes a weight occupies (quantised values plus scales)."""
    if isinstance(w, QWeight):
        return w.q.nbytes + w.scale.nbytes
    if isinstance(w, fp8.Fp8Weight):
        return fp8.nbytes(w)
    return math.prod(w.shape) * jnp.dtype(w.dtype).itemsize
