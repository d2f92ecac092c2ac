"""KV transports: a request's paged latent cache, piece by piece, from a prefill worker to a decode worker.

A prefill worker's Sender queues Pieces (a layer range of one request's pages, [layers, n_pages, page_size, D],
possibly still being computed: jax arrays from async dispatch). A background thread per destination waits for
the arrays (so the prefill thread never blocks and the next layers' compute overlaps the transfer), groups what
is queued into messages and sends them; the receiver acknowledges each message. The decode worker's Receiver
gathers the pieces of each key and hands them over whole with take().

    t = make_transport("socket")            # or "inprocess", "jax"
    rx = t.receiver()                       # decode side; senders address it by rx.address
    tx = t.sender()                         # prefill side
    tx.send(rx.address, Piece("req-1", (0, 4), kv, None, total_layers=61))   # ... then layers 4..61
    tx.flush("req-1", timeout=10)           # raises TransferError / TimeoutError
    kv, scale = rx.take("req-1", timeout=10)  # [61, n_pages, page_size, D]

Kinds:
    inprocess  both ends in one process (tests): arrays handed over by reference, addresses from the Transport.
    socket     host-staged TCP stream: each message a length-prefixed frame (JSON header: keys, layers, pages,
               shapes, dtypes; then the raw bytes, 64-byte aligned); take() returns numpy arrays.
    jax        device-to-device pulls with jax.experimental.transfer: the sender posts the message's arrays with
               await_pull and sends a payload-free header over the socket channel; the receiver pulls onto its
               device and acks; take() returns jax arrays on the receiver's device.

merge=True coalesces the pieces queued for one destination at the same time (ready ones, up to
max_message_bytes) into one message; merge=False sends every (layer, page) of a piece as its own message (the
page-granular baseline). Delivery is idempotent per (key, layers, pages), so a message re-sent after a lost ack
does no harm; keys must be unique per transfer (a retried request takes a new key), since discard() drops
late pieces of its key for good.

What jax.experimental.transfer does in jax 0.11.2 (found by experiment), and how this module copes:
    - conn.pull returns at once with arrays that become ready once the peer's await_pull for that uuid is posted
      and the bytes have landed: a pull issued first waits, with no error. It waits forever if the uuid never
      comes or the peer address does not answer; pull's `timeout` did not end such a pull. So the receiver
      bounds each pull itself: a timer calls the connection's _poison_connection, which fails the pending pull,
      and the next message connects afresh. A peer process that dies fails its pending pulls.
    - await_pull keeps its own references until the pull completes, so the sender may drop the arrays. An entry
      never pulled is held until its `timeout` deadline, and is released only by a later await_pull call; after
      a failed message the sender posts an empty, already-expired entry once the deadline has passed.
    - A transfer server cannot be stopped (deleting it leaves it serving), so there is one per (client, host)
      per process, made on first use.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import functools
import json
import random
import socket
import struct
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

KINDS = ("inprocess", "socket", "jax")
_PREFIX = struct.Struct("!IQ")  # header bytes, payload bytes
_ALIGN = 64
_DISCARDED_KEPT = 100_000


@dataclasses.dataclass
class Piece:
    key: str  # request id
    layers: tuple[int, int]  # [l0, l1) of the cache's layers
    kv: Any  # [l1 - l0, n_pages, page_size, D] numpy or jax array (maybe not ready yet)
    scale: Any | None  # [l1 - l0, n_pages, page_size, 2] f32 for int8 caches, else None
    total_layers: int  # the request is complete when layers [0, total_layers) have all arrived


class TransferError(RuntimeError):
    """A transfer failed: the receiver is unreachable, died, refused the message, or the sender closed."""


@dataclasses.dataclass
class _Part:
    """The unit a message carries: layers [l0, l1) x pages [p0, p1) of a key's n_pages pages."""

    key: str
    layers: tuple[int, int]
    pages: tuple[int, int]
    n_pages: int
    total_layers: int
    kv: Any
    scale: Any | None

    @property
    def arrays(self) -> list:
        return [self.kv] if self.scale is None else [self.kv, self.scale]

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays)

    def meta(self) -> dict:
        arrays = [[list(a.shape), str(a.dtype)] for a in self.arrays]
        return dict(key=self.key, layers=self.layers, pages=self.pages, n_pages=self.n_pages,
                    total_layers=self.total_layers, arrays=arrays)  # fmt: skip

    @staticmethod
    def from_meta(m: dict, arrays: list) -> _Part:
        kv, scale = (arrays + [None])[:2]
        return _Part(m["key"], tuple(m["layers"]), tuple(m["pages"]), m["n_pages"], m["total_layers"], kv, scale)


