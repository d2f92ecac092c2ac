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

Kinds, a module each:
    inprocess     (inprocess.py) both ends in one process (tests): arrays handed over by reference, addresses
                  from the Transport.
    socket        (tcp.py) host-staged TCP stream: each message a length-prefixed frame (JSON header: keys, layers,
                  pages, shapes, dtypes; then the raw bytes, 64-byte aligned); take() returns numpy arrays.
    jax           (jax_transfer.py) device-to-device pulls with jax.experimental.transfer: the sender posts the
                  message's arrays with await_pull and sends a payload-free header over the socket channel; the
                  receiver pulls onto its device and acks; take() returns jax arrays on the receiver's device.
The rest: common.py (Piece, the parts a message carries, the socket framing), sender.py (Sender: queues and a
thread per destination over any kind's link), receiver.py (Receiver: gathering parts into whole keys).

merge=True coalesces the pieces queued for one destination at the same time (ready ones, up to
max_message_bytes) into one message; merge=False sends every (layer, page) of a piece as its own message (the
page-granular baseline). Delivery is idempotent per (key, layers, pages), so a message re-sent after a lost ack
does no harm; keys must be unique per transfer (a retried request takes a new key), since discard() drops
late pieces of its key for good.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax

from hcfjax.pd.transport.common import KINDS, Piece, TransferError
from hcfjax.pd.transport.inprocess import InprocessLink, InprocessReceiver
from hcfjax.pd.transport.jax_transfer import JaxLink, JaxReceiver
from hcfjax.pd.transport.receiver import Receiver
from hcfjax.pd.transport.sender import Sender
from hcfjax.pd.transport.tcp import SocketLink, SocketReceiver

__all__ = ["KINDS", "Piece", "Receiver", "Sender", "TransferError", "Transport", "make_transport"]


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
            make_link = functools.partial(InprocessLink, self._registry)
        elif self.kind == "socket":
            make_link = functools.partial(SocketLink, timeout=self.timeout)
        else:
            make_link = functools.partial(JaxLink, timeout=self.timeout, device=self.device, host=self.host)
        return Sender(make_link, self.merge, self.max_message_bytes, host=self.kind != "jax")

    def receiver(self) -> Receiver:
        if self.kind == "inprocess":
            self._next_id += 1
            return InprocessReceiver(self._registry, f"inprocess:{self._next_id}")
        if self.kind == "socket":
            return SocketReceiver(self.host, self.timeout)
        return JaxReceiver(self.host, self.timeout, self.device)


def make_transport(
    kind: str,
    *,
    merge: bool = True,
    device=None,
    host: str = "127.0.0.1",
    timeout: float = 30.0,
    max_message_bytes: int = 256 << 20,
) -> Transport:
    """A Transport of kind "inprocess", "socket" or "jax" (see the package docstring)."""
    return Transport(kind, merge, device, host, timeout, max_message_bytes)
