"""The prefill side: a Sender queues Pieces per destination and a background thread per destination sends them
over that destination's link (the kind's: inprocess, tcp or jax_transfer), merged into messages or page by page."""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable

import jax
import numpy as np

from hcfjax.pd.transport.common import Link, Part, Piece, TransferError, check_piece


@dataclasses.dataclass(eq=False)
class _KeyState:
    outstanding: int = 0  # pieces queued or in flight
    error: str | None = None


@dataclasses.dataclass(eq=False)
class _Job:
    piece: Piece
    state: _KeyState


def _ready(x) -> bool:
    return x is None or not isinstance(x, jax.Array) or x.is_ready()


class Sender:
    """One per prefill worker: a queue and a background thread per destination. host: its links send host arrays,
    so a piece may carry padding pages past its `pages`, cut on the host (socket, inprocess; not jax)."""

    def __init__(self, make_link: Callable[[str], Link], merge: bool, max_message_bytes: int, host: bool = True):
        self._make_link, self._merge, self._max_bytes = make_link, merge, max_message_bytes
        self.host = host
        self._cv = threading.Condition()
        self._keys: dict[str, _KeyState] = {}
        self._queues: dict[str, collections.deque[_Job]] = {}
        self._links: dict[str, Link] = {}
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._stats = collections.Counter(messages=0, bytes=0, pieces=0, failed=0)

    def send(self, dest: str, piece: Piece) -> None:
        """Queues the piece for dest and returns at once; its arrays may still be computing."""
        check_piece(piece)
        if not self.host and piece.pages not in (None, piece.kv.shape[1]):
            raise ValueError(f"piece {piece.key}: padding pages need a host link (this sender's are not)")
        with self._cv:
            if self._closed:
                raise TransferError("sender closed")
            state = self._keys.setdefault(piece.key, _KeyState())
            state.outstanding += 1
            if dest not in self._queues:
                self._queues[dest] = collections.deque()
                self._links[dest] = self._make_link(dest)
                t = threading.Thread(target=self._run, args=(dest,), name=f"kv-send-{dest}", daemon=True)
                self._threads.append(t)
                t.start()
            self._queues[dest].append(_Job(piece, state))
            self._cv.notify_all()

    def flush(self, key: str, timeout: float) -> None:
        """Blocks until every piece sent for key was acknowledged. On TransferError or TimeoutError the key's
        queued pieces are dropped; a message already in flight ends by the transport's per-transfer timeout."""
        deadline = time.monotonic() + timeout
        with self._cv:
            state = self._keys.get(key)
            while state is not None and state.outstanding and state.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cv.wait(left)
            if state is None or (state.outstanding == 0 and state.error is None):
                return
            self._keys.pop(key, None)
            for q in self._queues.values():
                kept = [j for j in q if j.state is not state]
                q.clear()
                q.extend(kept)
            if state.error is not None:
                raise TransferError(f"{key}: {state.error}")
            raise TimeoutError(f"{key}: {state.outstanding} piece(s) not delivered within {timeout:.3g} s")

    @property
    def stats(self) -> dict:
        with self._cv:
            return dict(self._stats)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            for state in self._keys.values():
                if state.outstanding and state.error is None:
                    state.error = "sender closed"
            for link in self._links.values():
                link.close()
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=2.0)

    def _live(self, job: _Job) -> bool:
        """Still worth sending: not failed, and flush has not given up on it."""
        return job.state.error is None and self._keys.get(job.piece.key) is job.state

    def _next_job(self, q: collections.deque[_Job], link) -> _Job | None:
        with self._cv:
            while True:
                while q and not self._live(q[0]):
                    self._settle([q.popleft()], error=None, dropped=True)
                if self._closed:
                    return None
                if q:
                    return q.popleft()
                if not self._cv.wait(timeout=0.25):
                    link.idle()

    def _ready_jobs(self, q: collections.deque[_Job], size: int) -> list[_Job]:
        """The jobs queued behind the first whose arrays are ready, up to the message size limit."""
        jobs = []
        with self._cv:
            while q and _ready(q[0].piece.kv) and _ready(q[0].piece.scale):
                if size + _nbytes(q[0].piece) > self._max_bytes:
                    break
                job = q.popleft()
                if self._live(job):
                    jobs.append(job)
                    size += _nbytes(job.piece)
                else:
                    self._settle([job], error=None, dropped=True)
        return jobs

    def _run(self, dest: str) -> None:
        q, link = self._queues[dest], self._links[dest]
        while (job := self._next_job(q, link)) is not None:
            batch, error = [job], None
            try:
                jax.block_until_ready([job.piece.kv, job.piece.scale])  # numpy and None pass through
                if self._merge:
                    batch += self._ready_jobs(q, _nbytes(job.piece))
                    self._send(link, [_part(j.piece, link.prepare) for j in batch])
                else:
                    for part in _page_parts(job.piece, link.prepare):
                        if not self._live(job):
                            break
                        self._send(link, [part])
            except Exception as e:  # a failed computation or a transport error: either ends the batch's keys
                error = str(e) if isinstance(e, TransferError) else f"{type(e).__name__}: {e}"
            with self._cv:
                self._stats["failed"] += error is not None
                self._settle(batch, error)
            job = batch = None  # the arrays are not kept while this thread waits for more
        link.close()

    def _send(self, link, parts: list[Part]) -> None:
        link.send(parts)
        with self._cv:
            self._stats["messages"] += 1
            self._stats["bytes"] += sum(p.nbytes for p in parts)

    def _settle(self, jobs: list[_Job], error: str | None, dropped: bool = False) -> None:
        """Accounts for finished jobs (the caller holds the lock); a key all delivered is forgotten."""
        for j in jobs:
            j.state.outstanding -= 1
            if error is not None and j.state.error is None:
                j.state.error = error
            elif error is None and not dropped:
                self._stats["pieces"] += 1
            if j.state.outstanding == 0 and j.state.error is None and self._keys.get(j.piece.key) is j.state:
                del self._keys[j.piece.key]
        self._cv.notify_all()


def _pages(p: Piece) -> int:
    return p.kv.shape[1] if p.pages is None else p.pages


def _nbytes(p: Piece) -> int:
    """The bytes the piece sends: its pages' (not the padding's)."""
    per_page = (int(p.kv.nbytes) + (0 if p.scale is None else int(p.scale.nbytes))) // p.kv.shape[1]
    return per_page * _pages(p)


def _cut(x, pages: int, prepare):
    """x's first `pages` pages in the link's form: padding is cut on the host (the link then sends a copy only where
    the cut is not contiguous)."""
    x = prepare(x)
    return x if x.shape[1] == pages else np.ascontiguousarray(x[:, :pages])


def _part(p: Piece, prepare) -> Part:
    n = _pages(p)
    scale = None if p.scale is None else _cut(p.scale, n, prepare)
    return Part(p.key, tuple(p.layers), (0, n), n, p.total_layers, _cut(p.kv, n, prepare), scale)


def _page_parts(p: Piece, prepare):
    """The page-granular baseline: every (layer, page) of the piece as its own part."""
    l0, l1 = p.layers
    n_pages = _pages(p)
    for i in range(l1 - l0):
        for j in range(n_pages):
            scale = None if p.scale is None else prepare(p.scale[i : i + 1, j : j + 1])
            kv = prepare(p.kv[i : i + 1, j : j + 1])
            yield Part(p.key, (l0 + i, l0 + i + 1), (j, j + 1), n_pages, p.total_layers, kv, scale)
