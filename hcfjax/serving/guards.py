"""What the servers check before they read a request: its API key and its size.

    app = HTTPGuard(app, api_key="KEY", max_body_bytes=4 << 20, on_refusal=count)   # ASGI, around the HTTP app
    grpc.server(pool, interceptors=[ApiKeyInterceptor("KEY", on_refusal=count)])      # the gRPC Generation service

HTTP: with a key, every path but /health needs `Authorization: Bearer KEY`; a request without it gets 401 before its
body is read. A body over max_body_bytes gets 413: at once when its Content-Length says so, else as soon as the
bytes read pass the limit (a chunked body), so no more than the limit (plus one read) is ever held. gRPC: with a key,
calls to the Generation service need the metadata `authorization: Bearer KEY` (UNAUTHENTICATED otherwise, before the
request message is parsed); health and reflection stay open. Keys are compared in constant time.

gRPC's own maximum_concurrent_rpcs refuses a call after the interceptors have run and tells nobody, so a refusal
could not be counted; ConcurrencyLimit refuses Generation calls at the limit itself (and says so), reading how many
calls hold a thread from a CountingPool, and leaves gRPC's limit a few calls higher as a backstop.

A request message that does not parse (a string field that is not UTF-8, a broken wire format) would end in gRPC's
own INTERNAL "Exception deserializing request!"; add_generation_service parses it itself and answers
INVALID_ARGUMENT, as for any other bad input.
"""

from __future__ import annotations

import functools
import hmac
import json
import threading
from concurrent import futures

import grpc
from fastapi.exceptions import HTTPException
from google.protobuf.message import DecodeError

from hcfjax.serving import hcfjax_pb2 as pb

DEFAULT_MAX_BODY_BYTES = 4 << 20  # 4 MiB, gRPC's own default for a received message
OPEN_PATHS = frozenset({"/health"})  # served without the key (load balancers' probes)
GENERATION_PREFIX = "/hcfjax.v1.Generation/"
PD_PREFIX = "/hcfjax.pd.v1."  # a PD worker's Prefill and Worker services
REFUSED_KEY = "a valid API key is needed (Authorization: Bearer KEY)"
REFUSED_KEY_GRPC = "a valid API key is needed (metadata authorization: Bearer KEY)"


def key_matches(header: str | bytes | None, api_key: str) -> bool:
    """Whether an authorization header (or gRPC metadata value) is `Bearer api_key`, compared in constant time."""
    given = header.encode("utf-8", "surrogateescape") if isinstance(header, str) else header or b""
    return hmac.compare_digest(given, b"Bearer " + api_key.encode())


def body_too_large(limit: int) -> str:
    return f"the request body is larger than the server's limit of {limit} bytes (--max-body-bytes)"


class BodyTooLarge(HTTPException):
    """Raised from the guarded receive() when a body passes the limit; the app answers it as 413."""

    def __init__(self, limit: int):
        super().__init__(413, body_too_large(limit))


class HTTPGuard:
    """ASGI middleware: the API key, then the body's size, before the app sees a request. on_refusal(status) is told
    of each refusal it answers itself (401, and 413 from Content-Length); the app answers BodyTooLarge."""

    def __init__(self, app, *, api_key: str | None, max_body_bytes: int, on_refusal=lambda status: None):
        self.app, self.api_key, self.max_body_bytes, self.on_refusal = app, api_key, max_body_bytes, on_refusal

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])  # names arrive lower-case; a repeated header keeps its last value
        if self.api_key is not None and scope["path"] not in OPEN_PATHS:
            if not key_matches(headers.get(b"authorization"), self.api_key):
                return await self.refuse(send, 401, REFUSED_KEY, "invalid_request_error", "invalid_api_key")
        limit = self.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await self.refuse(send, 413, body_too_large(limit), "invalid_request_error", "body_too_large")
        read = 0

        async def limited_receive():
            nonlocal read
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
                if read > limit:
                    raise BodyTooLarge(limit)
            return message

        await self.app(scope, limited_receive, send)

    async def refuse(self, send, status: int, message: str, kind: str, code: str) -> None:
        """Answers with OpenAI's error object and closes the connection (a body may still be on its way)."""
        self.on_refusal(status)
        error = {"error": {"message": message, "type": kind, "param": None, "code": code}}
        body = json.dumps(error).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class ApiKeyInterceptor(grpc.ServerInterceptor):
    """Refuses calls to the `guarded` services (method prefixes: the Generation service, and a PD worker's own)
    without `authorization: Bearer KEY` metadata (UNAUTHENTICATED); the refusal parses no request message. Health
    and reflection stay open. on_refusal(code_name) is told of each."""

    def __init__(self, api_key: str, on_refusal=lambda code: None, guarded: tuple[str, ...] = (GENERATION_PREFIX,)):
        self.api_key, self.on_refusal, self.guarded = api_key, on_refusal, guarded

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or not details.method.startswith(self.guarded):
            return handler
        given = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
        if key_matches(given, self.api_key):
            return handler
        self.on_refusal(grpc.StatusCode.UNAUTHENTICATED.name)
        return refusing(handler, grpc.StatusCode.UNAUTHENTICATED, REFUSED_KEY_GRPC)


