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
import os

import jax
import jax.numpy as jnp
from jax import lax

from hcfjax.cache import quantize_int8

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


def pack_int4(q: jax.Array, group: int) -> jax.Array:
    """int8 values in [-8, 7] [..., K] -> uint8 [..., K/2]: per group, the first half in the low nibbles."""
    u = _grouped(q.astype(jnp.uint8) & 0xF, group)  # [..., K/G, G]
    h = group // 2
    return (u[..., :h] | (u[..., h:] << 4)).reshape(*q.shape[:-1], q.shape[-1] // 2)


def unpack_int4(p: jax.Array, group: int) -> jax.Array:
    """uint8 [..., K/2] -> int8 [..., K] (sign-extended nibbles), the inverse of pack_int4."""
    s = _grouped(p.astype(jnp.int8), group // 2)  # [..., K/G, G/2]
    lo = jnp.right_shift(jnp.left_shift(s, 4), 4)  # arithmetic shifts sign-extend
    hi = jnp.right_shift(s, 4)
    return jnp.concatenate([lo, hi], axis=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


def int_values(w: QWeight) -> jax.Array:
    """The integer weights, int8 [..., N, K]."""
    return unpack_int4(w.q, w.group) if w.bits == 4 else w.q


@functools.partial(jax.jit, static_argnames="dtype")
def dequantize(w: QWeight, dtype=jnp.float32) -> jax.Array:
    """QWeight -> W [..., K, N] in dtype."""
    q = int_values(w).astype(jnp.float32)
    g = w.group
    wf = (q.reshape(*q.shape[:-1], -1, g) * jnp.swapaxes(w.scale, -1, -2)[..., None]).reshape(q.shape)
    return jnp.swapaxes(wf, -1, -2).astype(dtype)


def _grouped(x: jax.Array, g: int) -> jax.Array:
    return x.reshape(*x.shape[:-1], x.shape[-1] // g, g)  # [..., K] -> [..., K/G, G]


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


ACT_GROUP = 128  # channels per activation scale where activations are quantised per group (DeepSeek-V3's 1 x 128)


def quantize_int8_groups(x: jax.Array, group: int = ACT_GROUP) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 per (row, `group` channels): x [M, K] -> (q [M, K] int8, scales [K/group, M] f32). The scales
    are group-major, as the int4 kernel reads them (a block of rows for each K group of a pipeline step); each group
    is quantised as `quantize_int8` quantises a row."""
    q, s = quantize_int8(_grouped(x, group))  # [M, K/G, G], [M, K/G]
    return q.reshape(x.shape), s.T


def dequantize_int8_groups(q: jax.Array, scales: jax.Array) -> jax.Array:
    """quantize_int8_groups' inverse: q [M, K] int8, scales [K/G, M' >= M] (columns past M are padding) -> [M, K]
    f32."""
    m, k = q.shape
    g = k // scales.shape[0]
    return (_grouped(q.astype(jnp.float32), g) * scales[:, :m].T[..., None]).reshape(m, k)


def ragged_dot_reference(x: jax.Array, w: QWeight, group_sizes: jax.Array, x_q=None) -> jax.Array:
    """The `jax.lax.ragged_dot` contract over quantised experts, in plain jnp (the kernel's reference).

    x [M, K] rows sorted by expert, w: QWeight of [E, K, N], group_sizes [E] (sum <= M; rows past the sum give 0)
    -> [M, N] in x's dtype. w4a16/w8a16: dequantise, then a bf16 ragged_dot with f32 accumulation. int8
    activations: per-token int8 x, int8 x int8 -> int32 per K group, then weight group scales and token scales;
    x_q = quantize_int8(x) when the caller has it already (ignored for bf16 activations), or quantize_int8_groups(x)
    (scales per row and K group, [K/G, M'] with M' >= M) where the producer quantised x in groups.
    """
    if w.act == "bf16":
        return lax.ragged_dot(x, dequantize(w, x.dtype), group_sizes, preferred_element_type=jnp.float32).astype(
            x.dtype
        )
    return _int8_act_ragged_dot(x, w, group_sizes, x_q)


def _int8_act_ragged_dot(x: jax.Array, w: QWeight, group_sizes: jax.Array, x_q=None) -> jax.Array:
    """w4a8 / w8a8 experts: y[m] = xs[m] * sum_g s[e(m), :, g] * (xq[m, g] . q[e(m), :, g]) with the per-group dot
    products exact integers.

    One plain `lax.ragged_dot` ([M, c] x [E, c, N], no batch dimensions) per K chunk c, in a loop over the K groups:
    XLA's GPU ragged-dot rewriter handles batch dimensions only when group_sizes carries them too ([b, E], batch
    dimensions leading); a [K/G] batch with [E] group sizes passed the CPU (jax lowers ragged_dot there through its
    own jnp expansion) and failed XLA GPU's HLO verifier. The integer operands go in as bf16 (exact up to 256) with
    f32 accumulation, the path the bf16 ragged_dot takes on the GPU; a chunk's sum stays below 2^24 (c x 127 x qmax),
    so it is exact, and chunks add up in int32. Memory: [M, N] per step (no [K/G, M, N] partials, no [M, N, K/G]
    scale gather)."""
    g, e, m = w.group, w.q.shape[0], x.shape[0]
    qmax = 7 if w.bits == 4 else 127
    c = max(d for d in range(1, min(g, (2**24 - 1) // (127 * qmax)) + 1) if g % d == 0)  # exact f32 chunk sums
    xq, xs = quantize_int8(x) if x_q is None else x_q  # [M, K] int8, [M] f32 or per group [K/G, M'] f32
    grouped = xs.ndim == 2
    if grouped and xs.shape[0] != w.k // g:
        raise ValueError(f"group scales {xs.shape} do not match {w.k // g} K groups of {g}")
    # Each row's expert, to pick its weight scales; rows past the groups map to a clamped expert (their dots are 0).
    # compare_all: jnp.searchsorted's default is a while loop, a host round trip per step on XLA GPU.
    ends = jnp.cumsum(group_sizes)
    rows = jnp.minimum(jnp.searchsorted(ends, jnp.arange(m), side="right", method="compare_all"), e - 1)
    packed = g // 2 if w.bits == 4 else g  # stored bytes of one K group

    def group(i, y):  # y [M, N] f32
        qi = lax.dynamic_slice_in_dim(w.q, i * packed, packed, axis=-1)
        wi = jnp.swapaxes(unpack_int4(qi, g) if w.bits == 4 else qi, -1, -2).astype(jnp.bfloat16)  # [E, G, N]
        xi = lax.dynamic_slice_in_dim(xq, i * g, g, axis=-1).astype(jnp.bfloat16)  # [M, G]
        acc = sum(
            lax.ragged_dot(xi[:, j : j + c], wi[:, j : j + c], group_sizes, preferred_element_type=jnp.float32).astype(
                jnp.int32
            )
            for j in range(0, g, c)
        )  # [M, N] the exact int32 dot products of group i
        s = lax.dynamic_index_in_dim(w.scale, i, axis=-2, keepdims=False)[rows]  # [M, N]
        if grouped:
            s = s * lax.dynamic_index_in_dim(xs, i, keepdims=False)[:m, None]
        return y + acc.astype(jnp.float32) * s

    y = lax.fori_loop(0, w.k // g, group, jnp.zeros((m, w.n), jnp.float32))
    return (y if grouped else y * xs[:, None]).astype(x.dtype)


def ragged_dot(x: jax.Array, w, group_sizes: jax.Array, x_q=None) -> jax.Array:
    """Grouped matmul over experts, the one place that picks how: plain weights -> `jax.lax.ragged_dot`; int4
    QWeights -> the Pallas Mosaic GPU kernel on a GPU (shapes it supports), the jnp reference elsewhere; int8
    QWeights -> the reference. x_q: quantize_int8(x), when the caller made it (int8 activations use it)."""
    if not isinstance(w, QWeight):
        return lax.ragged_dot(x, w, group_sizes)
    if w.bits == 4 and use_kernel():
        from pallas_kernels.moe_int4 import int4_ragged_dot, supports

        if supports(x, w.q, w.scale):
            return int4_ragged_dot(x, w.q, w.scale, group_sizes, act=w.act, x_q=x_q if w.act == "int8" else None)
    return ragged_dot_reference(x, w, group_sizes, x_q)


def int8_activations(w) -> bool:
    """Whether a weight takes int8 activations (w4a8, w8a8): callers may then quantise the rows before gathering
    them (`ragged_dot`'s x_q), since per-row quantisation commutes with a row gather."""
    return isinstance(w, QWeight) and w.act == "int8"


# Whether gate/up + SiLU runs as one fused kernel, per activation mode. H200, decode tiles with two K groups per step
# (docs/kernels.md, 2026-11-30, device time): w4a8 fused beats two kernel calls + SiLU (87-95 vs
# 96-100 us at E=16 M=128, 149-161 vs 165 at E=32, 170 vs 181 back to back at E=16 M=1024) and ties in prefill; w4a16
# fused now loses in decode (121-127 vs 116-117 us at E=16; its registers allow only two pipeline stages) and ties or
# loses in prefill (2112 vs 2008 us at E=32 M=16384). w4a16 where its int8 digits pay runs the fused w4a8 kernel
# instead (149.9 vs about 205 us for two w4a16 kernels at E=32 M=128, 2026-12-01).
FUSED_GATE_UP = {"bf16": False, "int8": True}


def gated_ragged_dot(x: jax.Array, gate, up, group_sizes: jax.Array, x_q=None, quant_out: bool = False):
    """silu(ragged_dot(x, gate)) * ragged_dot(x, up) (an expert's gate/up projection), in x's dtype: on a GPU (shapes
    the kernel supports; HCFJAX_INT4_KERNEL=0 turns it off) int4 QWeights of one kind run one fused Pallas kernel
    where FUSED_GATE_UP says it is faster, or for w4a16 where its int8 digits do (moe_int4.digits_pay: the fused
    w4a8 kernel), else two kernel calls; everything else two ragged_dots. x_q as in
    `ragged_dot`. quant_out: the product as quantize_int8_groups gives it (int8, [F/128, M'] scales), written by the
    fused w4a8 kernel itself where that pays (moe_int4.quant_out_pays: decode, up to ~32 rows per expert), else
    quantised after it: a down projection's x_q."""
    if isinstance(gate, QWeight) and isinstance(up, QWeight) and gate.bits == up.bits == 4 and gate.act == up.act:
        if use_kernel():
            from pallas_kernels.moe_int4 import digits_pay, int4_gated_ragged_dot, quant_out_pays, supports

            shape = (x.shape[0], gate.n, gate.group, gate.k // gate.group, group_sizes.shape[0])
            fused = FUSED_GATE_UP[gate.act] or gate.act == "bf16" and digits_pay(*shape)
            if fused and supports(x, gate.q, gate.scale) and gate.q.shape == up.q.shape and gate.group == up.group:
                xq = x_q if gate.act == "int8" else None
                call = (gate.act, x.shape[0], gate.n, gate.k // gate.group, group_sizes.shape[0])
                in_kernel = quant_out and gate.act == "int8" and gate.n % ACT_GROUP == 0 and quant_out_pays(*call)
                out = int4_gated_ragged_dot(
                    x, (gate.q, gate.scale), (up.q, up.scale), group_sizes, act=gate.act, x_q=xq, quant_out=in_kernel
                )
                return out if in_kernel or not quant_out else quantize_int8_groups(out)
    h = jax.nn.silu(ragged_dot(x, gate, group_sizes, x_q)) * ragged_dot(x, up, group_sizes, x_q)
    return quantize_int8_groups(h) if quant_out else h


def use_kernel() -> bool:
    """True on a GPU backend unless HCFJAX_INT4_KERNEL=0. On the H200 (2026-11-29) the kernels passed their checks at
    every benchmarked shape, and a quantised model's teacher-forced logits with them are as close to a float32 truth
    as the jnp reference path's, in both modes (docs/results.md, e2e_check.py --kernel int4)."""
    return jax.default_backend() == "gpu" and os.environ.get("HCFJAX_INT4_KERNEL", "1") != "0"


def nbytes(w) -> int:
    """Bytes a weight occupies (quantised values plus scales)."""
    if isinstance(w, QWeight):
        return w.q.nbytes + w.scale.nbytes
    return math.prod(w.shape) * jnp.dtype(w.dtype).itemsize
