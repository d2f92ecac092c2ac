"""An Engine served to front ends in another process, over a pipe (a multiprocessing Connection).

    parent, child = multiprocessing.Pipe()
    host = EngineHost(engine, parent).start()              # the engine's process
    engine = LinkedEngine(child, *host.front())            # the front end's: what Server / HTTPServer take

The engine's loop then shares its interpreter with nothing but the pipe's reader: the front ends' threads (one per
gRPC stream, the HTTP event loop, tokenizing prompts, building responses) run in their own process, so they no
longer hold the GIL the loop needs between steps. vLLM's API server and SGLang's tokenizer manager are split from
their engines for the same reason.

LinkedEngine.submit runs hcfjax.frontdoor's checks and tokenizes on the front end's side, as RemoteEngine does, then
hands the checked request over and waits for the engine to queue it (QueueFull, EngineStopped and an id in use come
back as the same exceptions). The engine's Outputs for a step cross the pipe as one message, after the step
(Engine.after_step); the front end's reader puts each on its request's queue. If the engine's process goes away,
every request in flight ends with an error and the front end is no longer ready.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable

from hcfjax.engine import EngineStopped, FinishReason, InvalidRequest, Output, QueueFull, Usage
from hcfjax.engine.hooks import Hooks
from hcfjax.engine.request import stream_events
from hcfjax.frontdoor import Checked, FrontDoor, Submitting
from hcfjax.serving.remote import ModelFront, RemoteLimits

log = logging.getLogger("hcfjax.serving")

REFUSALS = {cls.__name__: cls for cls in (InvalidRequest, QueueFull, EngineStopped, RuntimeError)}


class NoAnswer(EngineStopped):
    """The engine's process did not answer a call in time."""


_END = object()  # ends a LinkedEngine's abort sender


def _wire(out: Output) -> tuple:
    u = out.usage
    finish = None if out.finish is None else out.finish.value
    usage = (u.prompt_tokens, u.output_tokens, u.ttft_s, u.draft_tokens, u.accepted_draft_tokens)
    return out.request_id, out.token_ids, out.text, finish, usage, out.error


def _refusal(e: Exception) -> tuple:
    return type(e).__name__, str(e), getattr(e, "param", None), getattr(e, "code", None)


def _receive(conn, take: Callable) -> None:
    """take(*message) for each message on `conn` until the pipe ends; one that fails is logged and skipped."""
    while True:
        try:
            message = conn.recv()
        except (OSError, EOFError):
            return
        try:
            take(*message)
        except Exception:  # noqa: BLE001 - one bad message does not end the link
            log.exception("the engine link could not take a message")


class EngineHost:
    """Serves `engine` to the LinkedEngine at the other end of `conn`: its requests go in through Engine.add, with
    this host as their events sink, and each step's Outputs go back as one message."""

    def __init__(self, engine, conn):
        self.engine, self.conn = engine, conn
        self._outbox: list[tuple] = []
        self._outbox_lock = threading.Lock()
        self._send_lock = threading.RLock()  # (flush holds it across taking a batch and sending it)
        self._live: set[str] = set()  # ids the front end added that have not ended
        self._thread = threading.Thread(target=self._serve, name="hcfjax-engine-link", daemon=True)
        self._unhook = (engine.after_step(self.flush), engine.on_failure(self._failed))

    def start(self) -> EngineHost:
        self._thread.start()
        return self

    def front(self) -> tuple[ModelFront, int, RemoteLimits]:
        """What a LinkedEngine over this engine is built with (after its pipe): the model without its weights, the
        context, and the limits the servers size their thread pools from."""
        e, c = self.engine, self.engine.config
        model = ModelFront(e.cfg, e.model.tokenizer, e.model.path)
        return model, e.max_model_len, RemoteLimits(c.max_slots, c.dp, c.max_queue)

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def put(self, out: Output) -> None:
        """A request's Output (the engine calls this as it would put on the request's own queue)."""
        with self._outbox_lock:
            self._outbox.append(_wire(out))
            if out.finish is not None:
                self._live.discard(out.request_id)

    def flush(self) -> None:
        """Sends the Outputs put since the last flush, as one message (batches leave in the order they were
        taken, whichever thread flushes)."""
        with self._send_lock:
            with self._outbox_lock:
                batch, self._outbox = self._outbox, []
            if batch:
                self._send(("outputs", batch))

    def _failed(self, error: str) -> None:
        """The engine's loop failed: its requests' last Outputs (each with the error) go first, then the failure."""
        self.flush()
        self._send(("failed", error))

    def _send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self.conn.send(message)
        except (OSError, EOFError):  # the front end has gone: _serve sees the end of the pipe and aborts its requests
            pass

    def _serve(self) -> None:
        _receive(self.conn, self._take)
        with self._outbox_lock:  # the front end is gone: nobody reads what its requests would produce
            orphans, self._live = list(self._live), set()
        for rid in orphans:
            self.engine.abort(rid)
        for unhook in self._unhook:  # (their ABORTs need no flush: nobody reads them)
            unhook()

    def _take(self, kind: str, *rest) -> None:
        if kind == "abort":
            self.engine.abort(rest[0])
            return
        if kind == "route":  # a PD decode worker's note of the router's prefill worker for a request (None: drop it)
            rid, address = rest
            routes = self.engine.remote.routes
            if address is None:
                routes.pop(rid, None)
            else:
                routes[rid] = address
            return
        call, *args = rest
        try:
            self._send(("reply", call, True, self._answer(kind, *args)))
        except (InvalidRequest, QueueFull, EngineStopped) as e:
            self._send(("reply", call, False, _refusal(e)))
        except Exception as e:  # noqa: BLE001 - the front end gets the error; the link goes on
            log.exception("the engine link's %s failed", kind)
            self._send(("reply", call, False, ("RuntimeError", f"{type(e).__name__}: {e}", None, None)))

    def _answer(self, kind: str, *args):
        if kind == "submit":
            rid, checked = args
            with self._outbox_lock:
                self._live.add(rid)
            try:
                self.engine.add(rid, checked, events=self)
            except InvalidRequest:  # its id is in use: the request that holds it stays live
                raise
            except Exception:
                with self._outbox_lock:
                    self._live.discard(rid)
                raise
            return None
        if kind == "snapshot":
            return self.engine.snapshot()
        if kind == "shutdown":
            self.engine.shutdown(timeout=args[0])
            self.flush()  # the last Outputs (the aborts) go out before the reply
            return None
        raise ValueError(f"unknown engine link message {kind!r}")


