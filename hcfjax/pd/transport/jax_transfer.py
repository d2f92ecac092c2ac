"""The jax kind: device-to-device pulls with jax.experimental.transfer. The sender posts a message's arrays with
await_pull and sends a payload-free header over the socket kind's channel; the receiver pulls them onto its device
and acks; take() returns jax arrays on the receiver's device.

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

import datetime
import functools
import random
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hcfjax.pd.transport.common import Part, TransferError, host_addr
from hcfjax.pd.transport.tcp import SocketLink, SocketReceiver


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


class JaxLink(SocketLink):
    def __init__(self, dest: str, timeout: float, device, host: str):
        super().__init__(dest, timeout)
        self.device = device
        self.server = _transfer_server(device.client, host)
        self.sweep_at: float | None = None
        self.last_deadline: float | None = None

    def prepare(self, x):
        return _single_device(x, self.device) if isinstance(x, jax.Array) else jax.device_put(x, self.device)

    def encode(self, parts: list[Part]) -> tuple[dict, list]:
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


class JaxReceiver(SocketReceiver):
    """A socket receiver whose messages name arrays to pull (from the sender's transfer server) onto `device`."""

    def __init__(self, host: str, timeout: float, device):
        self._device = device
        self._pulls: set = set()  # transfer connections with a pull in progress
        super().__init__(host, timeout, on_host=False)

    def close(self) -> None:
        super().close()
        with self._cv:
            for xc in self._pulls:
                xc._poison_connection()

    def _parts(self, header: dict, payload: np.ndarray, peers: dict[str, Any]) -> list[Part]:
        """peers: this sender's transfer servers, connected once (again after a failure)."""
        if "pull" not in header:
            return super()._parts(header, payload, peers)
        if self._closed:
            raise TransferError("receiver closed")
        server, uuid = header["pull"]["server"], header["pull"]["uuid"]
        sharding = jax.sharding.SingleDeviceSharding(self._device)
        specs = [jax.ShapeDtypeStruct(tuple(s), jnp.dtype(d), sharding=sharding)
                 for m in header["parts"] for s, d in m["arrays"]]  # fmt: skip
        if server not in peers:
            peers[server] = _transfer_server(self._device.client, host_addr(self.address)[0]).connect(server)
        xc = peers[server]
        # A pull whose uuid never comes waits forever: poisoning the connection fails it.
        timer = threading.Timer(self._timeout, xc._poison_connection)
        timer.daemon = True
        with self._cv:
            self._pulls.add(xc)
        timer.start()
        try:
            arrays = jax.block_until_ready(xc.pull(uuid, specs))
        except Exception:
            del peers[server]
            raise
        finally:
            timer.cancel()
            with self._cv:
                self._pulls.discard(xc)
        parts, i = [], 0
        for m in header["parts"]:
            k = len(m["arrays"])
            parts.append(Part.from_meta(m, arrays[i : i + k]))
            i += k
        return parts
