"""A remotely prefilled request's cache on its way into a PD decode worker's engine.

The thread that lands it (hcfjax.pd.decode's) stages it (`Landing.stage`): checks it against the engine's cache,
pads its pages to their power of two and puts it on the engine's devices, so the engine's loop only runs the
install, one compiled program per power of two. A host array (the socket and inprocess transports) is padded on the
host: no device program depends on the exact page count. A device array (the jax transport) is padded on its
device, one small program per page count, which the warm-up compiles ahead without data.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from hcfjax import cache as kvcache
from hcfjax.generate import bucket
from hcfjax.step import SlotState


@dataclasses.dataclass(frozen=True)
class LandedCache:
    """kv [L, bucket(pages), page_size, D] (and the int8 cache's scale) on the engine's devices; the first `pages`
    pages are the request's, the rest padding that the install drops."""

    kv: jax.Array
    scale: jax.Array | None
    pages: int


def install(state: SlotState, pages, kv, scale, slot, first, length, count, drafts) -> SlotState:
    """Writes a remotely prefilled request's cache (kv [L, n, page, D] into `pages` [n]; padding pages are out of
    range and dropped) and its slot's first token, length and rng counter, or with speculation its Drafts row."""
    cache = state.cache
    layers = kv.shape[0]
    new_kv = cache.kv.at[:layers, pages].set(kv.astype(cache.kv.dtype), mode="drop")
    new_scale = None if cache.scale is None else cache.scale.at[:layers, pages].set(scale, mode="drop")
    return dataclasses.replace(
        state,
        cache=kvcache.KVCache(new_kv, new_scale),
        tok=state.tok.at[slot].set(first, mode="drop"),
        length=state.length.at[slot].set(length, mode="drop"),
        count=state.count.at[slot].set(count, mode="drop"),
        drafts=None
        if drafts is None
        else jax.tree.map(lambda s, x: s.at[slot].set(x, mode="drop"), state.drafts, drafts),
    )


@functools.partial(jax.jit, static_argnames="pages")
def _pad_on_device(x: jax.Array, pages: int) -> jax.Array:
    return jnp.pad(x, ((0, 0), (0, pages - x.shape[1])) + ((0, 0),) * (x.ndim - 2))


def _pad_on_host(x: np.ndarray, pages: int) -> np.ndarray:
    if x.shape[1] == pages:
        return x
    out = np.zeros(x.shape[:1] + (pages,) + x.shape[2:], x.dtype)
    out[:, : x.shape[1]] = x
    return out


class Landing:
    """Stages transferred caches for an engine whose cache is `cache`, placed as `sharding` (its install's inputs)."""

    def __init__(self, cache: kvcache.KVCache, page_size: int, sharding):
        self.layers, self.width = cache.kv.shape[0], cache.kv.shape[-1]
        self.page_size, self.dtype, self.quantized = page_size, cache.kv.dtype, cache.scale is not None
        self.scale_dtype = None if cache.scale is None else cache.scale.dtype
        self.sharding = sharding

    def check(self, kv, scale) -> None:
        """ValueError unless kv [L, n, page_size, D] (and scale) is what this engine's cache takes."""
        shape = tuple(kv.shape)
        if len(shape) != 4 or shape[0] != self.layers or shape[2:] != (self.page_size, self.width) or shape[1] < 1:
            want = (self.layers, "pages", self.page_size, self.width)
            raise ValueError(f"transferred cache has shape {shape}, expected {want}")
        if jnp.dtype(kv.dtype) != self.dtype or (scale is None) == self.quantized:
            raise ValueError(
                f"transferred cache is {jnp.dtype(kv.dtype).name}{' with' if scale is not None else ' without'}"
                f" scales; this worker's cache is {self.dtype.name}"
            )
        if scale is not None:
            got = (jnp.dtype(scale.dtype).name, tuple(scale.shape))
            want = (self.scale_dtype.name, kvcache.scale_shape(shape))
            if got != want:
                raise ValueError(f"transferred scales are {got[0]}{got[1]}, expected {want[0]}{want[1]}")

    def stage(self, kv, scale=None) -> LandedCache:
        """(any thread) The checked cache padded to its pages' power of two, on the engine's devices."""
        self.check(kv, scale)
        n = kv.shape[1]
        b = bucket(n, 1)

        def put(x):
            if x is None:
                return None
            if isinstance(x, jax.Array):
                x = jax.device_put(x, self.sharding)
                return x if n == b else _pad_on_device(x, pages=b)
            return jax.device_put(_pad_on_host(np.asarray(x), b), self.sharding)

        return LandedCache(put(kv), put(scale), n)

    def compile_device_pads(self, max_pages: int) -> None:
        """Compiles the device padding of every page count up to max_pages that is not a power of two (a transport
        that delivers device arrays), from shapes alone."""
        for n in range(1, max_pages + 1):
            b = bucket(n, 1)
            if n == b:
                continue
            arrays = [((self.layers, n, self.page_size, self.width), self.dtype)]
            if self.quantized:
                arrays.append((kvcache.scale_shape(arrays[0][0]), self.scale_dtype))
            for shape, dtype in arrays:
                spec = jax.ShapeDtypeStruct(shape, dtype, sharding=self.sharding)
                _pad_on_device.lower(spec, pages=b).compile()
