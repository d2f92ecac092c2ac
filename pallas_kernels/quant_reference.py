"""Quantised weights on raw arrays, in plain jnp: int4 packing, dequantisation and the grouped matmul over experts
(`ragged_dot_reference`, the int4 MoE kernel's reference). hcfjax.quant wraps these for its `QWeight` pytree and
documents the layout: values q output-major [..., N, K/2] uint8 (int4, a K group's two halves in the low and high
nibbles) or [..., N, K] int8 (int8, per output channel); scales K-group-major [..., K/G, N] f32."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.int8_quant import grouped, quantize_int8


def pack_int4(q: jax.Array, group: int) -> jax.Array:
    """int8 values in [-8, 7] [..., K] -> uint8 [..., K/2]: per group, the first half in the low nibbles."""
    u = grouped(q.astype(jnp.uint8) & 0xF, group)  # [..., K/G, G]
    h = group // 2
    return (u[..., :h] | (u[..., h:] << 4)).reshape(*q.shape[:-1], q.shape[-1] // 2)


def unpack_int4(p: jax.Array, group: int) -> jax.Array:
    """uint8 [..., K/2] -> int8 [..., K] (sign-extended nibbles), the inverse of pack_int4."""
    s = grouped(p.astype(jnp.int8), group // 2)  # [..., K/G, G/2]
    lo = jnp.right_shift(jnp.left_shift(s, 4), 4)  # arithmetic shifts sign-extend
    hi = jnp.right_shift(s, 4)
    return jnp.concatenate([lo, hi], axis=-1).reshape(*p.shape[:-1], p.shape[-1] * 2)


def in_features(q: jax.Array, bits: int) -> int:
    """K of a weight stored as q."""
    return q.shape[-1] * (2 if bits == 4 else 1)


def group_of(q: jax.Array, scale: jax.Array, bits: int) -> int:
    """The K group size of a weight (q, scale)."""
    return in_features(q, bits) // scale.shape[-2]


def int_values(q: jax.Array, scale: jax.Array, bits: int) -> jax.Array:
    """The integer weights, int8 [..., N, K]."""
    return unpack_int4(q, group_of(q, scale, bits)) if bits == 4 else q


@functools.partial(jax.jit, static_argnames=("bits", "dtype"))
def dequantize(q: jax.Array, scale: jax.Array, bits: int, dtype=jnp.float32) -> jax.Array:
    """(q, scale) -> W [..., K, N] in dtype."""
    v = int_values(q, scale, bits).astype(jnp.float32)
    g = group_of(q, scale, bits)
    wf = (v.reshape(*v.shape[:-1], -1, g) * jnp.swapaxes(scale, -1, -2)[..., None]).reshape(v.shape)
    return jnp.swapaxes(wf, -1, -2).astype(dtype)


def ragged_dot_reference(
    x: jax.Array, q: jax.Array, scale: jax.Array, group_sizes: jax.Array, bits: int = 4, act: str = "bf16", x_q=None
) -> jax.Array:
    """The `jax.lax.ragged_dot` contract over quantised experts, in plain jnp (the kernel's reference).

    x [M, K] rows sorted by expert, (q, scale) the experts of W [E, K, N], group_sizes [E] (sum <= M; rows past the
    sum give 0) -> [M, N] in x's dtype. w4a16/w8a16: dequantise, then a bf16 ragged_dot with f32 accumulation. int8
    activations: per-token int8 x, int8 x int8 -> int32 per K group, then weight group scales and token scales;
    x_q = quantize_int8(x) when the caller has it already (ignored for bf16 activations; its scales [M' >= M]), or
    quantize_int8_groups(x) (scales per row and K group, [K/G, M'] with M' >= M) where the producer quantised x in
    groups.
    """
    if act == "bf16":
        w = dequantize(q, scale, bits, x.dtype)
        return lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32).astype(x.dtype)
    return _int8_act_ragged_dot(x, q, scale, bits, group_sizes, x_q)


def _int8_act_ragged_dot(x, q, scale, bits: int, group_sizes, x_q=None) -> jax.Array:
    """w4a8 / w8a8 experts: y[m] = xs[m] * sum_g s[e(m), :, g] * (xq[m, g] . q[e(m), :, g]) with the per-group dot
    products exact integers.

    One plain `lax.ragged_dot` ([M, c] x [E, c, N], no batch dimensions) per K chunk c, in a loop over the K groups:
    XLA's GPU ragged-dot rewriter handles batch dimensions only when group_sizes carries them too ([b, E], batch
    dimensions leading); a [K/G] batch with [E] group sizes passed the CPU (jax lowers ragged_dot there through its
    own jnp expansion) and failed XLA GPU's HLO verifier. The integer operands go in as bf16 (exact up to 256) with
    f32 accumulation, the path the bf16 ragged_dot takes on the GPU; a chunk's sum stays below 2^24 (c x 127 x qmax),
    so it is exact, and chunks add up in int32. Memory: [M, N] per step (no [K/G, M, N] partials, no [M, N, K/G]
    scale gather)."""
    k, n = in_features(q, bits), q.shape[-2]
    g, e, m = group_of(q, scale, bits), q.shape[0], x.shape[0]
    qmax = 7 if bits == 4 else 127
    c = max(d for d in range(1, min(g, (2**24 - 1) // (127 * qmax)) + 1) if g % d == 0)  # exact f32 chunk sums
    xq, xs = quantize_int8(x) if x_q is None else x_q  # [M, K] int8, [M' >= M] f32 or per group [K/G, M'] f32
    is_grouped = xs.ndim == 2
    if is_grouped and xs.shape[0] != k // g:
        raise ValueError(f"group scales {xs.shape} do not match {k // g} K groups of {g}")
    # Each row's expert, to pick its weight scales; rows past the groups map to a clamped expert (their dots are 0).
    # compare_all: jnp.searchsorted's default is a while loop, a host round trip per step on XLA GPU.
    ends = jnp.cumsum(group_sizes)
    rows = jnp.minimum(jnp.searchsorted(ends, jnp.arange(m), side="right", method="compare_all"), e - 1)
    packed = g // 2 if bits == 4 else g  # stored bytes of one K group

    def group(i, y):  # y [M, N] f32
        qi = lax.dynamic_slice_in_dim(q, i * packed, packed, axis=-1)
        wi = jnp.swapaxes(unpack_int4(qi, g) if bits == 4 else qi, -1, -2).astype(jnp.bfloat16)  # [E, G, N]
        xi = lax.dynamic_slice_in_dim(xq, i * g, g, axis=-1).astype(jnp.bfloat16)  # [M, G]
        acc = sum(
            lax.ragged_dot(xi[:, j : j + c], wi[:, j : j + c], group_sizes, preferred_element_type=jnp.float32).astype(
                jnp.int32
            )
            for j in range(0, g, c)
        )  # [M, N] the exact int32 dot products of group i
        s = lax.dynamic_index_in_dim(scale, i, axis=-2, keepdims=False)[rows]  # [M, N]
        if is_grouped:
            s = s * lax.dynamic_index_in_dim(xs, i, keepdims=False)[:m, None]
        return y + acc.astype(jnp.float32) * s

    # The first group starts the sum: a carry made from the inputs has their type inside shard_map (varying over
    # the EP axis), where a zeros carry would not match the loop body's output.
    y = lax.fori_loop(1, k // g, group, group(0, jnp.zeros((m, n), jnp.float32)))
    return (y if is_grouped else y * xs[:m, None]).astype(x.dtype)
