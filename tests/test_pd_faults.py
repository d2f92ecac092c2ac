"""PD under faults, as processes on loopback (router, prefill and decode workers with the embedded model): a burst of
concurrent requests streams through the router while a worker is SIGKILLed (the decode worker, then the prefill
worker) as soon as the first request streams tokens, while the rest wait for decode slots, queue for prefill, or
are being prefilled and their KV sent (the long prompt layer by layer). Every request ends (its finish reason or an
error status, none at its deadline), the router's health says NOT_SERVING while the role has no worker up, the
surviving worker holds no pages, and once a worker restarted on the same port rejoins (the router SERVING again)
the next requests all finish. And the router's retry of a failed prefill, with stand-in workers."""

import collections
import os
import signal
import subprocess
import threading
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from hcfjax.serving import hcfjax_pb2 as pb
from hcfjax.serving import hcfjax_pb2_grpc as pb_grpc
from hcfjax.serving import pd_pb2 as pdpb
from hcfjax.serving import pd_pb2_grpc as pd_grpc
from tests.pd_procs import idle, info, start, stop

# short prompts sent whole, the long one (47 tokens) layer by layer; few lengths: each one's bucket is a compile
PROMPTS = ["def fib(n):", "import os\n", "# a long one\n" + "x = [i * 2 for i in range(100)]\n" * 3]
BURST = 12  # requests in flight when a worker dies: more than the decode worker's slots, so some wait their turn
NEW_TOKENS = 16
CALL_TIMEOUT_S = 60.0  # any one request; one that reaches it counts as hung
WAIT_S = 60.0  # health to flip, pages to come back: far above what they take; only a fault reaches it
COMMON = ["--dtype", "float32", "--page-size", "16", "--no-warmup", "--transfer-timeout", "20"]
PREFILL = ["--role", "prefill", "--max-prefill-rows", "1", "--layerwise-threshold", "32", *COMMON]
DECODE = ["--role", "decode", "--max-slots", "4", *COMMON]


def request(addr: str, prompt: str, streaming: threading.Event | None = None) -> str:
    """One streamed request through the router -> how it ended: its finish reason (stop, length, abort), an error
    status's name, "hung" (its deadline passed) or "lost" (the stream ended without a finish reason)."""
    with grpc.insecure_channel(addr) as ch:
        req = pb.GenerateRequest(text=prompt, max_new_tokens=NEW_TOKENS)
        try:
            for r in pb_grpc.GenerationStub(ch).Generate(req, timeout=CALL_TIMEOUT_S):
                if r.token_ids and streaming is not None:
                    streaming.set()
                if r.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    return pb.FinishReason.Name(r.finish_reason).removeprefix("FINISH_REASON_").lower()
            return "lost"
        except grpc.RpcError as e:
            return "hung" if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED else e.code().name


def health(addr: str) -> int:
    with grpc.insecure_channel(addr) as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        except grpc.RpcError:
            return health_pb2.HealthCheckResponse.UNKNOWN


def wait_for(what: str, check) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {WAIT_S} s"
        time.sleep(0.1)


def burst_and_kill(addr: str, victim: subprocess.Popen) -> list[str]:
    """BURST concurrent requests; once tokens stream (others still queued, prefilling or moving their KV), the
    victim is SIGKILLed. -> how each request ended."""
    streaming = threading.Event()
    with futures.ThreadPoolExecutor(BURST) as pool:
        calls = [pool.submit(request, addr, PROMPTS[i % len(PROMPTS)], streaming) for i in range(BURST)]
        assert streaming.wait(CALL_TIMEOUT_S), [c.result() for c in calls if c.done()]
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        done, hung = futures.wait(calls, timeout=CALL_TIMEOUT_S + 10)
        assert not hung, f"{len(hung)} of {BURST} requests did not return"
        return [c.result() for c in calls]


def test_pd_workers_killed_mid_transfer_and_restarted():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    procs: list[subprocess.Popen] = []
    try:
        pre, pre_addr, _ = start(PREFILL, "prefill", env)
        procs.append(pre)
        dec, dec_addr, _ = start(DECODE, "decode", env)
        procs.append(dec)
        router, addr, _ = start(["--role", "router", "--prefill", pre_addr, "--decode", dec_addr], "router", env,
                                until=": ready")  # fmt: skip
        procs.append(router)
        # every prompt once: what the workers compile is compiled before the faults
        assert [request(addr, p) for p in PROMPTS] == ["length"] * len(PROMPTS)

        workers = {"decode": (dec, dec_addr, DECODE), "prefill": (pre, pre_addr, PREFILL)}
        for role, (victim, victim_addr, args) in workers.items():
            other = pre_addr if role == "decode" else dec_addr
            ends = burst_and_kill(addr, victim)
            print(f"\n{role} worker killed: {dict(collections.Counter(ends))}")
            assert set(ends) <= {"length", "stop", "UNAVAILABLE"}, ends  # none hung, lost or failed otherwise
            assert "UNAVAILABLE" in ends  # the kill caught requests in flight

            wait_for("router NOT_SERVING", lambda: health(addr) == health_pb2.HealthCheckResponse.NOT_SERVING)
            assert request(addr, PROMPTS[0]) == "UNAVAILABLE"
            wait_for(f"the {role} worker's peer idle", lambda a=other: idle(info(a)))

            again, _, _ = start([*args, "--port", victim_addr.rsplit(":", 1)[1]], role, env)
            procs.append(again)
            workers[role] = (again, victim_addr, args)
            wait_for("router SERVING", lambda: health(addr) == health_pb2.HealthCheckResponse.SERVING)
            with futures.ThreadPoolExecutor(4) as pool:  # once the router is ready, requests finish
                assert list(pool.map(lambda p: request(addr, p), PROMPTS * 2)) == ["length"] * 2 * len(PROMPTS)
        for a in (pre_addr, dec_addr):
            wait_for(f"{a} idle", lambda a=a: idle(info(a)))
    finally:
        stop(procs)


