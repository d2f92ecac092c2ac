"""The workers' gRPC side: the Prefill service over a PrefillWorker, the decode worker's Generation service (the
colocated one, plus the router's choice of prefill worker from the call's metadata), Worker.Info on both, and
GrpcPrefill, the decode worker's client of a remote prefill worker.
"""

from __future__ import annotations

import dataclasses
import io
import logging
import threading
from concurrent import futures

import grpc
import jax.numpy as jnp
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from hcfjax.pd.prefill import PrefillJob, PrefillWorker
from hcfjax.pd.transport import TransferError
from hcfjax.serving import hcfjax_pb2 as pb
from hcfjax.serving import pd_pb2 as pdpb
from hcfjax.serving import pd_pb2_grpc as pd_grpc
from hcfjax.serving.client import with_api_key
from hcfjax.serving.front_process import Up
from hcfjax.serving.guards import GENERATION_PREFIX, PD_PREFIX, ApiKeyInterceptor, add_generation_service
from hcfjax.serving.server import GenerationService, sampling_of

log = logging.getLogger("hcfjax.pd")

PREFILL_METADATA = "hcfjax-prefill"  # the router's choice of prefill worker for a decode call
# gRPC waits longer and longer between tries to reach a peer that went away (up to 120 s by default): capped, so
# that the router and the decode workers reach a worker restarted on the same address within about a second.
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 1000),
)
CONNECT_WAIT_S = 2.0  # past the longest wait between tries, and a connection's set-up


def worker_channel(address: str, api_key: str | None = None) -> grpc.Channel:
    """A channel to a PD worker, which tries again at least once a second to reach a worker it lost, sending the
    deployment's API key (if any) with every call."""
    return with_api_key(grpc.insecure_channel(address, options=RECONNECT_OPTIONS), api_key)


def pack_arrays(arrays: dict) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def unpack_arrays(data: bytes) -> dict:
    with np.load(io.BytesIO(data)) as z:
        return {k: z[k] for k in z.files}


def sampling_message(sp) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p)


class PrefillService(pd_grpc.PrefillServicer, pd_grpc.WorkerServicer):
    def __init__(self, worker: PrefillWorker, transport: str):
        self.worker, self.transport = worker, transport
        self._jobs: dict[str, PrefillJob] = {}

    def Prefill(self, request: pdpb.PrefillRequest, context: grpc.ServicerContext) -> pdpb.PrefillReply:
        try:
            sampling = sampling_of(request)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        job = PrefillJob(request.key, list(request.tokens), sampling, request.seed, request.count, request.dest)
        context.add_callback(job.cancelled.set)  # the decode worker gave up (or died): drop the job
        self._jobs[job.key] = job
        try:
            fut = self.worker.submit(job)
            first, drafts = fut.result(timeout=context.time_remaining())
            return pdpb.PrefillReply(first_token=first, drafts=b"" if drafts is None else pack_arrays(drafts))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except futures.TimeoutError:
            job.cancelled.set()
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the prefill and its transfer did not finish in time")
        except futures.CancelledError:
            context.abort(grpc.StatusCode.CANCELLED, "the job was cancelled")
        except (TransferError, TimeoutError) as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the KV transfer failed: {e}")
        except Exception as e:  # noqa: BLE001 - reported to the caller
            context.abort(grpc.StatusCode.INTERNAL, f"prefill failed: {type(e).__name__}: {e}")
        finally:
            self._jobs.pop(job.key, None)

    def Cancel(self, request: pdpb.CancelRequest, context) -> pdpb.CancelReply:
        job = self._jobs.get(request.key)
        if job is not None:
            job.cancelled.set()
        return pdpb.CancelReply()

    def Info(self, request, context) -> pdpb.WorkerInfo:
        w = self.worker
        return pdpb.WorkerInfo(
            role="prefill",
            page_size=w.config.page_size,
            cache_dtype=jnp.dtype(w.cache.kv.dtype).name,
            layers=w.cfg.num_hidden_layers,
            transport=self.transport,
            total_pages=w.config.num_pages,
            free_pages=w.alloc.num_free,
            queued=w.queued,
            pages_held=w.pages_held,
        )


class GrpcPrefill:
    """A remote prefill worker, as a decode worker's PrefillClient."""

    def __init__(self, address: str, api_key: str | None = None):
        self.address = address
        self._channel = worker_channel(address, api_key)
        self._stub = pd_grpc.PrefillStub(self._channel)

    def _await_connection(self, timeout: float) -> None:
        """Waits (up to CONNECT_WAIT_S) for the channel's next try if it is between tries: the router, which placed
        the request here, already reaches a worker that restarted, and this channel may not have tried again yet.
        A worker that is down stays unreachable, and the call then fails at once with UNAVAILABLE."""
        ready = grpc.channel_ready_future(self._channel)
        try:
            ready.result(timeout=min(CONNECT_WAIT_S, timeout))
        except grpc.FutureTimeoutError:
            ready.cancel()

    def prefill(self, job: PrefillJob, timeout: float) -> tuple[int, dict | None]:
        req = pdpb.PrefillRequest(
            key=job.key,
            tokens=job.tokens,
            sampling=sampling_message(job.sampling),
            seed=job.seed,
            count=job.count,
            dest=job.dest,
        )
        self._await_connection(timeout)
        reply = self._stub.Prefill(req, timeout=timeout)
        return reply.first_token, unpack_arrays(reply.drafts) if reply.drafts else None

    def cancel(self, key: str) -> None:
        try:
            self._stub.Cancel(pdpb.CancelRequest(key=key), timeout=2.0)
        except grpc.RpcError as e:  # best effort: a dead worker has dropped the job anyway
            log.info("cancel of %s at %s failed: %s", key, self.address, e.code().name)

    def close(self) -> None:
        self._channel.close()


