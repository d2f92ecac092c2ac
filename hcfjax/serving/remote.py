"""An Engine's serving surface over a Generation gRPC service (the PD router): what the HTTP front end needs to serve
the OpenAI API through a router as it does over a colocated engine.

    front = load_front(path=None, preset=None)                  # the model's config and tokenizer, no weights
    engine = RemoteEngine("127.0.0.1:50051", front, max_model_len=4096)
    HTTPServer(engine, port=8000).start()

submit() runs hcfjax.frontdoor's checks and tokenizes here, as Engine.submit does (the same InvalidRequest with its
param and code), then starts a Generate call with the prompt's token ids and waits for the service to take it (its
acceptance metadata, hcfjax.serving.server.ACCEPTED, or its first message): a call the service refuses first
(INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE) raises InvalidRequest, QueueFull or EngineStopped as the engine
would. Past that, a thread per call turns its messages into the Output events of a RemoteRequest (the engine
Request's id / events / done / usage()); a call that fails later ends with FinishReason.ERROR. abort() cancels the
call, which the router passes on to its workers (their pages are freed).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from typing import Any

import grpc

from hcfjax.config import ModelConfig
from hcfjax.engine import EngineStopped, FinishReason, InvalidRequest, Output, QueueFull, Usage
from hcfjax.frontdoor import Checked, FrontDoor, Submitting
from hcfjax.serving import hcfjax_pb2 as pb
from hcfjax.serving import hcfjax_pb2_grpc as pb_grpc
from hcfjax.serving.client import auth_metadata
from hcfjax.serving.server import ACCEPTED

FINISHES = {
    pb.FINISH_REASON_STOP: FinishReason.STOP,
    pb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    pb.FINISH_REASON_ABORT: FinishReason.ABORT,
}
REFUSALS = {  # a status before the first message -> what Engine.submit raises for the same cause
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.RESOURCE_EXHAUSTED: QueueFull,
    grpc.StatusCode.UNAVAILABLE: EngineStopped,
}


@dataclasses.dataclass(frozen=True)
class ModelFront:
    """What a front end needs of a model without its weights: the config, the tokenizer (None: token ids only) and
    the checkpoint directory (its chat template; None for a random model)."""

    cfg: ModelConfig
    tokenizer: Any = None
    path: str | None = None


def load_front(path: str | None = None, preset: str | None = None) -> ModelFront:
    """--model PATH | --preset NAME's config and tokenizer, as hcfjax.serving.config.load_model builds them, without
    reading weights (None, None: the embedded model). ValueError as load_model gives."""
    from hcfjax.serving.config import checkpoint_dir

    if path and preset:
        raise ValueError("give --model or --preset, not both")
    if preset:
        from hcfjax.random_model import model_tokenizer, preset_config

        cfg = preset_config(preset)
        return ModelFront(cfg, model_tokenizer(cfg))
    from tokenizers import Tokenizer

    where = checkpoint_dir(path)
    tok = where / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tok)) if tok.is_file() else None
    return ModelFront(ModelConfig.from_json(where), tokenizer, str(where))


@dataclasses.dataclass(frozen=True)
class RemoteLimits:
    """The front end's thread pool is sized from these as from an EngineConfig: one thread per call in flight."""

    max_slots: int = 256
    dp: int = 1
    max_queue: int = 0


