"""Stacked params filled in place on the devices that hold them, one checkpoint tensor at a time.

A param stacks the layers of a segment (and the experts of a layer) along leading dims (tensor_specs.stacked_shapes);
a sharding may split any dim, stacking dims included (experts over EP). Filling one param:
  1. its device array is allocated under its sharding (zeros);
  2. for each position p inside one device's block of the stacking dims, every local device receives the tensor at
     position p of its own block, cut along the trailing dims as the sharding splits them
     (jax.make_array_from_callback: a device gets only its slice, and a process reads only the tensors some local
     device holds); one jitted dynamic_update_slice, the param donated, writes every device's slice in place.
So host memory holds the tensors of one position (one per distinct local block: one on a single device, E/ep-way
experts on an EP rank's devices), device memory the params plus one slice per device, and one program serves every
param of a shape. Positions are visited in the order the caller gives (the files' order), across params.

A param no larger than `stage_bytes` (the caller passes its largest tensor's size) is instead assembled on the host
and placed whole: same bound on host memory, and no program to compile for the many small params (norms, routers,
small models' everything).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, Sharding


@dataclasses.dataclass(frozen=True)
class Stacked:
    """One param to fill: full shape, dtype, and the item to read at each position of its `lead` stacking dims."""

    shape: tuple[int, ...]
    dtype: np.dtype
    items: dict[tuple[int, ...], object]

    @property
    def lead(self) -> int:
        return len(next(iter(self.items)))


@dataclasses.dataclass(frozen=True)
class _Layout:
    """How a param's stacking dims fall on its sharding: `local` positions per device block, `blocks` per dim.
    sharding None: the default device, with arrays left uncommitted (as jnp.asarray leaves them)."""

    sharding: Sharding | None
    shape: tuple[int, ...]
    lead: int
    local: tuple[int, ...]
    blocks: tuple[int, ...]
    local_blocks: tuple[tuple[int, ...], ...]  # the blocks this process's devices hold

    @classmethod
    def of(cls, sharding: Sharding | None, shape: tuple[int, ...], lead: int) -> _Layout:
        if sharding is None:
            return cls(None, shape, lead, shape[:lead], (1,) * lead, ((0,) * lead,))
        local = sharding.shard_shape(shape)[:lead]
        blocks = tuple(s // n for s, n in zip(shape[:lead], local, strict=True))
        held = sharding.addressable_devices_indices_map(blocks + shape[lead:]).values()
        local_blocks = sorted({tuple(sl.start or 0 for sl in index[:lead]) for index in held})
        return cls(sharding, shape, lead, local, blocks, tuple(local_blocks))

    def place(self, shape: tuple[int, ...], data: Callable[[tuple], np.ndarray]) -> jax.Array:
        """An array of `shape` under the sharding, each local device's part being data(its index)."""
        if self.sharding is None:
            return jax.device_put(data((slice(None),) * len(shape)))  # (jnp.asarray compiles a program per shape)
        return jax.make_array_from_callback(shape, self.sharding, data)

    def position(self, block: tuple[int, ...], at: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(b * n + a for b, n, a in zip(block, self.local, at, strict=True))


def fill_params(
    params: dict[tuple, Stacked],
    read: Callable[[object], np.ndarray],
    sharding: Callable[[tuple, tuple[int, ...]], Sharding] | None = None,
    order: Callable[[object], tuple] | None = None,
    stage_bytes: int = 0,
) -> dict[tuple, jax.Array]:
    """path -> device array of each param, filled with read(item) ([*shape[lead:]] of the param's dtype) at every
    stacking position its local devices hold. sharding(path, shape) places a param (None: the default device);
    order(item) sorts the steps, each by the item of its position in the first block, so that every process runs
    the same programs in the same order; params of at most `stage_bytes` are assembled on the host and placed
    whole."""
    arrays, steps = {}, []
    for path, p in params.items():
        layout = _Layout.of(None if sharding is None else sharding(path, p.shape), p.shape, p.lead)
        if math.prod(p.shape) * p.dtype.itemsize <= stage_bytes:
            steps.append((order(p.items[(0,) * p.lead]) if order else (), path, layout, None))
            continue
        arrays[path] = jnp.zeros(p.shape, p.dtype, device=layout.sharding)
        for at in np.ndindex(*layout.local):
            steps.append((order(p.items[at]) if order else (), path, layout, at))
    steps.sort(key=lambda s: s[0])
    for _, path, layout, at in steps:
        if at is None:
            arrays[path] = _place_whole(params[path], layout, read)
        else:
            arrays[path] = _write_position(arrays[path], layout, params[path], at, read)
    return arrays


def _checked(p: Stacked, pos: tuple[int, ...], t: np.ndarray) -> np.ndarray:
    tail = p.shape[len(pos) :]
    if t.shape != tail or t.dtype != p.dtype:
        raise ValueError(f"read gave {t.dtype} {t.shape} at {pos}, the param needs {p.dtype} {tail}")
    return t


def _place_whole(p: Stacked, layout: _Layout, read) -> jax.Array:
    host = np.empty(p.shape, p.dtype)  # positions no local device holds stay unread
    for at in np.ndindex(*layout.local):
        for block in layout.local_blocks:
            pos = layout.position(block, at)
            host[pos] = _checked(p, pos, read(p.items[pos]))
    return layout.place(p.shape, lambda index: host[index])


def _write_position(buf: jax.Array, layout: _Layout, p: Stacked, at: tuple[int, ...], read) -> jax.Array:
    host: dict[tuple[int, ...], np.ndarray] = {}  # one read per block, however many devices hold its slices
    tail = p.shape[layout.lead :]

    def device_slice(index):
        pos = layout.position(tuple(sl.start or 0 for sl in index[: layout.lead]), at)
        if pos not in host:
            host[pos] = _checked(p, pos, read(p.items[pos]))
        return host[pos][index[layout.lead :]][(None,) * layout.lead]

    u = layout.place(layout.blocks + tail, device_slice)
    named = layout.sharding if isinstance(layout.sharding, NamedSharding) else None
    out = _write_slot(buf, u, at, blocks=layout.blocks, sharding=named)
    # One position in flight: the host tensors (which a CPU device may alias) are released before the next read.
    return out.block_until_ready()


@functools.partial(jax.jit, static_argnames=("blocks", "sharding"), donate_argnums=0)
def _write_slot(buf, u, at, blocks, sharding):
    """buf [*lead, *tail] with u [*blocks, *tail] written at position `at` of every block: viewing each stacking dim
    as (blocks, local) keeps the dynamic index off the split dims, so each device writes its own slice in place."""
    dtype = buf.dtype
    if dtype.itemsize == 1 and jnp.issubdtype(dtype, jnp.floating):
        # fp8 written through its bits: XLA:CPU computes a float8 update in float16 over the whole buffer
        buf, u = lax.bitcast_convert_type(buf, jnp.uint8), lax.bitcast_convert_type(u, jnp.uint8)
    lead = len(blocks)
    tail = buf.shape[lead:]
    local = [s // b for s, b in zip(buf.shape, blocks, strict=False)]
    view = buf.reshape(sum(((b, n) for b, n in zip(blocks, local, strict=False)), ()) + tail)
    start = sum(((0, a) for a in at), ()) + (0,) * len(tail)
    out = lax.dynamic_update_slice(view, u.reshape(sum(((b, 1) for b in blocks), ()) + tail), start)
    out = lax.bitcast_convert_type(out.reshape(buf.shape), dtype)
    return out if sharding is None else lax.with_sharding_constraint(out, sharding)
