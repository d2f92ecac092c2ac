"""The OpenAI-compatible HTTP front end over an Engine (FastAPI on uvicorn), beside the gRPC server.

    engine = Engine(hcfjax.load(), EngineConfig(max_slots=16))
    server = HTTPServer(engine, port=8000).start()       # starts the engine's loop too
    # POST /v1/completions, /v1/chat/completions (streamed as server-sent events or not), GET /v1/models, /health
    server.shutdown()

Requests go to the same Engine as gRPC's (both can serve one engine: hcfjax.serving.front_process). The wait for
a request's events (a queue the engine thread fills) runs on a thread pool sized like the gRPC server's, one thread
per request.
A client that disconnects has its request aborted, which frees its pages: a stream notices when its connection
closes, a non-streamed request when it polls the connection (every POLL_S while it waits).

Before a request is read, hcfjax.serving.guards checks its API key (with --api-key: 401 before the body is read) and
its size (413 past max_body_bytes, from Content-Length or while a chunked body is read).

Errors are OpenAI's error object {"error": {"message", "type", "param", "code"}}: 400 invalid_request_error for bad
parameters (code context_length_exceeded for a prompt or max_tokens beyond the context), 401 without the
--api-key bearer token, 404 model_not_found, 413 body_too_large, 429 rate_limit_error when the queue is full, 503
unavailable while shutting down, 500 server_error when the engine fails the request. Once a stream has started, an
error arrives as one more event, `data: {"error": {...}}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import queue
import secrets
import socket
import threading
import time
from concurrent import futures

import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest

from hcfjax.engine import Engine, EngineStopped, FinishReason, InvalidRequest, Output, QueueFull, Request, Usage
from hcfjax.engine.request import next_output
from hcfjax.frontdoor import SEEDS, new_request_id, sampling_params
from hcfjax.serving.chat_template import ChatTemplate, TemplateError
from hcfjax.serving.guards import DEFAULT_MAX_BODY_BYTES, HTTPGuard
from hcfjax.serving.metrics import Metrics
from hcfjax.serving.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    message_text,
    sse,
    usage_json,
)

log = logging.getLogger("hcfjax.serving")

POLL_S = 0.5  # how often a request waiting on the engine checks its client (non-streamed) or lets go of its thread
FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}
# HTTP refusals counted in Metrics.rejected under the gRPC server's code names, so both front ends share the counter
REJECTED = {
    400: "INVALID_ARGUMENT",
    401: "UNAUTHENTICATED",
    404: "NOT_FOUND",
    413: "RESOURCE_EXHAUSTED",  # as gRPC answers a message over its size limit
    429: "RESOURCE_EXHAUSTED",
    503: "UNAVAILABLE",
}


class _Call:
    """One request in flight: its engine request and the one metrics record of its end."""

    def __init__(self, service: OpenAIService, req: Request):
        self.service, self.req = service, req
        self._recorded = threading.Lock()

    def end(self, finish: FinishReason, usage: Usage | None = None) -> None:
        """Aborts the engine request if it still runs (client gone, error) and records how it ended."""
        if not self.req.done:
            self.service.engine.abort(self.req.id)
        metrics = self.service.metrics
        if metrics is not None and self._recorded.acquire(blocking=False):
            out = Output(self.req.id, [], "", finish, usage or self.req.usage())
            metrics.observe_finish(out, self.req)

    async def pieces(self, http: HTTPRequest | None):
        """(text, finish, usage) as the engine streams: finish is None until the last piece. `http`: poll this
        connection and abort when its client has gone (non-streamed)."""
        loop = asyncio.get_running_loop()
        check = loop.time() + POLL_S
        while True:
            try:
                out = await loop.run_in_executor(self.service.pool, next_output, self.req.events, POLL_S)
            except queue.Empty:
                out = None
            if http is not None and loop.time() >= check:
                check = loop.time() + POLL_S
                if await http.is_disconnected():
                    self.end(FinishReason.ABORT)
                    return
            if out is None:
                continue
            if out.finish is None:
                if out.text:
                    yield out.text, None, None
                continue
            if out.text and out.finish in (FinishReason.ERROR, FinishReason.ABORT):
                yield out.text, None, None  # text merged into the failure's event (next_output) goes out first
            self.end(out.finish, out.usage)
            if out.finish is FinishReason.ERROR:
                raise APIError(500, f"the engine failed on this request: {out.error}", "server_error")
            if out.finish is FinishReason.ABORT:
                raise APIError(503, "the server is shutting down", "unavailable", code="shutting_down")
            yield out.text, FINISH[out.finish], out.usage
            return


class _EventStream(StreamingResponse):
    """A server-sent-event response that ends its call however the stream ends (a client disconnect cancels the
    stream between events, where the body generator's own cleanup would wait for garbage collection)."""

    def __init__(self, content, call: _Call):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.call = call

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            self.call.end(FinishReason.ABORT)  # a no-op when it has ended already


class OpenAIService:
    """The endpoints' logic over one engine; create_app() routes to it."""

    def __init__(
        self,
        engine: Engine,
        model_name: str,
        chat_template: ChatTemplate | None = None,
        metrics: Metrics | None = None,
    ):
        self.engine, self.model_name, self.metrics = engine, model_name, metrics
        self.chat_template = chat_template or ChatTemplate()
        c = engine.config
        self.pool = futures.ThreadPoolExecutor(c.dp * c.max_slots + c.max_queue + 8, thread_name_prefix="hcfjax-http")
        self.created = int(time.time())
        self.stopping = False

    # -- validation: request body -> engine.submit arguments -----------------------------------------------------
    def check(self, body) -> None:
        """The API key and the body's size were checked before the body was read (guards.HTTPGuard)."""
        if self.stopping:
            raise APIError(503, "the server is shutting down", "unavailable", code="shutting_down")
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server has {self.model_name!r}",
                           "invalid_request_error", "model", "model_not_found")  # fmt: skip
        body.check_params()

    async def submit(self, body, prompt, max_tokens: int | None, request_id: str, names: dict[str, str]) -> _Call:
        """Hands the request to the engine (its checks and the prompt's tokenization run on the pool, off the event
        loop); names: the engine's parameter names that this endpoint spells differently."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) > 1:
                raise bad_request("one prompt per request (batches of prompts are not supported)", names["prompt"])
            prompt = prompt[0]
        try:
            sampling = sampling_params(body.temperature, body.top_k, body.top_p, body.min_p)
            eos = [] if body.ignore_eos else list(self.engine.cfg.eos_token_ids)
            submit = functools.partial(
                self.engine.submit,
                prompt,
                sampling=sampling,
                max_new_tokens=max_tokens,
                stop_token_ids=eos + list(body.stop_token_ids or []),
                stop=body.stop,
                seed=secrets.randbelow(SEEDS) if body.seed is None else body.seed,
                request_id=request_id,
            )
            req = await asyncio.get_running_loop().run_in_executor(self.pool, submit)
        except InvalidRequest as e:
            # (the message names the token limit as this endpoint spells it)
            message = str(e).replace("max_new_tokens", names["max_new_tokens"])
            raise bad_request(message, names.get(e.param, e.param), e.code) from None
        except QueueFull as e:
            raise APIError(429, str(e), "rate_limit_error", code="queue_full") from None
        except EngineStopped as e:
            raise APIError(503, str(e), "unavailable", code="shutting_down") from None
        return _Call(self, req)

    @contextlib.contextmanager
    def refusals(self):
        """Counts the requests refused before they reach the engine (create_app counts malformed bodies)."""
        try:
            yield
        except APIError as e:
            self.count_refusal(e.status)
            raise

    def count_refusal(self, status: int) -> None:
        if self.metrics is not None and status in REJECTED:
            self.metrics.rejected.labels(REJECTED[status]).inc()

    # -- the endpoints ---------------------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, http: HTTPRequest):
        with self.refusals():
            self.check(body)
            names = {"prompt": "prompt", "max_new_tokens": "max_tokens"}
            call = await self.submit(body, body.prompt, body.max_tokens, new_request_id("cmpl"), names)
        return await self.respond(call, body, "text_completion", chat=False, http=http)

    async def chat_completions(self, body: ChatCompletionRequest, http: HTTPRequest):
        with self.refusals():
            self.check(body)
            if not body.messages:
                raise bad_request("messages is empty", "messages")
            messages = [{**m.model_dump(), "content": message_text(m, i)} for i, m in enumerate(body.messages)]
            try:
                prompt = self.chat_template.render(messages)
            except TemplateError as e:
                raise bad_request(str(e), "messages") from None
            newer = body.max_completion_tokens is not None
            names = {"prompt": "messages", "max_new_tokens": "max_completion_tokens" if newer else "max_tokens"}
            max_tokens = body.max_completion_tokens if newer else body.max_tokens
            call = await self.submit(body, prompt, max_tokens, new_request_id("chatcmpl"), names)
        return await self.respond(call, body, "chat.completion", chat=True, http=http)

    async def respond(self, call: _Call, body, obj: str, chat: bool, http: HTTPRequest):
        head = {"id": call.req.id, "object": obj, "created": int(time.time()), "model": self.model_name}
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return _EventStream(self.events(call, head, chat, include_usage), call)
        try:
            pieces = [piece async for piece in call.pieces(http)]
        finally:
            call.end(FinishReason.ABORT)  # a no-op after a normal end; here when the handler is cancelled
        if not pieces or pieces[-1][1] is None:  # the client went away: nobody reads this
            return JSONResponse(bad_request("the client disconnected").body(), 499)
        text, (_, finish, usage) = "".join(p[0] for p in pieces), pieces[-1]
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice |= {"logprobs": None, "finish_reason": finish}
        return JSONResponse({**head, "choices": [choice], "usage": usage_json(usage)})

    async def events(self, call: _Call, head: dict, chat: bool, include_usage: bool):
        head = head | {"object": "chat.completion.chunk"} if chat else head
        extra = {"usage": None} if include_usage else {}

        def chunk(text: str, finish: str | None, first: bool = False) -> str:
            if chat:
                delta = {"role": "assistant", "content": text} if first else {"content": text} if text else {}
                choice = {"index": 0, "delta": delta}
            else:
                choice = {"index": 0, "text": text}
            return sse({**head, "choices": [choice | {"logprobs": None, "finish_reason": finish}], **extra})

        try:
            if chat:
                yield chunk("", None, first=True)
            last = None
            async for text, finish, usage in call.pieces(None):
                if text and finish is not None:  # the last text in its own chunk, then the finish reason
                    yield chunk(text, None)
                yield chunk("" if finish is not None else text, finish)
                last = usage
            if include_usage:
                yield sse({**head, "choices": [], "usage": usage_json(last)})
            yield "data: [DONE]\n\n"
        except APIError as e:
            yield sse(e.body())

    def models(self) -> dict:
        model = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "hcfjax"}
        return {"object": "list", "data": [model | {"max_model_len": self.engine.max_model_len}]}


def create_app(service: OpenAIService, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
    """The FastAPI app behind its guards (API key, body size), an ASGI app."""
    app = FastAPI(title="hcfjax", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(APIError)
    async def _api_error(_, e: APIError):
        return JSONResponse(e.body(), e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: HTTPRequest, e: RequestValidationError):
        err = e.errors()[0]
        service.count_refusal(400)
        if err.get("type") == "json_invalid":  # its loc is a character offset, not a parameter
            return JSONResponse(bad_request(f"the body is not valid JSON: {err.get('msg', '')}").body(), 400)
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        json_kind = kind == "application/json" or kind.endswith("+json")  # what FastAPI reads as JSON
        if err.get("loc") == ("body",) and not json_kind:
            how = f"not as {kind!r}" if kind else "not without a Content-Type"
            return JSONResponse(bad_request(f"the body must be JSON sent as application/json, {how}").body(), 400)
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        param = loc[0] if loc else None  # the top-level field; the message gives the full location
        return JSONResponse(bad_request(f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid')}", param).body(), 400)

    @app.exception_handler(HTTPException)
    async def _http(_, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        if e.status_code == 413:  # a chunked body passed the limit while it was read: the rest is not read
            service.count_refusal(413)
            body = APIError(413, str(e.detail), kind, code="body_too_large").body()
            return JSONResponse(body, 413, headers={"Connection": "close"})
        return JSONResponse(APIError(e.status_code, str(e.detail), kind).body(), e.status_code)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        return await service.completions(body, http)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, http: HTTPRequest):
        return await service.chat_completions(body, http)

    @app.get("/v1/models")
    async def models():
        return service.models()

    @app.get("/health")
    async def health():
        if service.stopping:
            return JSONResponse({"status": "shutting_down"}, 503)
        if not service.engine.ready():  # e.g. a PD router with no prefill or no decode worker up
            return JSONResponse({"status": "not_ready"}, 503)
        return {"status": "ok"}

    return HTTPGuard(app, api_key=api_key, max_body_bytes=max_body_bytes, on_refusal=service.count_refusal)


class HTTPServer:
    """uvicorn serving create_app() on a background thread, on host:port (0: a free one; `self.port` is the bound
    port). model_name: what /v1/models lists and requests must name (default: the checkpoint directory's name).
    api_key: what clients must send as `Authorization: Bearer KEY` (None: no auth); max_body_bytes: the largest
    request body read (413 beyond)."""

    def __init__(
        self,
        engine: Engine,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        model_name: str | None = None,
        chat_template: ChatTemplate | None = None,
        metrics: Metrics | None = None,
        api_key: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    ):
        self.engine = engine
        path = engine.model.path
        name = model_name or (path.rstrip("/").rsplit("/", 1)[-1] if path else "hcfjax")
        template = chat_template or ChatTemplate.for_checkpoint(path)
        self.service = OpenAIService(engine, name, template, metrics)
        self.app = create_app(self.service, api_key, max_body_bytes)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as e:
            self._sock.close()
            raise OSError(f"cannot listen on {host}:{port}: {e}") from None
        self.host, self.port = host, self._sock.getsockname()[1]
        config = uvicorn.Config(self.app, lifespan="off", log_level="warning", timeout_graceful_shutdown=3)
        self._uvicorn = uvicorn.Server(config)
        self._thread: threading.Thread | None = None
        self._stopped = False

    def start(self, timeout: float = 10.0) -> HTTPServer:
        """Starts the engine's loop and the server; returns once it accepts connections."""
        self.engine.start()
        self._thread = threading.Thread(
            target=self._uvicorn.run, kwargs={"sockets": [self._sock]}, name="hcfjax-http", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise OSError(f"the HTTP server did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        return self

    def shutdown(self, grace: float = 3.0, stop_engine: bool = True) -> None:
        """New requests get 503 and /health says so; the engine aborts what is in flight, so each open stream gets
        its error event and ends; connections still open after `grace` seconds are closed. stop_engine=False leaves
        the engine running for its other front ends."""
        if self._stopped:
            return
        self._stopped = self.service.stopping = True
        if stop_engine:
            self.engine.shutdown(timeout=grace)
        self._uvicorn.config.timeout_graceful_shutdown = grace
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(grace + 2.0)
        self.service.pool.shutdown(wait=False, cancel_futures=True)
