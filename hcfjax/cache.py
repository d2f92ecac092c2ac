"""The paged latent KV cache.

Per token and layer the cache holds only MLA's latent c_kv (kv_lora_rank = C) followed by the roped key k_pe
(qk_rope_head_dim = R), in fixed-size pages:

    kv     [L, P, page_size, C + R]   bf16/f32, or int8
    scale  [L, P, 2, page_size]       f32 per-token scales of (c_kv, k_pe), int8 caches only (token-minor, as
                                      the MLA decode kernel's 64-token boxes read them where they lie)

A sequence owns a list of pages (its row of a page table [B, max_pages]); token at position t lives in page
page_table[b, t // page_size], slot t % page_size, in every layer. Prefill and decode write it, attention and the
MLA kernel read it, KV transfer moves whole pages. Positions a sequence has not reached are never read (attention
masks them), so rolling back is just a shorter length.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hcfjax.config import ModelConfig
from pallas_kernels.int8_quant import quantize_int8  # re-exported


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    kv: jax.Array  # [L, P, page_size, C + R]
    scale: jax.Array | None = None  # [L, P, 2, page_size] when kv is int8 (scale_shape)

    @property
    def page_size(self) -> int:
        return self.kv.shape[2]

    @property
    def num_pages(self) -> int:
        return self.kv.shape[1]

    @property
    def quantized(self) -> bool:
        return self.kv.dtype == jnp.int8


def scale_shape(kv_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The scales' shape beside an int8 cache (or a piece of one) of kv_shape [L, P, page_size, C + R]: [L, P, 2,
    page_size]."""
    layers, pages, page_size, _ = kv_shape
    return (layers, pages, 2, page_size)


def entry_bytes(kv_dim: int, dtype) -> int:
    """Bytes of one token's entry in one layer: kv_dim values of `dtype`, and an int8 cache's two f32 scales."""
    int8 = jnp.dtype(dtype) == jnp.int8
    return kv_dim * jnp.dtype(dtype).itemsize + (8 if int8 else 0)


def init_cache(
    cfg: ModelConfig, num_pages: int, page_size: int, dtype=jnp.bfloat16, num_layers: int | None = None
) -> KVCache:
    """An empty cache; `num_layers` defaults to the main model's (MTP layers add theirs on top)."""
    layers = cfg.num_hidden_layers if num_layers is None else num_layers
    shape = (layers, num_pages, page_size, cfg.kv_dim)
    if jnp.dtype(dtype) == jnp.int8:
        return KVCache(jnp.zeros(shape, jnp.int8), jnp.zeros(scale_shape(shape), jnp.float32))
    return KVCache(jnp.zeros(shape, dtype))


def write(
    cache: KVCache, layer, ckv: jax.Array, kpe: jax.Array, positions: jax.Array, valid: jax.Array, page_table: jax.Array
) -> KVCache:
    """Stores c_kv [B, T, C] and k_pe [B, T, R] of tokens at positions [B, T] (only where valid [B, T])."""
    ps = cache.page_size
    rows = jnp.arange(positions.shape[0])[:, None]
    page = page_table[rows, jnp.clip(positions // ps, 0, page_table.shape[1] - 1)]
    # Invalid tokens (padding, mock rows) and positions past the page table get an out-of-range page, which the
    # scatter drops.
    page = jnp.where(valid & (positions // ps < page_table.shape[1]), page, cache.num_pages)
    slot = positions % ps
    # The entries are computed before the scatter, not inside it: XLA's GPU backend fuses a scatter's producers into
    # it, and the scatter then recomputes the norm, rope and quantisation (row reductions) for every byte it writes.
    if not cache.quantized:
        entry = jax.lax.optimization_barrier(jnp.concatenate([ckv, kpe], axis=-1).astype(cache.kv.dtype))
        return KVCache(cache.kv.at[layer, page, slot].set(entry, mode="drop"))
    entry, scales = jax.lax.optimization_barrier(quantize_entry(ckv, kpe))
    kv = cache.kv.at[layer, page, slot].set(entry, mode="drop")
    scale = cache.scale.at[layer, page, :, slot].set(scales, mode="drop")  # ([B, T, 2]: the indexed axes lead)
    return KVCache(kv, scale)


def quantize_entry(ckv: jax.Array, kpe: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The int8 cache entry of c_kv [..., C] and k_pe [..., R] (R <= C): (int8 [..., C + R], scales [..., 2] f32),
    each part `quantize_int8`'s. Both parts' scales come from one reduction over [..., 2, C], k_pe padded with zeros
    (which leave its max |value| as it is): XLA's GPU backend then makes the scales and the entry in one fusion,
    where two reductions stacked took two slower ones (docs/results.md, "Generation")."""
    c, r = ckv.shape[-1], kpe.shape[-1]
    rope = jnp.pad(kpe.astype(jnp.float32), [(0, 0)] * (kpe.ndim - 1) + [(0, c - r)])
    both = jnp.stack([ckv.astype(jnp.float32), rope], axis=-2)  # [..., 2, C]
    scales = jnp.maximum(jnp.max(jnp.abs(both), axis=-1), 1e-8) / 127.0
    q = jnp.clip(jnp.round(both / scales[..., None]), -127, 127).astype(jnp.int8)
    return jnp.concatenate([q[..., 0, :], q[..., 1, :r]], axis=-1), scales


def as_stored(cache: KVCache, ckv: jax.Array, kpe: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """(c_kv, k_pe) as `read` would return them after `write` stored them: rounded to the cache's dtype (int8 with
    per-token scales), in `dtype`."""
    if not cache.quantized:
        return ckv.astype(cache.kv.dtype).astype(dtype), kpe.astype(cache.kv.dtype).astype(dtype)
    (qc, sc), (qr, sr) = quantize_int8(ckv), quantize_int8(kpe)
    return (qc * sc[..., None]).astype(dtype), (qr * sr[..., None]).astype(dtype)


def read(cache: KVCache, layer, page_table: jax.Array, c: int, dtype) -> tuple[jax.Array, jax.Array]:
    """Gathers every page of the page table: (c_kv [B, S, C], k_pe [B, S, R]) in `dtype`, S = pages * page_size."""
    b, n = page_table.shape
    entry = cache.kv[layer, page_table]  # [B, n, page, C + R]
    entry = entry.reshape(b, n * cache.page_size, -1)
    if not cache.quantized:
        return entry[..., :c].astype(dtype), entry[..., c:].astype(dtype)
    scale = jnp.swapaxes(cache.scale[layer, page_table], -1, -2).reshape(b, n * cache.page_size, 2)
    ef = entry.astype(jnp.float32)
    return (ef[..., :c] * scale[..., :1]).astype(dtype), (ef[..., c:] * scale[..., 1:]).astype(dtype)
