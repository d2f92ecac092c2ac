"""The KV cache's share of a device's memory: the page pool sized to what the device's allocator has left after the
weights, and a check, once the steps are compiled, that their temporaries fit beside it.

A device that reports no allocator limit (the CPU) leaves the pool as configured. On a GPU, jax's allocator holds
a fraction of the card (XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 by default); the limit it reports is what the weights,
the cache and the steps' temporaries share. Sizing the pool by the temporaries measured after compiling would
need a second compile (the steps are compiled for the pool's shape), so the pool leaves STEP_RESERVE of the limit
to them, and `check_steps_fit` says before serving when that was not enough, instead of the first step failing.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from hcfjax.cache import entry_bytes

GiB = 2**30
STEP_RESERVE = 0.1  # the allocator's limit kept free for the steps' temporaries when the pool is sized


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    """What a device's allocator reports, in bytes: its limit, the bytes in use, and its largest free block where
    it has reserved its whole limit up front (jax's default on a GPU; None otherwise, where it can still grow)."""

    device: str
    limit: int
    in_use: int
    largest_free: int | None = None


def device_memory(device) -> DeviceMemory | None:
    """The allocator's limit and use on `device`, or None where the backend reports neither (the CPU)."""
    stats = device.memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    limit, block = int(stats["bytes_limit"]), stats.get("largest_free_block_bytes")
    reserved = stats.get("pool_bytes", 0) >= limit
    return DeviceMemory(str(device), limit, int(stats["bytes_in_use"]), int(block) if reserved and block else None)


def size(nbytes: float) -> str:
    """Bytes as people read them: GiB from one GiB up, else MiB."""
    return f"{nbytes / GiB:.1f} GiB" if nbytes >= GiB else f"{nbytes / 2**20:.0f} MiB"


def tree_bytes(tree) -> int:
    """Bytes of a pytree of arrays or jax.ShapeDtypeStructs."""
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def page_bytes(kv_dim: int, layers: int, page_size: int, dtype) -> int:
    """Bytes of one page of the cache over all its layers (`cache.entry_bytes` a token and layer)."""
    return layers * page_size * entry_bytes(kv_dim, dtype)


def past_write_window(pages: int, cfg, layers: int, page_size: int, ranks: int, dtype, opts) -> int:
    """A derived int8 pool's pages per rank moved past 4 GiB where its cache array would be 2-4 GiB and a decode
    step would otherwise write its latents on the cache-write kernel (`attention.latent_write_mode`): in that
    window the kernel's offsets would wrap (pallas_kernels.latent_write.addressable), and XLA writes each layer's
    new latents in six kernels instead of one. The array holds `layers` (MTP layers included) and the pages of the
    `ranks` that share it; dtype: the model's activations. `fit_pages` then trims the pool to what the device's
    memory holds beside the steps' reserve, as any derived pool, which may leave it in the window (and XLA
    writing). Unchanged outside the window or where the kernel would not write."""
    from hcfjax import cache as kvcache
    from hcfjax.attention import latent_write_mode
    from pallas_kernels.latent_write import WRAPPING, addressable

    entry = layers * page_size * cfg.kv_dim * ranks  # int8 bytes a rank's page adds to the array
    if addressable(pages * entry):
        return pages
    grown = WRAPPING[1] // entry + 1
    rows = grown * ranks
    cache = kvcache.KVCache(
        jax.ShapeDtypeStruct((layers, rows, page_size, cfg.kv_dim), jnp.int8),
        jax.ShapeDtypeStruct((layers, rows, 2, page_size), jnp.float32),
    )
    step = jax.ShapeDtypeStruct((1, 1, cfg.hidden_size), dtype)  # a decode step's smallest
    return grown if latent_write_mode(cfg, cache, step, opts) != "reference" else pages


def fit_pages(
    wanted: int,
    explicit: bool,
    per_page: int,
    memory: DeviceMemory | None,
    loading: int,
    min_pages: int,
    flag: str = "--num-pages",
) -> int:
    """The pages a rank's pool gets: `wanted` where it fits in the allocator's limit beside what is in use, or the
    weights still loading (`loading` bytes; what is in use may be part of them) where they are more, and
    STEP_RESERVE of the limit. Where it does not: fewer pages for a derived size, down to `min_pages` (one request
    at the longest length); ValueError for a size the user asked for (`explicit`, with the command's `flag`) or when
    not even `min_pages` fit."""
    if memory is None:
        return wanted
    free = memory.limit - max(memory.in_use, loading) - int(STEP_RESERVE * memory.limit)
    # the pool is one array: it needs one free block (where what is in use has split the free memory)
    block = free if memory.largest_free is None else min(free, memory.largest_free)
    fits = max(block, 0) // per_page
    if wanted <= fits:
        return wanted
    need = f"{wanted} pages of KV cache ({size(wanted * per_page)})"
    room = (
        f"{memory.device} has {size(max(free, 0))} for it after the weights and {STEP_RESERVE:.0%} of its"
        f" {size(memory.limit)} kept for the steps"
        + (f", its largest free block {size(block)}" if block < free else "")
        + f" (room for {fits} pages)"
    )
    if explicit:
        raise ValueError(f"{need} do not fit: {room}; pass a smaller {flag}")
    if fits < min_pages:
        raise ValueError(
            f"not even one request at the longest length fits: {min_pages} pages of KV cache"
            f" ({size(min_pages * per_page)}), and {room}; lower --max-model-len, use --kv-cache int8, or"
            " give jax more of the card (XLA_PYTHON_CLIENT_MEM_FRACTION)"
        )
    return fits


def check_steps_fit(temps: list[int], memory: DeviceMemory | None, loading: int, pages: int, per_page: int) -> None:
    """ValueError when the largest step's temporaries (bytes, from the compiled steps' memory analysis) do not fit
    in what the allocator has left beside the cache and the weights (`loading`: bytes still loading, of which what
    is in use may hold part): the first step that needs them would fail after the server said it was ready."""
    if memory is None or not temps:
        return
    left = memory.limit - max(memory.in_use, loading + pages * per_page)
    if max(temps) <= left:
        return
    raise ValueError(
        f"the steps need {size(max(temps))} of temporaries, but {memory.device} has {size(max(left, 0))} left after"
        f" the weights and the KV cache ({pages} pages, {size(pages * per_page)}): pass a smaller --num-pages or"
        " --token-budget"
    )


@contextlib.contextmanager
def allocating(what: str, hint: str = "--num-pages or --max-model-len"):
    """Around making a pool and waiting for it (`jax.block_until_ready`, in the block): ValueError naming `what` and
    the flags that shrink it (`hint`) when the device cannot hold it. An allocation can fail as the arrays are made
    or, asynchronously, later: the arrays then come back as placeholders whose error would surface only at the
    first step that reads them, after a server said it was ready."""
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise ValueError(f"{what} does not fit in the device's memory ({e}); pass a smaller {hint}") from e