def decode_info(engine, transport: str) -> dict:
    """What a decode worker's Worker.Info says that does not change while it serves."""
    c = engine.config
    dtype = jnp.dtype(engine.runner.state.cache.kv.dtype).name
    layers = engine.cfg.num_hidden_layers
    return dict(role="decode", page_size=c.page_size, cache_dtype=dtype, layers=layers, transport=transport,
                dp=c.dp, max_slots=c.max_slots)  # fmt: skip


class DecodeGenerationService(GenerationService, pd_grpc.WorkerServicer):
    """hcfjax.v1.Generation on a decode worker: the router's choice of prefill worker comes as call metadata and is
    noted in `routes` (RemotePrefill.routes, or a LinkedEngine's notes to it); `info`: decode_info's fields."""

    def __init__(self, engine, routes, info: dict, metrics=None):
        super().__init__(engine, metrics)
        self.routes, self.info = routes, info

    def _submit(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        """The router's prefill worker is noted for the request before the engine can admit it; a request the engine
        refuses takes its note back (it would otherwise stay, as nothing prefills it)."""
        addr = dict(context.invocation_metadata()).get(PREFILL_METADATA)
        rid = request.request_id if addr else ""
        if rid:
            self.routes[rid] = addr
        try:
            return super()._submit(request, context)
        except BaseException:  # (context.abort raises)
            if rid:
                self.routes.pop(rid, None)
            raise

    def Info(self, request, context) -> pdpb.WorkerInfo:
        snap = self.engine.snapshot()
        load = {k: snap[k] for k in ("total_pages", "free_pages", "running", "queued")}
        return pdpb.WorkerInfo(**self.info, **load)


class WorkerServer:
    """A worker's gRPC server: its services, health and a bound port (0 picks a free one). With an API key every
    service but health wants it (the router and the decode workers send it)."""

    def __init__(
        self, register, host: str = "127.0.0.1", port: int = 0, max_workers: int = 128, api_key: str | None = None
    ):
        guard = [ApiKeyInterceptor(api_key, guarded=(GENERATION_PREFIX, PD_PREFIX))] if api_key is not None else []
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers, thread_name_prefix="hcfjax-pd"),
            maximum_concurrent_rpcs=max_workers,
            interceptors=guard,
        )
        register(self._server)
        self.health = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        try:
            self.port = self._server.add_insecure_port(f"{host}:{port}")
        except RuntimeError as e:
            raise OSError(f"cannot listen on {host}:{port}: {e}") from None
        self.address = f"{host}:{self.port}"
        self._stopped = threading.Event()

    def start(self) -> WorkerServer:
        self._server.start()
        self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        return self

    def stop(self, grace: float = 2.0) -> None:
        if not self._stopped.is_set():
            self._stopped.set()
            self.health.enter_graceful_shutdown()
            self._server.stop(grace).wait(grace + 1)


def prefill_server(worker: PrefillWorker, transport: str, host="127.0.0.1", port=0, api_key=None) -> WorkerServer:
    svc = PrefillService(worker, transport)

    def register(server):
        pd_grpc.add_PrefillServicer_to_server(svc, server)
        pd_grpc.add_WorkerServicer_to_server(svc, server)

    return WorkerServer(register, host, port, api_key=api_key)


def decode_server(engine, routes, info: dict, host="127.0.0.1", port=0, api_key=None) -> WorkerServer:
    """The decode worker's gRPC server over `engine` (an Engine, or a LinkedEngine in the servers' own process)."""
    svc = DecodeGenerationService(engine, routes, info)
    c = engine.config
    workers = c.dp * c.max_slots + c.max_queue + 8

    def register(server):
        add_generation_service(svc, server)
        pd_grpc.add_WorkerServicer_to_server(svc, server)

    return WorkerServer(register, host, port, max_workers=workers, api_key=api_key)


@dataclasses.dataclass(frozen=True)
class DecodeListen:
    """A decode worker's servers, for hcfjax.serving.front_process (which runs them in a process of their own over
    the engine): where to listen, the key, what Worker.Info says (decode_info) and, for the listening line, the
    transport's address."""

    host: str
    port: int
    info: dict
    transport_address: str
    api_key: str | None = None

    def servers(self, engine) -> DecodeServers:
        return DecodeServers(engine, self)


class DecodeServers:
    """DecodeListen's server over a LinkedEngine, as front_process.Servers are for `hcfjax serve`."""

    def __init__(self, engine, listen: DecodeListen):
        self.listen = s = listen
        self.server = decode_server(engine, engine.routes, s.info, s.host, s.port, api_key=s.api_key)

    def start(self) -> Up:
        address, transport = self.server.start().address, self.listen.transport_address
        line = f"hcfjax serve: decode worker listening on {address} (transport {transport})"
        return Up([line], [f"decode worker {address}"], {"grpc": self.server.port})

    def shutdown(self, grace: float = 3.0) -> None:
        self.server.stop(grace)
