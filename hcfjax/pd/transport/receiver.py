"""The decode side: a Receiver gathers the parts of each key that its kind's delivery hands it (_deliver) and
gives the key's cache over whole with take()."""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any

import jax.numpy as jnp
import numpy as np

from hcfjax.pd.transport.common import Part, TransferError, assemble

_DISCARDED_KEPT = 100_000


@dataclasses.dataclass(eq=False)
class _Entry:
    """What arrived for one key: its parts (or, on the host, their (layers, pages) once copied into kv/scale)."""

    parts: dict[tuple, Part | None] = dataclasses.field(default_factory=dict)
    kv: np.ndarray | None = None  # host receivers: [total_layers, n_pages, page_size, D], filled as parts land
    scale: np.ndarray | None = None
    covered: int = 0  # (layer, page) cells landed
    cells: int = -1

    def add(self, p: Part, host: bool) -> bool:
        """Registers p; True if its arrays are to be copied into kv/scale (outside the lock)."""
        self.cells = p.total_layers * p.n_pages
        copy = host and (p.layers[1] - p.layers[0]) * (p.pages[1] - p.pages[0]) < self.cells
        if copy and self.kv is None:
            self.kv = np.empty((p.total_layers, p.n_pages) + tuple(p.kv.shape[2:]), p.kv.dtype)
            if p.scale is not None:
                self.scale = np.empty((p.total_layers, p.n_pages) + tuple(p.scale.shape[2:]), p.scale.dtype)
        self.parts[(p.layers, p.pages)] = None if copy else p
        return copy


class Receiver:
    """One per decode worker: gathers the parts of each key until all its layers and pages have arrived. Host
    receivers copy each part into the key's full array as it lands (off the take() path); device receivers
    concatenate the pulled parts on take()."""

    address: str

    def __init__(self, host: bool):
        self._host = host
        self._cv = threading.Condition()
        self._entries: dict[str, _Entry] = {}
        self._discarded: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._closed = False
        self._stats = collections.Counter(messages=0, bytes=0, parts=0, dropped=0)

    @property
    def on_host(self) -> bool:
        """Whether take() returns host (numpy) arrays, else arrays on the receiver's device."""
        return self._host

    def take(self, key: str, timeout: float) -> tuple[Any, Any | None]:
        """Blocks until every layer of key arrived; returns (kv, scale) as [total_layers, n_pages, page_size, ...]."""

        def done():
            entry = self._entries.get(key)
            return self._closed or (entry is not None and entry.covered == entry.cells)

        with self._cv:
            if not self._cv.wait_for(done, timeout):
                have = len(self._entries[key].parts) if key in self._entries else 0
                raise TimeoutError(f"{key}: incomplete after {timeout:.3g} s ({have} part(s) arrived)")
            if self._closed:
                raise TransferError("receiver closed")
            entry = self._entries.pop(key)
        if entry.kv is not None:
            return entry.kv, entry.scale
        return assemble(list(entry.parts.values()), np.concatenate if self._host else jnp.concatenate)

    def discard(self, key: str) -> None:
        """Drops what arrived for key and whatever arrives for it later (an aborted request)."""
        with self._cv:
            self._entries.pop(key, None)
            self._discarded[key] = None
            while len(self._discarded) > _DISCARDED_KEPT:
                self._discarded.popitem(last=False)

    @property
    def stats(self) -> dict:
        with self._cv:
            return dict(self._stats)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._entries.clear()
            self._cv.notify_all()

    def _deliver(self, parts: list[Part], nbytes: int) -> None:
        landed, copies = [], []
        with self._cv:
            if self._closed:
                raise TransferError("receiver closed")
            self._stats["messages"] += 1
            self._stats["bytes"] += nbytes
            for p in parts:
                entry = self._entries.setdefault(p.key, _Entry()) if p.key not in self._discarded else None
                if entry is None or (p.layers, p.pages) in entry.parts:  # discarded, or a re-sent duplicate
                    self._stats["dropped"] += 1
                    continue
                self._stats["parts"] += 1
                (copies if entry.add(p, self._host) else landed).append((entry, p))
        for entry, p in copies:  # distinct slices of the key's arrays; no lock needed
            (l0, l1), (p0, p1) = p.layers, p.pages
            entry.kv[l0:l1, p0:p1] = p.kv
            if p.scale is not None:
                entry.scale[l0:l1, p0:p1] = p.scale
        with self._cv:
            for entry, p in landed + copies:
                entry.covered += (p.layers[1] - p.layers[0]) * (p.pages[1] - p.pages[0])
            self._cv.notify_all()