class CountingPool(futures.ThreadPoolExecutor):
    """A thread pool that knows how many of its tasks have not finished: a gRPC server runs each call as one task."""

    def __init__(self, max_workers: int, thread_name_prefix: str = ""):
        super().__init__(max_workers, thread_name_prefix=thread_name_prefix)
        self._lock = threading.Lock()
        self.unfinished = 0

    def submit(self, fn, /, *args, **kwargs):
        with self._lock:
            self.unfinished += 1
        try:
            future = super().submit(fn, *args, **kwargs)
        except BaseException:
            self._finished(None)
            raise
        future.add_done_callback(self._finished)
        return future

    def _finished(self, _future) -> None:
        with self._lock:
            self.unfinished -= 1


class ConcurrencyLimit(grpc.ServerInterceptor):
    """Refuses a Generation call (RESOURCE_EXHAUSTED) while `limit` calls hold the pool's threads; other services
    (health, reflection) pass, within the pool's spare threads. on_refusal(code_name) is told of each refusal."""

    def __init__(self, pool: CountingPool, limit: int, on_refusal=lambda code: None):
        self.pool, self.limit, self.on_refusal = pool, limit, on_refusal

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or not details.method.startswith(GENERATION_PREFIX) or self.pool.unfinished < self.limit:
            return handler
        self.on_refusal(grpc.StatusCode.RESOURCE_EXHAUSTED.name)
        message = f"the server is at its limit of {self.limit} concurrent calls; try again later"
        return refusing(handler, grpc.StatusCode.RESOURCE_EXHAUSTED, message)


SPARE_THREADS = 8  # beyond the Generate calls' limit: refusals, health and reflection


def guarded_server(limit: int, api_key: str | None, on_refusal, thread_name: str, options=()) -> grpc.Server:
    """A gRPC server of `limit` concurrent Generation calls, refused past it (RESOURCE_EXHAUSTED) and, with an API
    key, without it (UNAUTHENTICATED), each refusal told to on_refusal(code_name); SPARE_THREADS more threads serve
    refusals, health and reflection, and gRPC's own limit stays that much higher as a backstop."""
    pool = CountingPool(limit + SPARE_THREADS, thread_name_prefix=thread_name)
    guards = [ApiKeyInterceptor(api_key, on_refusal)] if api_key is not None else []
    return grpc.server(
        pool,
        interceptors=[*guards, ConcurrencyLimit(pool, limit, on_refusal)],
        options=list(options),
        maximum_concurrent_rpcs=limit + SPARE_THREADS,
    )


def refusing(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends the call with `code`; it leaves the request unparsed."""

    def refuse(request, context):
        context.abort(code, message)

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse, response_serializer=handler.response_serializer)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse, response_serializer=handler.response_serializer)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse, response_serializer=handler.response_serializer)
    return grpc.stream_stream_rpc_method_handler(refuse, response_serializer=handler.response_serializer)


class Unparsable:
    """A request message that did not parse, with the parser's error."""

    def __init__(self, error: str):
        self.error = error


def parse_or_keep_error(message_type):
    """A request deserializer that returns Unparsable for bytes that are not a `message_type` (gRPC's own would end
    the call with INTERNAL)."""

    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except DecodeError as e:
            return Unparsable(str(e))

    return parse


def refusing_unparsable(method, on_refusal):
    """A servicer method that ends the call with INVALID_ARGUMENT when its request did not parse."""

    @functools.wraps(method)
    def handle(request, context):
        if isinstance(request, Unparsable):
            on_refusal(grpc.StatusCode.INVALID_ARGUMENT.name)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request message does not parse: {request.error}")
        return method(request, context)

    return handle


def add_generation_service(servicer, server: grpc.Server, on_refusal=lambda code: None) -> None:
    """pb_grpc.add_GenerationServicer_to_server, with request messages that do not parse refused as
    INVALID_ARGUMENT (on_refusal is told of each)."""
    handlers = {
        "Generate": grpc.unary_stream_rpc_method_handler(
            refusing_unparsable(servicer.Generate, on_refusal),
            request_deserializer=parse_or_keep_error(pb.GenerateRequest),
            response_serializer=pb.GenerateResponse.SerializeToString,
        ),
        "Tokenize": grpc.unary_unary_rpc_method_handler(
            refusing_unparsable(servicer.Tokenize, on_refusal),
            request_deserializer=parse_or_keep_error(pb.TokenizeRequest),
            response_serializer=pb.TokenizeResponse.SerializeToString,
        ),
    }
    service = pb.DESCRIPTOR.services_by_name["Generation"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)
