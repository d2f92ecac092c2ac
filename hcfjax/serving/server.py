"""The gRPC server over an Engine: Generate (server streaming) and Tokenize, with Health and reflection.

    engine = Engine(hcfjax.load(), EngineConfig(max_slots=16))
    server = Server(engine, port=50051).start()      # starts the engine's loop too
    ...
    server.shutdown()                                # NOT_SERVING, refuse new calls, abort in-flight, stop

Each Generate call holds one thread of the pool while it streams, so the pool has a thread for every request the
engine can hold (running slots plus its queue) and a few more; beyond that the server answers RESOURCE_EXHAUSTED
(counted in the rejected-requests metric) rather than letting calls wait for a thread. guards.SPARE_THREADS more serve
refusals, health and reflection.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import queue
import signal
import threading
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from hcfjax.engine import Engine, EngineStopped, FinishReason, InvalidRequest, Output, QueueFull, Request
from hcfjax.frontdoor import sampling_params
from hcfjax.sampling import SamplingParams
from hcfjax.serving import hcfjax_pb2 as pb
from hcfjax.serving import hcfjax_pb2_grpc as pb_grpc
from hcfjax.serving.guards import (
    DEFAULT_MAX_BODY_BYTES,
    add_generation_service,
    guarded_server,
)
from hcfjax.serving.metrics import Metrics

log = logging.getLogger("hcfjax.serving")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name  # "hcfjax.v1.Generation"
# Generate's initial metadata once the engine has taken the request, before its first token: a front end relaying
# the call (the router, hcfjax.serving.remote) can answer its own client then, as a colocated engine's submit returns
# once the request is queued, not once it has a decode slot.
ACCEPTED = ("hcfjax-accepted", "1")
DEFAULT_MAX_NEW_TOKENS = 64
POLL_S = 1.0  # how often a streaming call waiting on the engine checks that its client is still there
FINISH_REASONS = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}


def to_response(out: Output) -> pb.GenerateResponse:
    u = out.usage
    usage = pb.Usage(
        prompt_tokens=u.prompt_tokens,
        output_tokens=u.output_tokens,
        draft_tokens=u.draft_tokens,
        accepted_draft_tokens=u.accepted_draft_tokens,
    )
    if u.ttft_s is not None:
        usage.ttft_s = u.ttft_s
    finish = FINISH_REASONS[out.finish] if out.finish is not None else pb.FINISH_REASON_UNSPECIFIED
    return pb.GenerateResponse(
        request_id=out.request_id, token_ids=out.token_ids, text=out.text, finish_reason=finish, usage=usage
    )


def sampling_of(request: pb.GenerateRequest) -> SamplingParams:
    """Raises InvalidRequest on invalid values."""
    s = request.sampling
    top_p = s.top_p if s.HasField("top_p") else 1.0
    return sampling_params(s.temperature, s.top_k, top_p, s.min_p)


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, engine: Engine, metrics: Metrics | None = None):
        self.engine = engine
        self.metrics = metrics

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext):
        req = self._submit(request, context)
        recorded = threading.Lock()  # the request's end goes into the metrics once, by whoever sees it first

        def record(out: Output, first_token_time=None, now=None):
            if self.metrics is not None and recorded.acquire(blocking=False):
                self.metrics.observe_finish(out, req, first_token_time, now)

        def on_rpc_end():
            # The call can end before the request does: the client cancelled, its deadline passed, or the
            # connection dropped. Then the engine must drop the request and free its pages; gRPC stops reading
            # this generator, so the abort is recorded here. (After a normal end both are no-ops.)
            if not req.done:
                self.engine.abort(req.id)
            record(Output(req.id, [], "", FinishReason.ABORT, req.usage()))

        if not context.add_callback(on_rpc_end):
            on_rpc_end()
            return
        context.send_initial_metadata((ACCEPTED,))
        first_token_time = None
        for out in self._events(req, context):
            now = time.monotonic()
            if out.token_ids and first_token_time is None:
                first_token_time = now
            if out.finish is not None:
                record(out, first_token_time, now)
            if out.finish is FinishReason.ERROR:
                if out.token_ids:  # tokens merged into the error's event (next_output) still go out first
                    yield to_response(dataclasses.replace(out, finish=None))
                context.abort(grpc.StatusCode.INTERNAL, f"the engine failed on this request: {out.error}")
            yield to_response(out)

    def _events(self, req: Request, context: grpc.ServicerContext):
        """engine.stream(req), but a call that has ended stops the wait (should the engine never answer, the
        thread still goes back to the pool)."""
        while True:
            try:
                yield from self.engine.stream(req, timeout=POLL_S)
                return
            except queue.Empty:
                if not context.is_active():
                    return

    def _submit(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Request:
        """Hands the request to the engine, or ends the call with a status that says why not."""
        which = request.WhichOneof("prompt")
        prompt = list(request.token_ids.ids) if which == "token_ids" else request.text
        stops = list(request.stop_token_ids) if request.stop_token_ids or request.ignore_eos else None
        max_new = request.max_new_tokens if request.HasField("max_new_tokens") else DEFAULT_MAX_NEW_TOKENS
        try:
            return self.engine.submit(
                prompt,
                sampling=sampling_of(request),
                max_new_tokens=max_new,
                stop_token_ids=stops,
                stop=list(request.stop),
                seed=request.seed,
                request_id=request.request_id or None,
            )
        except InvalidRequest as e:
            code, msg = grpc.StatusCode.INVALID_ARGUMENT, str(e)
        except QueueFull as e:
            code, msg = grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)
        except EngineStopped as e:
            code, msg = grpc.StatusCode.UNAVAILABLE, str(e)
        if self.metrics is not None:
            self.metrics.rejected.labels(code.name).inc()
        context.abort(code, msg)

    def Tokenize(self, request: pb.TokenizeRequest, context: grpc.ServicerContext) -> pb.TokenizeResponse:
        try:
            return pb.TokenizeResponse(token_ids=self.engine.tokenize(request.text))
        except InvalidRequest as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))


class Server:
    """The gRPC server: the Generation service, grpc.health.v1.Health and server reflection, on host:port (port 0
    picks a free one; `self.port` is the bound port). api_key: Generation calls need the metadata
    `authorization: Bearer KEY` (UNAUTHENTICATED otherwise; health and reflection stay open); max_body_bytes: the
    largest request message (gRPC answers RESOURCE_EXHAUSTED beyond)."""

    def __init__(
        self,
        engine: Engine,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        metrics: Metrics | None = None,
        max_workers: int | None = None,
        api_key: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ):
        self.engine, self.metrics = engine, metrics
        c = engine.config
        workers = max_workers or c.dp * c.max_slots + c.max_queue + 8
        options = [("grpc.max_receive_message_length", max_body_bytes)]
        self._server = guarded_server(workers, api_key, self._count_refusal, "hcfjax-grpc", options)
        add_generation_service(GenerationService(engine, metrics), self._server, self._count_refusal)
        # Non-blocking Watch streams, so health watchers do not hold the pool's threads.
        self.health = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self._server)
        self.host = host
        try:
            self.port = self._server.add_insecure_port(f"{host}:{port}")
        except RuntimeError as e:  # grpc raises when it cannot bind
            raise OSError(f"cannot listen on {host}:{port}: {e}") from None
        self._stopped = threading.Event()
        self._unhook: Callable[[], None] = lambda: None  # (start: removes the health hook from the engine)

    def _count_refusal(self, code: str) -> None:
        if self.metrics is not None:
            self.metrics.rejected.labels(code).inc()

    def start(self) -> Server:
        """Starts the engine's loop and the server; health says SERVING, until shutdown or an error that stops the
        engine's loop (then NOT_SERVING: the process should be restarted)."""
        self._unhook = self.engine.on_failure(lambda _: self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING))
        self.engine.start()
        self._server.start()
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        return self

    def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    def shutdown(self, grace: float = 3.0, stop_engine: bool = True) -> None:
        """Health goes NOT_SERVING and new calls are refused; the engine aborts what is in flight, so each open
        stream gets its terminal response (finish ABORT); calls still open after `grace` seconds are cancelled.
        stop_engine=False leaves the engine running for its other front ends."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.health.enter_graceful_shutdown()
        done = self._server.stop(grace)
        if stop_engine:
            self.engine.shutdown(timeout=grace)
        else:  # the engine serves on: this server's health no longer follows it
            self._unhook()
        done.wait(grace + 1.0)
        if self.metrics is not None:
            self.metrics.close()

    def wait(self, timeout: float | None = None) -> bool:
        return self._server.wait_for_termination(timeout)


@contextlib.contextmanager
def until_signal(announce, alive=lambda: True):
    """Runs the block (start or announce the servers in it), then waits until SIGINT or SIGTERM (or until alive() is
    false: the servers' process died). The handlers are in place before the block runs, so a signal right after a
    server announces itself is not lost; the previous handlers come back on exit, so a second signal during the
    caller's shutdown acts as usual. Call from the main thread.

    While serving, what exists before the servers start (the model, the compiled steps, the engine) is kept out of
    the cyclic garbage collector's scans (gc.freeze, after a collection), as vLLM's engine does: otherwise its
    collections, set off by the few objects each streamed token allocates, rescan all of it, and at a large batch
    that rescanning takes much of the engine loop's host time. Unfrozen on exit."""
    # The handler only appends to a list: Event.set takes a lock, and a handler that interrupts Event.wait in this
    # same thread while it holds that lock (a second signal in quick succession) would deadlock on it.
    received = []
    previous = {sig: signal.signal(sig, lambda sig, _: received.append(sig)) for sig in (signal.SIGINT, signal.SIGTERM)}
    gc.collect()
    gc.freeze()
    try:
        yield
        while not received and alive():
            time.sleep(0.2)  # a signal ends the sleep; its handler runs in this (the main) thread
        announce("hcfjax serve: shutting down")
    finally:
        gc.unfreeze()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