def _check_piece(p: Piece) -> None:
    l0, l1 = p.layers
    if not 0 <= l0 < l1 <= p.total_layers:
        raise ValueError(f"piece {p.key}: layers {p.layers} not within [0, {p.total_layers})")
    if len(p.kv.shape) != 4 or p.kv.shape[0] != l1 - l0:
        raise ValueError(f"piece {p.key}: kv {p.kv.shape} is not [{l1 - l0}, n_pages, page_size, D]")
    if p.scale is not None and tuple(p.scale.shape) != tuple(p.kv.shape[:3]) + (2,):
        raise ValueError(f"piece {p.key}: scale {p.scale.shape} does not match kv {p.kv.shape}")


def _assemble(parts: list[_Part], concat) -> tuple[Any, Any]:
    """[total_layers, n_pages, page_size, D] (and scale) from parts that tile (layers x pages)."""
    if len(parts) == 1:
        return parts[0].kv, parts[0].scale
    rows = collections.defaultdict(list)
    for p in sorted(parts, key=lambda p: (p.layers, p.pages)):
        rows[p.layers].append(p)

    def cat(field):
        if getattr(parts[0], field) is None:
            return None
        return concat([concat([getattr(p, field) for p in row], axis=1) for row in rows.values()], axis=0)

    return cat("kv"), cat("scale")


# -- framing: [header bytes u32][payload bytes u64][JSON header][payload] --------------------------------------


