"""The decode worker: the engine with remote prefill.

The engine's scheduler admits a request as usual, reserving its decode slot and its pages on the rank the balance
policy picks, and then, instead of prefilling it, hands it to `RemotePrefill.start`. That asks a prefill worker
(the one the router named for the request, else the next in turn) to prefill the prompt and send the cache to this
worker's transport receiver, waits for both the first token and the cache, and gives them to the engine
(`Engine.land`), which writes the cache into the reserved pages and starts decoding. So no prefill is spent on a
request decode cannot take, and a request that fails anywhere on the way ends with an error and frees its pages.

Prefill workers are reached through `PrefillClient`s: `LocalPrefill` (a PrefillWorker in this process) or
`GrpcPrefill` (hcfjax.pd.service).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import threading

from hcfjax import trace
from hcfjax.engine.request import Request
from hcfjax.pd.prefill import PrefillJob, PrefillWorker

log = logging.getLogger("hcfjax.pd")


class LocalPrefill:
    """A prefill worker in the same process."""

    def __init__(self, worker: PrefillWorker):
        self.worker = worker
        self.address = f"local:{id(worker):x}"
        self._jobs: dict[str, PrefillJob] = {}

    def prefill(self, job: PrefillJob, timeout: float) -> tuple[int, dict | None]:
        """-> (first token, the request's draft state or None)."""
        self._jobs[job.key] = job
        try:
            return self.worker.submit(job).result(timeout)
        finally:
            self._jobs.pop(job.key, None)

    def cancel(self, key: str) -> None:
        job = self._jobs.get(key)
        if job is not None:
            job.cancelled.set()


def transfer_key(req: Request) -> str:
    return f"{req.id}#{req.epoch}"


class RemotePrefill:
    """The engine's `remote`: runs each admitted request's prefill elsewhere (a thread per request in flight)."""

    def __init__(self, receiver, prefills: list, timeout_s: float = 60.0, max_in_flight: int = 64):
        """receiver: this worker's transport Receiver; prefills: PrefillClients to use when the router names none
        (or names one not in `clients`, which are then made with `connect(address)`)."""
        self.receiver, self.timeout_s = receiver, timeout_s
        self.clients = {p.address: p for p in prefills}
        self._turn = itertools.cycle(list(self.clients))
        self.routes: dict[str, str] = {}  # request id -> prefill address, set by the serving layer
        self.connect = None  # address -> PrefillClient, for addresses first seen in routes
        self._pool = concurrent.futures.ThreadPoolExecutor(max_in_flight, thread_name_prefix="hcfjax-remote")
        self._lock = threading.Lock()
        self._active: dict[str, object] = {}  # transfer key -> the client running it

    def _client(self, rid: str):
        with self._lock:
            addr = self.routes.get(rid)
            if addr is None:
                if not self.clients:
                    raise RuntimeError("no prefill worker is configured")
                addr = next(self._turn)
            if addr not in self.clients:
                if self.connect is None:
                    raise RuntimeError(f"prefill worker {addr} is unknown to this decode worker")
                self.clients[addr] = self.connect(addr)
            return self.clients[addr]

    def start(self, engine, req: Request) -> None:
        key = transfer_key(req)
        job = PrefillJob(key, list(req.fill), req.sampling, req.seed, len(req.output), self.receiver.address)
        trace.mark("remote", key)
        self._pool.submit(self._run, engine, req.id, req.epoch, job)

    def _run(self, engine, rid: str, epoch: int, job: PrefillJob) -> None:
        try:
            client = self._client(rid)
            with self._lock:
                self._active[job.key] = client
            first, drafts = client.prefill(job, self.timeout_s)
            trace.mark("prefilled", job.key)
            kv, scale = self.receiver.take(job.key, self.timeout_s)
            trace.mark("received", job.key)
            engine.land(rid, epoch, first, kv, scale, drafts)
        except Exception as e:  # noqa: BLE001 - the request ends with the error; nothing waits forever
            log.warning("remote prefill of %s failed: %s: %s", job.key, type(e).__name__, e)
            self.receiver.discard(job.key)
            engine.land_failed(rid, epoch, f"prefill failed: {type(e).__name__}: {e}")
        finally:
            with self._lock:
                self._active.pop(job.key, None)
                self.routes.pop(rid, None)

    def cancel(self, req: Request) -> None:
        key = transfer_key(req)
        with self._lock:
            client = self._active.get(key)
        if client is not None:
            client.cancel(key)
        self.receiver.discard(key)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
