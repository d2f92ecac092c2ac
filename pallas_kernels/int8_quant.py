"""Symmetric int8 quantisation in plain jnp: per token (the int8 KV cache, w4a8 / w8a8 activations, the MLA kernel's
int8 queries) and per (row, 128 channels) (the int4 MoE kernel's grouped activations). The kernels and their
references share these; hcfjax re-exports them (hcfjax.cache, hcfjax.quant)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

ACT_GROUP = 128  # channels per activation scale where activations are quantised per group (DeepSeek-V3's 1 x 128)
INV_127 = float(np.float32(1.0) / np.float32(127.0))  # f32(1/127): the scale's factor


def quantize_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric per-token int8: x [..., K] -> (q [..., K] int8, scale [...] f32). Spelled as XLA computes it (it
    rewrites a division by a constant or a broadcast into a product by the reciprocal), so that kernels can give the
    same bits: the scale is max |x| times f32(1/127), the integers x times the scale's reciprocal, rounded."""
    xf = x.astype(jnp.float32)
    scale = jnp.maximum(jnp.max(jnp.abs(xf), axis=-1), 1e-8) * INV_127
    q = jnp.clip(jnp.round(xf * (1.0 / scale)[..., None]), -127, 127).astype(jnp.int8)
    return q, scale


def grouped(x: jax.Array, g: int) -> jax.Array:
    """[..., K] -> [..., K/g, g]."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // g, g)


def quantize_int8_groups(x: jax.Array, group: int = ACT_GROUP) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 per (row, `group` channels): x [M, K] -> (q [M, K] int8, scales [K/group, M] f32). The scales
    are group-major, as the int4 kernel reads them (a block of rows for each K group of a pipeline step); each group
    is quantised as `quantize_int8` quantises a row."""
    q, s = quantize_int8(grouped(x, group))  # [M, K/G, G], [M, K/G]
    return q.reshape(x.shape), s.T


def dequantize_int8_groups(q: jax.Array, scales: jax.Array) -> jax.Array:
    """quantize_int8_groups' inverse: q [M, K] int8, scales [K/G, M' >= M] (columns past M are padding) -> [M, K]
    f32."""
    m, k = q.shape
    g = k // scales.shape[0]
    return (grouped(q.astype(jnp.float32), g) * scales[:, :m].T[..., None]).reshape(m, k)