def test_router_retries_a_failed_prefill_on_another_prefill_worker():
    """A request whose prefill failed on one prefill worker is retried on another, through the same decode worker
    when it is the only one (stand-in workers in this process: health and Worker.Info; the decode worker's
    Generate fails as the real one does when the prefill worker it was told to use is gone)."""
    from grpc_health.v1 import health

    from hcfjax.pd.router import Router, RouterServer
    from hcfjax.pd.service import PREFILL_METADATA

    class Worker(pd_grpc.WorkerServicer, pb_grpc.GenerationServicer):
        def __init__(self, dead_prefill: str = ""):
            self.dead_prefill, self.asked = dead_prefill, []

        def Info(self, request, context):
            return pdpb.WorkerInfo(dp=1, max_slots=4)

        def Generate(self, request, context):
            prefill = dict(context.invocation_metadata())[PREFILL_METADATA]
            self.asked.append(prefill)
            if prefill == self.dead_prefill:
                context.abort(grpc.StatusCode.INTERNAL, "the engine failed on this request: prefill failed: gone")
            yield pb.GenerateResponse(token_ids=[7], finish_reason=pb.FINISH_REASON_LENGTH)

    def serve(servicer) -> tuple[grpc.Server, str]:
        server = grpc.server(futures.ThreadPoolExecutor(4))
        pd_grpc.add_WorkerServicer_to_server(servicer, server)
        pb_grpc.add_GenerationServicer_to_server(servicer, server)
        status = health.HealthServicer()
        status.set("", health_pb2.HealthCheckResponse.SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(status, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        return server, f"127.0.0.1:{port}"

    (pre_a, a), (pre_b, b) = serve(Worker()), serve(Worker())
    decode = Worker(dead_prefill=a)
    dec, dec_addr = serve(decode)
    router = RouterServer(Router([a, b], [dec_addr], health_interval_s=3600)).start()
    try:
        assert request(router.address, "x") == "length"
        assert decode.asked == [a, b]  # the first prefill worker the router picks is the one that fails
    finally:
        router.stop(0)
        for s in (pre_a, pre_b, dec):
            s.stop(0)


class _Context:
    """A decode worker's call from the router, which named prefill worker "prefill:1"."""

    def invocation_metadata(self):
        from hcfjax.pd.service import PREFILL_METADATA

        return ((PREFILL_METADATA, "prefill:1"),)

    def abort(self, code, message):
        raise RuntimeError(code)


def _refused(service) -> None:
    with pytest.raises(RuntimeError) as refused:
        list(service.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), request_id="r1"), _Context()))
    assert refused.value.args[0] == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_refused_request_leaves_no_prefill_route():
    """The decode worker notes the router's prefill worker for a request before the engine can admit it, and takes
    the note back when the engine refuses the request (nothing would prefill it and drop the note)."""
    from hcfjax.engine import QueueFull
    from hcfjax.pd.service import DecodeGenerationService

    seen, routes = [], {}

    class Refusing:
        def submit(self, prompt, **kwargs):
            seen.append(dict(routes))
            raise QueueFull("the queue is full")

    _refused(DecodeGenerationService(Refusing(), routes, {}))
    assert seen == [{"r1": "prefill:1"}] and routes == {}


def test_prefill_routes_cross_the_engine_link_ahead_of_the_submit():
    """With the decode worker's server in a process of its own, its notes of the router's prefill worker go over the
    engine link to the engine's RemotePrefill: each one is in place before the engine sees the submit that follows
    it, and a refused request's note is taken back there too."""
    import multiprocessing
    import types

    from hcfjax.engine import QueueFull
    from hcfjax.pd.service import DecodeGenerationService
    from hcfjax.serving.engine_link import EngineHost, LinkedEngine
    from hcfjax.serving.remote import RemoteLimits, load_front

    seen = []

    class Refusing:  # the engine's side: what EngineHost uses of an Engine
        remote = types.SimpleNamespace(routes={})

        def after_step(self, hook):
            return lambda: None

        on_failure = after_step

        def snapshot(self):
            return {}

        def add(self, rid, checked, events):
            seen.append(dict(self.remote.routes))
            raise QueueFull("the queue is full")

    engine = Refusing()
    here, there = multiprocessing.Pipe()
    host = EngineHost(engine, here).start()
    linked = LinkedEngine(there, load_front(), 4096, RemoteLimits(2, 1, 0))
    try:
        _refused(DecodeGenerationService(linked, linked.routes, {}))
        linked.routes["r2"] = "prefill:2"
        assert linked.snapshot() == {}  # (a call's answer comes after every message sent before it)
        assert seen == [{"r1": "prefill:1"}] and engine.remote.routes == {"r2": "prefill:2"}
    finally:
        there.close()
        host.join(5)
