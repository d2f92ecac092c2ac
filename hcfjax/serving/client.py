"""A small client of the Generation service.

    channel, stub = connect("127.0.0.1", 50051)
    for chunk in generate_stream(stub, "def fib(n):", max_new_tokens=32):
        print(chunk.text, end="")
    result = generate(stub, "class LRUCache:", max_new_tokens=32, temperature=0.7, seed=1)

Errors arrive as grpc.RpcError (e.code(), e.details()) when the stream is read. A server started with --api-key wants
api_key=KEY on each call (sent as the metadata `authorization: Bearer KEY`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import grpc

from hcfjax.serving import hcfjax_pb2 as pb
from hcfjax.serving import hcfjax_pb2_grpc as pb_grpc


def connect(host: str = "127.0.0.1", port: int = 50051, *, ready_timeout: float | None = None):
    """(channel, stub) for host:port; with ready_timeout, waits that long for the server (grpc.FutureTimeoutError)."""
    channel = grpc.insecure_channel(f"{host}:{port}")
    if ready_timeout is not None:
        grpc.channel_ready_future(channel).result(timeout=ready_timeout)
    return channel, pb_grpc.GenerationStub(channel)


def wait_serving(channel, timeout: float, service: str = "") -> None:
    """Waits until the server's gRPC health says SERVING for `service` ("": the server as a whole). A PD router
    listens before its workers answer and says NOT_SERVING until a prefill and a decode worker do; its requests fail
    with UNAVAILABLE meanwhile. TimeoutError after `timeout` seconds."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health, deadline = health_pb2_grpc.HealthStub(channel), time.monotonic() + timeout
    while True:
        try:
            request = health_pb2.HealthCheckRequest(service=service)
            if health.Check(request, timeout=5.0).status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass  # not listening yet, or busy
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server did not say SERVING within {timeout:.0f} s")
        time.sleep(0.1)


def make_request(
    prompt: str | Sequence[int],
    *,
    max_new_tokens: int | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float | None = None,
    min_p: float = 0.0,
    seed: int = 0,
    stop_token_ids: Sequence[int] | None = None,
    stop: Sequence[str] | None = None,
    ignore_eos: bool = False,
    request_id: str = "",
) -> pb.GenerateRequest:
    """A GenerateRequest: prompt is text or token ids; None leaves a field at the server's default. Raises
    ValueError or TypeError for a value the message cannot hold (a seed outside uint32, top_k outside int32)."""
    req = pb.GenerateRequest(
        sampling=pb.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p),
        stop_token_ids=stop_token_ids or [],
        stop=stop or [],
        ignore_eos=ignore_eos,
        seed=seed,
        request_id=request_id,
        max_new_tokens=max_new_tokens,
    )
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    return req


def auth_metadata(api_key: str | None) -> list[tuple[str, str]] | None:
    """The call metadata that carries an API key (None: none)."""
    return None if api_key is None else [("authorization", f"Bearer {api_key}")]


class _KeyOnEveryCall(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, api_key: str):
        self.metadata = auth_metadata(api_key)

    def _with_key(self, continuation, details, request):
        metadata = [*(details.metadata or ()), *self.metadata]
        return continuation(details._replace(metadata=metadata), request)

    intercept_unary_unary = intercept_unary_stream = _with_key
    intercept_stream_unary = intercept_stream_stream = _with_key


def with_api_key(channel: grpc.Channel, api_key: str | None) -> grpc.Channel:
    """`channel`, sending `api_key` with every call (unchanged for None)."""
    return channel if api_key is None else grpc.intercept_channel(channel, _KeyOnEveryCall(api_key))


def generate_stream(
    stub, prompt: str | Sequence[int], *, timeout: float | None = None, api_key: str | None = None, **params
):
    """Starts a Generate call and returns it: an iterator of GenerateResponse chunks (the last has finish_reason
    set) that is also the grpc call, so `.cancel()` ends it. params: those of make_request."""
    return stub.Generate(make_request(prompt, **params), timeout=timeout, metadata=auth_metadata(api_key))


@dataclasses.dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # stop | length | abort
    usage: pb.Usage
    chunks: int


def generate(
    stub, prompt: str | Sequence[int], *, timeout: float | None = None, api_key: str | None = None, **params
) -> Completion:
    """Runs a Generate call to its end and joins the chunks."""
    text, ids, last, n = [], [], None, 0
    for chunk in generate_stream(stub, prompt, timeout=timeout, api_key=api_key, **params):
        text.append(chunk.text)
        ids.extend(chunk.token_ids)
        last, n = chunk, n + 1
    reason = pb.FinishReason.Name(last.finish_reason).removeprefix("FINISH_REASON_").lower()
    return Completion("".join(text), ids, reason, last.usage, n)


def tokenize(stub, text: str, *, timeout: float | None = None, api_key: str | None = None) -> list[int]:
    request = pb.TokenizeRequest(text=text)
    return list(stub.Tokenize(request, timeout=timeout, metadata=auth_metadata(api_key)).token_ids)