class LinkedRequest:
    """A request submitted through a LinkedEngine, as an engine Request to the front ends: id, events, done,
    usage() and the times its tokens arrived here (time.monotonic())."""

    def __init__(self, request_id: str, prompt_tokens: int):
        self.id = request_id
        self.events: queue.SimpleQueue[Output] = queue.SimpleQueue()
        self.done = False
        self._usage = Usage(prompt_tokens)
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None

    def usage(self) -> Usage:
        return self._usage


class LinkedRoutes:
    """A PD decode worker's notes of the router's prefill worker for each request (hcfjax.pd.decode.RemotePrefill's
    `routes`), kept at the engine's end: each note and its removal is sent ahead of what follows it."""

    def __init__(self, send: Callable[[tuple], None]):
        self._send = send

    def __setitem__(self, rid: str, address: str) -> None:
        self._note(rid, address)

    def pop(self, rid: str, default=None):
        """Drops the note at the engine's end. -> default (the note itself is not known here)."""
        self._note(rid, None)
        return default

    def _note(self, rid: str, address: str | None) -> None:
        with contextlib.suppress(EngineStopped):  # the engine is gone: the submit after it says so
            self._send(("route", rid, address))


class LinkedEngine(Submitting):
    """The Engine surface that hcfjax.serving.server and .http use, over the EngineHost at the other end of
    `conn`; requests are checked against `front`'s model and a context of max_model_len, as the engine's door
    would check them, and the servers size their thread pools from `limits`."""

    def __init__(self, conn, front: ModelFront, max_model_len: int, limits: RemoteLimits, timeout_s: float = 60.0):
        self.model, self.cfg, self.config = front, front.cfg, limits
        self.max_model_len = max_model_len
        self.door = FrontDoor(front.cfg, front.tokenizer, max_model_len)
        self.conn, self.timeout_s = conn, timeout_s
        self._lock = threading.Lock()  # the maps below, and the stopping / failure state
        self._send_lock = threading.Lock()
        self._requests: dict[str, LinkedRequest] = {}
        self._calls: dict[int, list] = {}  # call id -> [threading.Event, ok, value]
        self._ids = itertools.count()
        self._stopping = False
        self._ended = False  # the pipe has ended: the engine's process is gone
        self.failure: str | None = None
        self._on_failure = Hooks()
        self._aborts: queue.SimpleQueue = queue.SimpleQueue()  # ids for the sender below; _END ends it
        self.routes = LinkedRoutes(self._send)
        self._reader = threading.Thread(target=self._read, name="hcfjax-engine-link", daemon=True)
        self._reader.start()
        threading.Thread(target=self._send_aborts, name="hcfjax-engine-link-aborts", daemon=True).start()

    # -- the Engine surface ----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Nothing to start: the engine's loop runs in its own process."""

    def ready(self) -> bool:
        return not self._stopping and self.failure is None

    def on_failure(self, tell: Callable[[str], None]) -> Callable[[], None]:
        """As Engine.on_failure: tell(error) runs if the engine fails or goes away. -> a call that removes it."""
        return self._on_failure.add(tell)

    def tokenize(self, text: str) -> list[int]:
        return self.door.encode(text)

    def snapshot(self) -> dict:
        return self._call("snapshot")

    def add(self, rid: str, c: Checked) -> LinkedRequest:
        """Hands a checked request (submit's) to the engine; returns once the engine has queued it."""
        with self._lock:
            if self.failure is not None:
                raise EngineStopped(f"the engine stopped after an error: {self.failure}")
            if self._stopping:
                raise EngineStopped("the engine is shutting down")
            if rid in self._requests:
                raise InvalidRequest(f"request id {rid!r} is in use", "request_id")
            req = self._requests[rid] = LinkedRequest(rid, len(c.prompt))
        try:
            self._call("submit", rid, c)
        except Exception as e:
            with self._lock:
                self._requests.pop(rid, None)
            if isinstance(e, NoAnswer):  # the engine may have queued it all the same: told now, before a retry
                with contextlib.suppress(EngineStopped):
                    self._send(("abort", rid))
            raise
        return req

    def stream(self, request: LinkedRequest, timeout: float | None = None):
        return stream_events(request.events, timeout)

    def abort(self, request_id: str) -> None:
        """Asks the engine to abort the request. Never blocks the caller (the HTTP server's event loop calls it when
        a client goes): a thread of this link's sends it, after whatever was sent before."""
        self._aborts.put(request_id)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Refuses new requests; the engine aborts those in flight (each gets its ABORT event) and stops."""
        with self._lock:
            self._stopping = True
        try:
            self._call("shutdown", timeout, wait=timeout + self.timeout_s)
        except EngineStopped:  # the engine's process is gone already: its requests have ended with an error
            pass

    # -- the pipe --------------------------------------------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self.conn.send(message)
        except (OSError, EOFError, ValueError) as e:  # (ValueError: the connection was closed here)
            raise EngineStopped(f"the engine's process cannot be reached: {e}") from None

    def _call(self, kind: str, *args, wait: float | None = None):
        with self._lock:
            if self._ended:
                raise EngineStopped(f"the engine stopped: {self.failure}")
            call = next(self._ids)
            pending = self._calls[call] = [threading.Event(), False, None]
        self._send((kind, call, *args))
        if not pending[0].wait(self.timeout_s if wait is None else wait):
            self._calls.pop(call, None)
            raise NoAnswer(f"the engine did not answer {kind} within {wait or self.timeout_s:g} s")
        _, ok, value = pending
        if ok:
            return value
        name, message, param, code = value
        if name == "InvalidRequest":
            raise InvalidRequest(message, param, code)
        raise REFUSALS.get(name, EngineStopped)(message)

    def _read(self) -> None:
        _receive(self.conn, self._take)
        self._fail("the engine's process ended", ended=True)
        self._aborts.put(_END)

    def _send_aborts(self) -> None:
        while (rid := self._aborts.get()) is not _END:
            try:
                self._send(("abort", rid))
            except EngineStopped:  # the engine is gone, and its requests with it
                return
            except Exception:  # noqa: BLE001 - the aborts after it still go
                log.exception("the engine link could not send an abort")

    def _take(self, kind: str, *rest) -> None:
        if kind == "outputs":
            for out in rest[0]:
                self._deliver(*out)
        elif kind == "reply":
            call, ok, value = rest
            pending = self._calls.pop(call, None)
            if pending is not None:
                pending[1:] = ok, value
                pending[0].set()
        elif kind == "failed":
            self._fail(rest[0])

    def _deliver(self, rid: str, tokens: list[int], text: str, finish, usage: tuple, error) -> None:
        req = self._requests.get(rid)
        if req is None:
            return
        if tokens:
            req.last_token_time = time.monotonic()
            req.first_token_time = req.first_token_time or req.last_token_time
        req._usage = Usage(*usage)
        reason = None if finish is None else FinishReason(finish)
        if reason is not None:
            req.done = True
            with self._lock:
                self._requests.pop(rid, None)
        req.events.put(Output(rid, tokens, text, reason, req._usage, error))

    def _fail(self, error: str, ended: bool = False) -> None:
        """The engine cannot serve: every request in flight ends with the error (ABORT when the front end was
        shutting down); once the pipe has `ended`, the calls waiting for an answer fail too (the engine's process
        still answers them after its loop failed: a snapshot, a refusal)."""
        with self._lock:
            first = self.failure is None
            if first:
                self.failure = error
            self._ended = self._ended or ended
            reqs, self._requests = list(self._requests.values()), {}
            calls = list(self._calls.values()) if ended else []
            if ended:
                self._calls = {}
        for pending in calls:
            pending[1:] = False, ("EngineStopped", f"the engine stopped: {error}", None, None)
            pending[0].set()
        reason = FinishReason.ABORT if self._stopping else FinishReason.ERROR
        for req in reqs:
            req.done = True
            req.events.put(Output(req.id, [], "", reason, req.usage(), error))
        if first and not self._stopping:
            for tell in self._on_failure:
                tell(error)