class RemoteRequest:
    """One Generate call as an engine Request: `events` is filled with Output events, the last with finish set."""

    def __init__(self, request_id: str, prompt_tokens: int, call):
        self.id, self.call = request_id, call
        self.events: queue.Queue[Output] = queue.Queue()
        self._usage = Usage(prompt_tokens)
        self._ended = threading.Event()
        self.first = threading.Event()  # the service took the request, or the call ended
        self.refusal: grpc.RpcError | None = None  # how the call ended when it ended before the service took it
        # when tokens came (time.monotonic()), for the front end's time-per-output-token metric
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None

    @property
    def done(self) -> bool:
        return self._ended.is_set()

    def usage(self) -> Usage:
        return self._usage

    def wait(self, timeout: float | None = None) -> bool:
        """Waits for the call's end; whether it ended."""
        return self._ended.wait(timeout)

    def relay(self) -> None:
        """Turns the call's messages into events until it ends (runs on the request's own thread)."""
        out = None
        try:
            if ACCEPTED in (self.call.initial_metadata() or ()):
                self.first.set()
            for msg in self.call:
                if msg.token_ids:
                    self.last_token_time = time.monotonic()
                    self.first_token_time = self.first_token_time or self.last_token_time
                u = msg.usage
                ttft = u.ttft_s if u.HasField("ttft_s") else None
                self._usage = Usage(u.prompt_tokens, u.output_tokens, ttft, u.draft_tokens, u.accepted_draft_tokens)
                finish = FINISHES.get(msg.finish_reason)
                out = Output(self.id, list(msg.token_ids), msg.text, finish, self._usage)
                self.first.set()
                self.events.put(out)
                if finish is not None:
                    return
            out = Output(self.id, [], "", FinishReason.ERROR, self._usage, "the stream ended without a finish")
        except grpc.RpcError as e:
            if not self.first.is_set() and e.code() in REFUSALS:
                self.refusal = e
                return
            finish = FinishReason.ABORT if e.code() == grpc.StatusCode.CANCELLED else FinishReason.ERROR
            out = Output(self.id, [], "", finish, self._usage, f"{e.code().name}: {e.details()}")
        finally:
            self._ended.set()
            self.first.set()
        self.events.put(out)


class RemoteEngine(Submitting):
    """The Engine surface that hcfjax.serving.http uses, over the Generation service at `address` (its requests
    checked against `front`'s model and a context of max_model_len, as the workers' engines check them)."""

    def __init__(
        self,
        address: str,
        front: ModelFront,
        max_model_len: int,
        *,
        api_key: str | None = None,
        timeout_s: float | None = None,
        limits: RemoteLimits = RemoteLimits(),
        ready=lambda: True,
    ):
        self.model, self.cfg, self.config = front, front.cfg, limits
        self.max_model_len = min(front.cfg.max_position_embeddings, max_model_len)
        self.door = FrontDoor(front.cfg, front.tokenizer, self.max_model_len)
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.GenerationStub(self.channel)
        self.metadata, self.timeout_s = auth_metadata(api_key), timeout_s
        self._lock = threading.Lock()
        self._requests: dict[str, RemoteRequest] = {}
        self._stopping = False
        self._ready = ready

    def ready(self) -> bool:
        """Whether a request can be served end to end (`ready`, e.g. the router's: some prefill and some decode
        worker up)."""
        return self._ready() and not self._stopping

    def start(self) -> None:
        """Nothing to start: each request's thread starts with it."""

    def tokenize(self, text: str) -> list[int]:
        return self.door.encode(text)

    def add(self, rid: str, c: Checked) -> RemoteRequest:
        """Starts the Generate call of a checked request (submit's); returns once the service has taken it (queued
        it, as Engine.submit does) or raises what Engine.submit raises for the cause it gives."""
        sp = c.sampling
        message = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=c.prompt),
            sampling=pb.SamplingParams(temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, min_p=sp.min_p),
            max_new_tokens=c.max_new_tokens,
            stop_token_ids=sorted(c.stop_ids),
            ignore_eos=not c.stop_ids,
            seed=c.seed,
            request_id=rid,
            stop=c.stop,
        )
        with self._lock:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
            if rid in self._requests:
                raise InvalidRequest(f"request id {rid!r} is in use", "request_id")
            call = self.stub.Generate(message, timeout=self.timeout_s, metadata=self.metadata)
            req = self._requests[rid] = RemoteRequest(rid, len(c.prompt), call)
        threading.Thread(target=self._relay, args=(req,), name="hcfjax-remote", daemon=True).start()
        req.first.wait()
        if req.refusal is not None:
            e = req.refusal
            raise REFUSALS[e.code()](e.details() or e.code().name)
        return req

    def _relay(self, req: RemoteRequest) -> None:
        try:
            req.relay()
        finally:
            with self._lock:
                self._requests.pop(req.id, None)

    def abort(self, request_id: str) -> None:
        with self._lock:
            req = self._requests.get(request_id)
        if req is not None:
            req.call.cancel()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Refuses new requests and cancels those in flight (each gets its ABORT event), then closes the channel."""
        with self._lock:
            self._stopping = True
            reqs = list(self._requests.values())
        for req in reqs:
            req.call.cancel()
        for req in reqs:
            req.wait(timeout)
        self.channel.close()