def _write_frame(sock: socket.socket, header: dict, payload: list[np.ndarray] = ()) -> None:
    offsets, n = [], 0
    for a in payload:
        offsets.append(n)
        n = -(-(n + a.nbytes) // _ALIGN) * _ALIGN
    h = json.dumps(dict(header, offsets=offsets)).encode()
    sock.sendall(_PREFIX.pack(len(h), n) + h)
    sent = 0
    for off, a in zip(offsets, payload, strict=True):
        if off > sent:
            sock.sendall(bytes(off - sent))
        sock.sendall(memoryview(a.reshape(-1).view(np.uint8)))
        sent = off + a.nbytes
    if n > sent:
        sock.sendall(bytes(n - sent))


def _recv_into(sock: socket.socket, buf) -> None:
    view, got = memoryview(buf).cast("B"), 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("connection closed by peer")
        got += k


def _read_frame(sock: socket.socket, timeout: float, first: float | None) -> tuple[dict, np.ndarray]:
    """Waits `first` seconds (None: without limit, an idle connection) for a frame to start, then `timeout` for
    the rest of it."""
    prefix = bytearray(_PREFIX.size)
    sock.settimeout(first)
    _recv_into(sock, memoryview(prefix)[:1])
    sock.settimeout(timeout)
    _recv_into(sock, memoryview(prefix)[1:])
    hlen, n = _PREFIX.unpack(prefix)
    h = bytearray(hlen)
    _recv_into(sock, h)
    payload = np.empty(n, np.uint8)
    _recv_into(sock, payload)
    return json.loads(h), payload


def _from_payload(payload: np.ndarray, metas: list[dict], offsets: list[int]) -> list[_Part]:
    parts, i = [], 0
    for m in metas:
        arrays = []
        for shape, dtype in m["arrays"]:
            dt = jnp.dtype(dtype)
            n = int(np.prod(shape)) * dt.itemsize
            arrays.append(payload[offsets[i] : offsets[i] + n].view(dt).reshape(shape))
            i += 1
        parts.append(_Part.from_meta(m, arrays))
    return parts


def _tune(sock: socket.socket) -> None:
    """Acks and headers go out at once; bulk data moves in large socket buffers."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, 8 << 20)


def _host_addr(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


@functools.cache
def _transfer_server(client, host: str):
    from jax.experimental import transfer

    return transfer.start_transfer_server(client, f"{host}:0", [f"{host}:0"])


def _single_device(x: jax.Array, device) -> jax.Array:
    """await_pull exposes every shard as a buffer to pull, so multi-device arrays go over as one buffer."""
    if len(x.sharding.device_set) == 1:
        return x
    if x.is_fully_replicated:
        return x.addressable_shards[0].data
    return jax.device_put(x, device)


# -- links: one per (sender, destination); send() returns once the receiver acked --------------------------------


class _InprocessLink:
    def __init__(self, registry: dict, dest: str):
        self.registry, self.dest = registry, dest

    def prepare(self, x):
        return np.asarray(x)

    def send(self, parts: list[_Part]) -> None:
        rx = self.registry.get(self.dest)
        if rx is None:
            raise TransferError(f"no receiver at {self.dest}")
        rx._deliver(parts, sum(p.nbytes for p in parts))

    def idle(self) -> None:
        pass

    def close(self) -> None:
        pass


class _SocketLink:
    def __init__(self, dest: str, timeout: float):
        self.dest, self.timeout = dest, timeout
        self.sock: socket.socket | None = None

    def prepare(self, x):
        return np.ascontiguousarray(np.asarray(x))

    def encode(self, parts: list[_Part]) -> tuple[dict, list]:
        return {}, [a for p in parts for a in p.arrays]

    def send(self, parts: list[_Part]) -> None:
        for attempt in range(2):
            fresh = self.sock is None
            try:
                if fresh:
                    self.sock = socket.create_connection(_host_addr(self.dest), timeout=self.timeout)
                    _tune(self.sock)
                self.sock.settimeout(self.timeout)
                extra, payload = self.encode(parts)
                _write_frame(self.sock, dict(extra, parts=[p.meta() for p in parts]), payload)
                ack, _ = _read_frame(self.sock, self.timeout, first=self.timeout)
            except (OSError, ValueError) as e:
                self.failed()
                # A connection kept from earlier may have gone stale (receiver restarted): one fresh try.
                if fresh or attempt or isinstance(e, TimeoutError):
                    raise TransferError(f"{self.dest}: {type(e).__name__}: {e}") from e
                continue
            if not ack.get("ok"):
                self.failed()
                raise TransferError(f"{self.dest} refused: {ack.get('error')}")
            return

    def failed(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def idle(self) -> None:
        pass

    def close(self) -> None:
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)  # wakes the sender thread if it is blocked on this socket
            except OSError:
                pass


class _JaxLink(_SocketLink):
    def __init__(self, dest: str, timeout: float, device, host: str):
        super().__init__(dest, timeout)
        self.device = device
        self.server = _transfer_server(device.client, host)
        self.sweep_at: float | None = None
        self.last_deadline: float | None = None

    def prepare(self, x):
        return _single_device(x, self.device) if isinstance(x, jax.Array) else jax.device_put(x, self.device)

    def encode(self, parts: list[_Part]) -> tuple[dict, list]:
        uuid = random.getrandbits(63)
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=self.timeout)
        self.server.await_pull(uuid, [a for p in parts for a in p.arrays], timeout=deadline)
        self.last_deadline = time.monotonic() + self.timeout
        return {"pull": {"server": self.server.address(), "uuid": uuid}}, []

    def failed(self) -> None:
        super().failed()
        if self.last_deadline is not None:
            self.sweep_at = self.last_deadline  # the posted entry may never be pulled

    def idle(self) -> None:
        if self.sweep_at is not None and time.monotonic() > self.sweep_at:
            # Any await_pull releases the expired entries; this one is expired already and holds nothing.
            past = datetime.datetime.now() - datetime.timedelta(seconds=1)
            self.server.await_pull(random.getrandbits(63), [], timeout=past)
            self.sweep_at = None


# -- sender ---------------------------------------------------------------------------------------------------


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
    """One per prefill worker: a queue and a background thread per destination."""

    def __init__(self, make_link, merge: bool, max_message_bytes: int):
        self._make_link, self._merge, self._max_bytes = make_link, merge, max_message_bytes
        self._cv = threading.Condition()
        self._keys: dict[str, _KeyState] = {}
        self._queues: dict[str, collections.deque[_Job]] = {}
        self._links: dict[str, Any] = {}
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._stats = collections.Counter(messages=0, bytes=0, pieces=0, failed=0)

    def send(self, dest: str, piece: Piece) -> None:
        """Queues the piece for dest and returns at once; its arrays may still be computing."""
        _check_piece(piece)
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

    def _send(self, link, parts: list[_Part]) -> None:
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


def _nbytes(p: Piece) -> int:
    return int(p.kv.nbytes) + (0 if p.scale is None else int(p.scale.nbytes))


def _part(p: Piece, prepare) -> _Part:
    scale = None if p.scale is None else prepare(p.scale)
    return _Part(p.key, tuple(p.layers), (0, p.kv.shape[1]), p.kv.shape[1], p.total_layers, prepare(p.kv), scale)


def _page_parts(p: Piece, prepare):
    """The page-granular baseline: every (layer, page) of the piece as its own part."""
    l0, l1 = p.layers
    n_pages = p.kv.shape[1]
    for i in range(l1 - l0):
        for j in range(n_pages):
            scale = None if p.scale is None else prepare(p.scale[i : i + 1, j : j + 1])
            kv = prepare(p.kv[i : i + 1, j : j + 1])
            yield _Part(p.key, (l0 + i, l0 + i + 1), (j, j + 1), n_pages, p.total_layers, kv, scale)


# -- receivers ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Entry:
    """What arrived for one key: its parts (or, on the host, their (layers, pages) once copied into kv/scale)."""

    parts: dict[tuple, _Part | None] = dataclasses.field(default_factory=dict)
    kv: np.ndarray | None = None  # host receivers: [total_layers, n_pages, page_size, D], filled as parts land
    scale: np.ndarray | None = None
    covered: int = 0  # (layer, page) cells landed
    cells: int = -1

    def add(self, p: _Part, host: bool) -> bool:
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
        return _assemble(list(entry.parts.values()), np.concatenate if self._host else jnp.concatenate)

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

    def _deliver(self, parts: list[_Part], nbytes: int) -> None:
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


class _InprocessReceiver(Receiver):
    def __init__(self, registry: dict, address: str):
        super().__init__(host=True)
        self._registry, self.address = registry, address
        registry[address] = self

    def close(self) -> None:
        self._registry.pop(self.address, None)
        super().close()


class _SocketReceiver(Receiver):
    """Accepts sender connections; a thread per connection reads messages, stores their parts and acks."""

    def __init__(self, host: str, timeout: float, device=None):
        super().__init__(host=device is None)
        self._timeout, self._device = timeout, device
        self._listener = socket.create_server((host, 0))
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)  # inherited, before the handshake
        self._listener.settimeout(0.25)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._conns: set[socket.socket] = set()
        self._pulls: set = set()  # transfer connections with a pull in progress
        threading.Thread(target=self._accept, name=f"kv-accept-{self.address}", daemon=True).start()

    def close(self) -> None:
        super().close()
        self._listener.close()
        with self._cv:
            for c in self._conns:
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            for xc in self._pulls:
                xc._poison_connection()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            _tune(conn)
            with self._cv:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="kv-recv", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        xconns: dict[str, Any] = {}  # this sender's transfer servers, connected once (again after a failure)
        try:
            while True:
                try:
                    header, payload = _read_frame(conn, self._timeout, first=None)
                except (OSError, ValueError):
                    return
                try:
                    if "pull" in header:
                        parts = self._pull(header, xconns)
                    else:
                        parts = _from_payload(payload, header["parts"], header["offsets"])
                    self._deliver(parts, sum(p.nbytes for p in parts))
                    ack = {"ok": True}
                except Exception as e:  # (the sender gets the reason; the connection lives on)
                    ack = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                try:
                    conn.settimeout(self._timeout)
                    _write_frame(conn, ack)
                except OSError:
                    return
        finally:
            with self._cv:
                self._conns.discard(conn)
            conn.close()

    def _pull(self, header: dict, xconns: dict) -> list[_Part]:
        if self._closed:
            raise TransferError("receiver closed")
        server, uuid = header["pull"]["server"], header["pull"]["uuid"]
        sharding = jax.sharding.SingleDeviceSharding(self._device)
        specs = [jax.ShapeDtypeStruct(tuple(s), jnp.dtype(d), sharding=sharding)
                 for m in header["parts"] for s, d in m["arrays"]]  # fmt: skip
        if server not in xconns:
            xconns[server] = _transfer_server(self._device.client, _host_addr(self.address)[0]).connect(server)
        xc = xconns[server]
        # A pull whose uuid never comes waits forever: poisoning the connection fails it.
        timer = threading.Timer(self._timeout, xc._poison_connection)
        timer.daemon = True
        with self._cv:
            self._pulls.add(xc)
        timer.start()
        try:
            arrays = jax.block_until_ready(xc.pull(uuid, specs))
        except Exception:
            del xconns[server]
            raise
        finally:
            timer.cancel()
            with self._cv:
                self._pulls.discard(xc)
        parts, i = [], 0
        for m in header["parts"]:
            k = len(m["arrays"])
            parts.append(_Part.from_meta(m, arrays[i : i + k]))
            i += k
        return parts


# -- the factory ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Transport:
    """Makes the two ends of one kind of transport; sender() and receiver() may live in different processes
    (except for "inprocess", whose ends find each other through this object)."""

    kind: str
    merge: bool = True
    device: Any = None  # jax kind: where pulled arrays land and where numpy pieces are put; default devices()[0]
    host: str = "127.0.0.1"
    timeout: float = 30.0  # per transfer: connect, send, ack, pull
    max_message_bytes: int = 256 << 20  # merging stops here (a larger piece still goes as one message)
    _registry: dict = dataclasses.field(default_factory=dict, repr=False)
    _next_id: int = dataclasses.field(default=0, repr=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"transport kind {self.kind!r} is not one of {KINDS}")
        if self.kind == "jax" and self.device is None:
            self.device = jax.devices()[0]

    def sender(self) -> Sender:
        if self.kind == "inprocess":
            make_link = functools.partial(_InprocessLink, self._registry)
        elif self.kind == "socket":
            make_link = functools.partial(_SocketLink, timeout=self.timeout)
        else:
            make_link = functools.partial(_JaxLink, timeout=self.timeout, device=self.device, host=self.host)
        return Sender(make_link, self.merge, self.max_message_bytes)

    def receiver(self) -> Receiver:
        if self.kind == "inprocess":
            self._next_id += 1
            return _InprocessReceiver(self._registry, f"inprocess:{self._next_id}")
        return _SocketReceiver(self.host, self.timeout, self.device if self.kind == "jax" else None)


def make_transport(
    kind: str,
    *,
    merge: bool = True,
    device=None,
    host: str = "127.0.0.1",
    timeout: float = 30.0,
    max_message_bytes: int = 256 << 20,
) -> Transport:
    """A Transport of kind "inprocess", "socket" or "jax" (see the module docstring)."""
    return Transport(kind, merge, device, host, timeout, max_message_bytes)
