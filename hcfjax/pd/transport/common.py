"""What every KV transport shares: the Piece a sender queues, the Part a message carries, checks, assembly of a
key's parts, and the socket framing (the socket and jax kinds talk over it: a frame is
[header bytes u32][payload bytes u64][JSON header][payload, each array 64-byte aligned])."""

from __future__ import annotations

import collections
import dataclasses
import json
import socket
import struct
from typing import Any, Protocol

import jax.numpy as jnp
import numpy as np

from hcfjax.cache import scale_shape

KINDS = ("inprocess", "socket", "jax")
_PREFIX = struct.Struct("!IQ")  # header bytes, payload bytes
_ALIGN = 64


@dataclasses.dataclass
class Piece:
    key: str  # request id
    layers: tuple[int, int]  # [l0, l1) of the cache's layers
    kv: Any  # [l1 - l0, n_pages, page_size, D] numpy or jax array (maybe not ready yet)
    scale: Any | None  # [l1 - l0, n_pages, 2, page_size] f32 for int8 caches (scale_shape), else None
    total_layers: int  # the request is complete when layers [0, total_layers) have all arrived
    pages: int | None = None  # the key's pages, kv's first (None: all of kv's); past them padding, cut on the host


class TransferError(RuntimeError):
    """A transfer failed: the receiver is unreachable, died, refused the message, or the sender closed."""


class Link(Protocol):
    """What a kind gives the Sender for one destination; the Sender's thread for it is the only caller."""

    def prepare(self, x) -> Any:
        """An array in the form this link sends (host numpy, or a single-device jax array)."""

    def send(self, parts: list[Part]) -> None:
        """Sends one message and returns once the receiver acked it; TransferError if it did not."""

    def idle(self) -> None:
        """Called while the queue is empty (housekeeping)."""

    def close(self) -> None:
        """Unblocks a send in progress; no more sends follow."""


@dataclasses.dataclass
class Part:
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
    def from_meta(m: dict, arrays: list) -> Part:
        kv, scale = (arrays + [None])[:2]
        return Part(m["key"], tuple(m["layers"]), tuple(m["pages"]), m["n_pages"], m["total_layers"], kv, scale)


def check_piece(p: Piece) -> None:
    l0, l1 = p.layers
    if not 0 <= l0 < l1 <= p.total_layers:
        raise ValueError(f"piece {p.key}: layers {p.layers} not within [0, {p.total_layers})")
    if len(p.kv.shape) != 4 or p.kv.shape[0] != l1 - l0:
        raise ValueError(f"piece {p.key}: kv {p.kv.shape} is not [{l1 - l0}, n_pages, page_size, D]")
    if p.scale is not None and tuple(p.scale.shape) != scale_shape(tuple(p.kv.shape)):
        raise ValueError(f"piece {p.key}: scale {p.scale.shape} does not match kv {p.kv.shape}")
    if p.pages is not None and not 0 < p.pages <= p.kv.shape[1]:
        raise ValueError(f"piece {p.key}: {p.pages} pages, but kv {p.kv.shape} holds {p.kv.shape[1]}")


def assemble(parts: list[Part], concat) -> tuple[Any, Any]:
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


# -- framing ----------------------------------------------------------------------------------------------------


def write_frame(sock: socket.socket, header: dict, payload: list[np.ndarray] = ()) -> None:
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


def read_frame(sock: socket.socket, timeout: float, first: float | None) -> tuple[dict, np.ndarray]:
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


def from_payload(payload: np.ndarray, metas: list[dict], offsets: list[int]) -> list[Part]:
    parts, i = [], 0
    for m in metas:
        arrays = []
        for shape, dtype in m["arrays"]:
            dt = jnp.dtype(dtype)
            n = int(np.prod(shape)) * dt.itemsize
            arrays.append(payload[offsets[i] : offsets[i] + n].view(dt).reshape(shape))
            i += 1
        parts.append(Part.from_meta(m, arrays))
    return parts


def tune(sock: socket.socket) -> None:
    """Acks and headers go out at once; bulk data moves in large socket buffers."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, 8 << 20)


def host_addr(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)
