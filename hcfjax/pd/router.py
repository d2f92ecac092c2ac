"""The router: the users' gRPC front end (hcfjax.v1.Generation) over prefill and decode workers.

For each request it picks a decode worker with the engine's balance policy (over the loads the router itself
tracks: requests it has in flight on each worker against the worker's slots) and the prefill worker with the
fewest prompt tokens waiting for their first token, then relays the decode worker's stream. The decode worker
reserves the request's pages before it asks the prefill worker for anything (hcfjax.pd.decode).

Health: every worker's grpc.health.v1 is polled; one that fails `down_after` checks in a row is marked down (no
new requests), one that answers again rejoins. The router itself is ready (its own health SERVING) only while at
least one prefill and one decode worker are up: workers that are still compiling do not answer yet.

The decode worker's acceptance of a request (server.ACCEPTED, before its first token) is passed on to the user once.
A call that fails on a worker before any token was streamed is retried (up to `retries` times) without that worker:
a failed prefill (the decode worker's error says so) on another prefill worker, any other failure on another
decode worker; after tokens were streamed it ends with UNAVAILABLE. Either way the upstream call is cancelled,
which frees the request's pages on both sides. No call waits past its deadline or the router's `request_timeout_s`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from hcfjax import trace
from hcfjax.engine.balance import Balancer, RankLoad
from hcfjax.frontdoor import InvalidRequest, check_request_id, check_stop, new_request_id
from hcfjax.pd.service import PREFILL_METADATA, worker_channel
from hcfjax.serving import hcfjax_pb2 as pb
from hcfjax.serving import hcfjax_pb2_grpc as pb_grpc
from hcfjax.serving import pd_pb2 as pdpb
from hcfjax.serving import pd_pb2_grpc as pd_grpc
from hcfjax.serving.guards import add_generation_service, guarded_server
from hcfjax.serving.server import ACCEPTED, SERVICE_NAME

log = logging.getLogger("hcfjax.pd")

RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)


@dataclasses.dataclass
class WorkerState:
    address: str
    role: str
    channel: grpc.Channel
    up: bool = False
    failures: int = 0
    info: pdpb.WorkerInfo | None = None
    in_flight: int = 0  # decode: requests streaming through it; prefill: requests before their first token
    tokens: int = 0  # prefill: prompt tokens of those requests


class Router(pb_grpc.GenerationServicer):
    def __init__(
        self,
        prefill: list[str],
        decode: list[str],
        balance: str = "fewest_requests",
        health_interval_s: float = 0.5,
        health_timeout_s: float = 2.0,
        down_after: int = 3,
        retries: int = 1,
        request_timeout_s: float = 600.0,
        api_key: str | None = None,
    ):
        if not prefill or not decode:
            raise ValueError("the router needs at least one prefill and one decode worker")
        mk = lambda a, role: WorkerState(a, role, worker_channel(a, api_key))  # noqa: E731
        self.prefill = [mk(a, "prefill") for a in prefill]
        self.decode = [mk(a, "decode") for a in decode]
        self.balancer = Balancer(balance, len(decode))
        self.health_interval_s, self.down_after, self.retries = health_interval_s, down_after, retries
        self.health_timeout_s = health_timeout_s  # a busy worker (compiling, a long step) may answer slowly
        self.request_timeout_s = request_timeout_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._health = threading.Thread(target=self._watch, name="hcfjax-router-health", daemon=True)
        self.on_ready_change: list[Callable[[bool], None]] = []  # called with ready() whenever it flips
        self._ready: bool | None = None

    # -- health --------------------------------------------------------------------------------------------------
    def start(self) -> Router:
        self.check_all()
        self._health.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for w in self.prefill + self.decode:
            w.channel.close()

    def _watch(self) -> None:
        while not self._stop.wait(self.health_interval_s):
            self.check_all()

    def check_all(self) -> None:
        for w in self.prefill + self.decode:
            self._check(w)
        now = self.ready()
        if now != self._ready:
            self._ready = now
            for call in self.on_ready_change:
                call(now)

    def ready(self) -> bool:
        """Whether a request can be placed: some prefill and some decode worker answered their health checks."""
        with self._lock:
            return any(w.up for w in self.prefill) and any(w.up for w in self.decode)

    def _check(self, w: WorkerState) -> None:
        try:
            status = health_pb2_grpc.HealthStub(w.channel).Check(
                health_pb2.HealthCheckRequest(), timeout=self.health_timeout_s
            )
            ok = status.status == health_pb2.HealthCheckResponse.SERVING
            if ok and (w.info is None or not w.up):
                w.info = pd_grpc.WorkerStub(w.channel).Info(pdpb.InfoRequest(), timeout=2.0)
        except grpc.RpcError:
            ok = False
        with self._lock:
            if ok:
                if not w.up:
                    log.info("%s worker %s is up", w.role, w.address)
                w.up, w.failures = True, 0
            else:
                w.failures += 1
                if w.up and w.failures >= self.down_after:
                    log.warning("%s worker %s is down", w.role, w.address)
                    w.up = False

    def snapshot(self) -> dict:
        with self._lock:
            return {
                w.role + ":" + w.address: {"up": w.up, "in_flight": w.in_flight, "tokens": w.tokens}
                for w in self.prefill + self.decode
            }

    # -- placement -----------------------------------------------------------------------------------------------
    def _place(self, prompt_len: int, exclude: set[str]) -> tuple[WorkerState, WorkerState]:
        with self._lock:
            decode = [w for w in self.decode if w.up and w.address not in exclude]
            prefill = [w for w in self.prefill if w.up and w.address not in exclude]
            if not decode or not prefill:
                missing = "decode" if not decode else "prefill"
                raise LookupError(f"no {missing} worker is up")
            loads = []
            for i, w in enumerate(self.decode):
                if w in decode:
                    slots = w.info.dp * w.info.max_slots if w.info else 1
                    free = w.info.free_pages if w.info else 0
                    loads.append(RankLoad(i, w.in_flight, max(slots - w.in_flight, 0), free))
            choice = self.balancer.choose(loads, 0)
            d = self.decode[choice] if choice is not None else min(decode, key=lambda w: w.in_flight)
            p = min(prefill, key=lambda w: (w.tokens, w.in_flight))
            d.in_flight += 1
            p.in_flight += 1
            p.tokens += prompt_len
            return d, p

    def _prefill_done(self, p: WorkerState, prompt_len: int, done: list[bool]) -> None:
        if not done[0]:
            done[0] = True
            with self._lock:
                p.in_flight -= 1
                p.tokens -= prompt_len

    # -- the service ---------------------------------------------------------------------------------------------
    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        # The checks that need no model, before any worker is asked (the decode worker's engine runs the rest).
        try:
            if request.request_id:
                check_request_id(request.request_id)
            check_stop(list(request.stop))
        except InvalidRequest as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if not request.request_id:
            request.request_id = new_request_id("rt")
        trace.mark("route", request.request_id)
        which = request.WhichOneof("prompt")
        prompt_len = len(request.token_ids.ids) if which == "token_ids" else len(request.text) // 4 + 1
        deadline = time.monotonic() + min(context.time_remaining() or self.request_timeout_s, self.request_timeout_s)
        tried: set[str] = set()
        streamed = accepted = False
        for attempt in range(self.retries + 1):
            try:
                d, p = self._place(prompt_len, tried)
            except LookupError as e:
                context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            call = pb_grpc.GenerationStub(d.channel).Generate(
                request,
                timeout=max(deadline - time.monotonic(), 0.1),
                metadata=((PREFILL_METADATA, p.address),),
            )
            context.add_callback(call.cancel)  # the user went away: the decode worker aborts and frees pages
            first = [False]
            try:
                if not accepted and ACCEPTED in (call.initial_metadata() or ()):
                    context.send_initial_metadata((ACCEPTED,))
                    accepted = True
                for resp in call:
                    if resp.token_ids:
                        if not streamed:
                            trace.mark("relay_first", request.request_id)
                        self._prefill_done(p, prompt_len, first)
                        streamed = True
                    yield resp
                return
            except grpc.RpcError as e:
                code, detail = e.code(), e.details()
                if code in (grpc.StatusCode.CANCELLED,) and not context.is_active():
                    return
                retry = code in RETRYABLE and not streamed and attempt < self.retries
                log.warning(
                    "request %s failed on decode %s / prefill %s: %s %s%s",
                    request.request_id,
                    d.address,
                    p.address,
                    code.name,
                    detail,
                    " (retrying)" if retry else "",
                )
                if not retry:
                    if code in RETRYABLE:
                        context.abort(
                            grpc.StatusCode.UNAVAILABLE, f"decode worker {d.address} failed: {code.name}: {detail}"
                        )
                    context.abort(code, detail or code.name)
                tried.add(p.address if "prefill failed" in (detail or "") else d.address)
                request.request_id = f"{request.request_id}.r{attempt + 1}"
            finally:
                call.cancel()
                self._prefill_done(p, prompt_len, first)
                with self._lock:
                    d.in_flight -= 1

    def Tokenize(self, request: pb.TokenizeRequest, context: grpc.ServicerContext) -> pb.TokenizeResponse:
        with self._lock:
            up = [w for w in self.decode if w.up]
        if not up:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no decode worker is up")
        try:
            return pb_grpc.GenerationStub(up[0].channel).Tokenize(request, timeout=10.0)
        except grpc.RpcError as e:
            context.abort(e.code(), e.details() or e.code().name)


class RouterServer:
    """The router's gRPC server: Generation, health (SERVING while some prefill and decode worker is up,
    NOT_SERVING before and otherwise). on_ready(ready, address) hears each change of readiness. api_key: Generation
    calls need the metadata `authorization: Bearer KEY`, as on a colocated server. Calls past max_workers are refused
    (RESOURCE_EXHAUSTED) as a colocated server refuses them; metrics (hcfjax.serving.metrics.Metrics) counts every
    refusal by its code."""

    def __init__(
        self,
        router: Router,
        host: str = "127.0.0.1",
        port: int = 0,
        max_workers: int = 256,
        on_ready: Callable[[bool, str], None] | None = None,
        api_key: str | None = None,
        metrics=None,
    ):
        self.router = router
        self.on_ready = on_ready
        self.metrics = metrics
        self._server = guarded_server(max_workers, api_key, self._count_refusal, "hcfjax-router")
        add_generation_service(router, self._server, self._count_refusal)
        self.health = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self.port = self._server.add_insecure_port(f"{host}:{port}")
        self.address = f"{host}:{self.port}"

    def _count_refusal(self, code: str) -> None:
        if self.metrics is not None:
            self.metrics.rejected.labels(code).inc()

    def start(self) -> RouterServer:
        self._set_serving(False)
        self.router.on_ready_change.append(self._ready_changed)
        self._server.start()
        self.router.start()
        return self

    def _set_serving(self, ready: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    def _ready_changed(self, ready: bool) -> None:
        self._set_serving(ready)
        if self.on_ready is not None:
            self.on_ready(ready, self.address)

    def stop(self, grace: float = 2.0) -> None:
        self.health.enter_graceful_shutdown()
        self._server.stop(grace).wait(grace + 1)
        self.router.stop()
