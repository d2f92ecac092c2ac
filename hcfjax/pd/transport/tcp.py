"""The socket kind: a host-staged TCP stream. Each message is a frame (common.write_frame: a JSON header with the
parts' keys, layers, pages, shapes and dtypes, then their raw bytes); the receiver copies the bytes into the key's
host arrays and acks each message, and take() returns numpy arrays."""

from __future__ import annotations

import socket
import threading
from typing import Any

import numpy as np

from hcfjax.pd.transport.common import Part, TransferError, from_payload, host_addr, read_frame, tune, write_frame
from hcfjax.pd.transport.receiver import Receiver


class SocketLink:
    """One sender's connection to one receiver; send() returns once the receiver acked the message."""

    def __init__(self, dest: str, timeout: float):
        self.dest, self.timeout = dest, timeout
        self.sock: socket.socket | None = None

    def prepare(self, x):
        return np.ascontiguousarray(np.asarray(x))

    def encode(self, parts: list[Part]) -> tuple[dict, list]:
        """(header fields beyond the parts' metadata, the arrays to send as the frame's payload)."""
        return {}, [a for p in parts for a in p.arrays]

    def send(self, parts: list[Part]) -> None:
        for attempt in range(2):
            fresh = self.sock is None
            try:
                if fresh:
                    self.sock = socket.create_connection(host_addr(self.dest), timeout=self.timeout)
                    tune(self.sock)
                self.sock.settimeout(self.timeout)
                extra, payload = self.encode(parts)
                write_frame(self.sock, dict(extra, parts=[p.meta() for p in parts]), payload)
                ack, _ = read_frame(self.sock, self.timeout, first=self.timeout)
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


class SocketReceiver(Receiver):
    """Accepts sender connections; a thread per connection reads messages, stores their parts and acks.
    on_host: parts are copied into the key's host arrays as they land (False: kept as they came, concatenated on
    take(), as the jax kind's device arrays are)."""

    def __init__(self, host: str, timeout: float, on_host: bool = True):
        super().__init__(host=on_host)
        self._timeout = timeout
        self._listener = socket.create_server((host, 0))
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)  # inherited, before the handshake
        self._listener.settimeout(0.25)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self._conns: set[socket.socket] = set()
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

    def _parts(self, header: dict, payload: np.ndarray, peers: dict[str, Any]) -> list[Part]:
        """A message's parts; peers is state kept per sender connection (the jax kind's transfer connections)."""
        return from_payload(payload, header["parts"], header["offsets"])

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            tune(conn)
            with self._cv:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="kv-recv", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        peers: dict[str, Any] = {}
        try:
            while True:
                try:
                    header, payload = read_frame(conn, self._timeout, first=None)
                except (OSError, ValueError):
                    return
                try:
                    parts = self._parts(header, payload, peers)
                    self._deliver(parts, sum(p.nbytes for p in parts))
                    ack = {"ok": True}
                except Exception as e:  # (the sender gets the reason; the connection lives on)
                    ack = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                try:
                    conn.settimeout(self._timeout)
                    write_frame(conn, ack)
                except OSError:
                    return
        finally:
            with self._cv:
                self._conns.discard(conn)
            conn.close()
