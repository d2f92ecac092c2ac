"""The engine served to front ends in another process (hcfjax.serving.engine_link, .front_process): the front-end
process `hcfjax serve` runs, spawned over the real Engine with the embedded model, and what each end does when the
other goes away or fails. (test_serving runs the gRPC tests over the link with both ends in this process.)"""

import multiprocessing
import os
import socket
import threading
import urllib.request

import jax.numpy as jnp
import pytest

import hcfjax
from hcfjax.engine import Engine, EngineConfig, EngineStopped, FinishReason, InvalidRequest
from hcfjax.serving import client
from hcfjax.serving import hcfjax_pb2 as pb
from hcfjax.serving.engine_link import LinkedEngine, NoAnswer
from hcfjax.serving.front_process import FrontProcess, Listen
from hcfjax.serving.remote import ModelFront, RemoteLimits
from tests import engine_helpers
from tests.http_helpers import free_port, post

CONFIG = EngineConfig(max_slots=2, max_model_len=256, token_budget=64, max_prefill_rows=1, min_prefill_bucket=64)
N_LONG = 200  # new tokens: seconds of decoding on CPU, still running when we act on it
LONG = dict(max_new_tokens=N_LONG, stop_token_ids=[])


@pytest.fixture(scope="module")
def model():
    return hcfjax.load(dtype=jnp.float32)


@pytest.fixture(scope="module")
def engine(model):
    """One engine for the file (its steps compile once); every test leaves it idle."""
    engine = Engine(model, CONFIG)
    engine.start()
    yield engine
    engine.shutdown()


def cut(conn) -> None:
    """Ends a pipe (a socket pair) as its process's exit would: both ends see EOF. (close() would not: the reader
    thread blocked on it keeps the socket open.)"""
    end = socket.socket(fileno=os.dup(conn.fileno()))
    end.shutdown(socket.SHUT_RDWR)
    end.close()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


@pytest.mark.parametrize("server", ["http_port", "metrics_port"])
def test_a_port_in_use_is_an_oserror_and_the_child_exits(engine, server):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        front = FrontProcess(engine, Listen(**{"grpc_port": 0, server: port}))
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}"):
            front.start()
        assert not front.alive()
    assert engine.ready()  # (the child never served: it leaves the engine running)


def test_the_engine_going_away_ends_the_front_ends_requests(engine):
    linked, host = engine_helpers.linked(engine)
    told = []
    linked.on_failure(told.append)
    req = linked.submit("def f(x):", **LONG)
    first = next(linked.stream(req))
    assert first.finish is None and linked.ready()
    with pytest.raises(InvalidRequest, match="in use") as e:
        linked.submit("x", request_id=req.id)
    assert e.value.param == "request_id"
    cut(host.conn)  # as if the engine's process died
    last = list(linked.stream(req, timeout=10))[-1]
    assert last.finish is FinishReason.ERROR and "ended" in last.error and req.done
    assert not linked.ready() and told == ["the engine's process ended"]
    with pytest.raises(EngineStopped):
        linked.submit("x = 1")
    engine_helpers.assert_idle(engine, timeout=10)  # the host saw its pipe end and aborted the request


def test_the_front_end_going_away_aborts_its_requests(engine):
    """Its requests would otherwise decode to their end for nobody; their pages come back within steps, and the
    host's hooks leave the engine."""
    hooks = lambda: (engine._after_step.current, engine._on_failure.current)  # noqa: E731
    before = hooks()
    linked, host = engine_helpers.linked(engine)
    assert hooks() != before
    req = linked.submit("def f(x):", **LONG)
    next(linked.stream(req))
    steps = engine.snapshot()["steps"]
    cut(linked.conn)  # as if the front end's process died
    engine_helpers.assert_idle(engine, timeout=10)
    assert engine.snapshot()["steps"] - steps < N_LONG - 2
    host.join(10)
    assert hooks() == before


def test_an_engine_failure_reaches_the_front_end(model):
    engine = Engine(model, EngineConfig(max_slots=2, max_model_len=64))

    def broken():
        raise RuntimeError("CUDA_ERROR_LAUNCH_FAILED")

    engine.step = broken
    engine.start()
    linked, _ = engine_helpers.linked(engine)
    told, failed = [], threading.Event()
    linked.on_failure(lambda error: (told.append(error), failed.set()))
    try:
        req = linked.submit("x = 1", max_new_tokens=4)
        out = list(linked.stream(req, timeout=10))[-1]
        assert out.finish is FinishReason.ERROR and "CUDA_ERROR_LAUNCH_FAILED" in out.error
        assert failed.wait(10) and "CUDA_ERROR_LAUNCH_FAILED" in told[0] and not linked.ready()
        with pytest.raises(EngineStopped, match="CUDA_ERROR_LAUNCH_FAILED"):
            linked.submit("x = 1", max_new_tokens=4)
        assert linked.snapshot()["running"] == 0  # the engine's gauges still answer (the metrics scrape)
    finally:
        engine.shutdown()


def test_a_submit_without_an_answer_is_aborted(model):
    """An engine that does not answer in time may have queued the request all the same: it is told to abort it."""
    ours, theirs = multiprocessing.Pipe()
    front = ModelFront(model.cfg, None, None)
    linked = LinkedEngine(ours, front, 64, RemoteLimits(), timeout_s=0.2)
    with pytest.raises(NoAnswer):
        linked.submit([5, 6, 7], max_new_tokens=4, request_id="r1")
    assert theirs.recv()[:3] == ("submit", 0, "r1") and theirs.recv() == ("abort", "r1")


def test_an_abort_never_blocks_its_caller(model):
    """The HTTP server aborts on its event loop when a client goes: a pipe the engine does not drain must not stall
    it. The abort waits on the link's own thread and goes once the pipe takes it."""
    ours, theirs = multiprocessing.Pipe()
    linked = LinkedEngine(ours, ModelFront(model.cfg, None, None), 64, RemoteLimits())
    taken, send = threading.Event(), ours.send
    ours.send = lambda message: (taken.wait(), send(message))
    caller = threading.Thread(target=linked.abort, args=("r1",), daemon=True)
    caller.start()
    caller.join(10)
    assert not caller.is_alive() and not theirs.poll()  # returned, with the message still waiting to go
    taken.set()
    assert theirs.poll(10) and theirs.recv() == ("abort", "r1")


def test_a_message_that_fails_does_not_end_the_link(engine):
    linked, host = engine_helpers.linked(engine)
    host._send(("outputs", [("no such output",)]))
    req = linked.submit("import os", max_new_tokens=4, stop_token_ids=[])
    assert list(linked.stream(req, timeout=30))[-1].finish is FinishReason.LENGTH and linked.ready()


def test_an_engine_shut_down_directly_ends_the_linked_streams(model):
    """Its owner stops it without the front end asking: the last Outputs (ABORT) still cross the pipe."""
    engine = Engine(model, EngineConfig(max_slots=1, max_model_len=256, token_budget=64, min_prefill_bucket=64))
    engine.start()
    linked, _ = engine_helpers.linked(engine)
    req = linked.submit("def f(x):", **LONG)
    next(linked.stream(req, timeout=30))
    engine.shutdown()
    assert list(linked.stream(req, timeout=10))[-1].finish is FinishReason.ABORT


def test_outputs_cross_once_a_step(engine):
    """A step's Outputs for every request go over the pipe as one message (the engine thread sends once a step)."""
    linked, host = engine_helpers.linked(engine)
    sent = []
    send = host.conn.send
    host.conn.send = lambda message: (sent.append(message[0]), send(message))[1]
    steps = engine.snapshot()["steps"]
    reqs = [linked.submit(p, max_new_tokens=8, stop_token_ids=[]) for p in ("def f(x):", "import os")]
    outs = [list(linked.stream(r, timeout=30)) for r in reqs]
    assert all(o[-1].finish is FinishReason.LENGTH and sum(len(e.token_ids) for e in o) == 8 for o in outs)
    # 16 Outputs in all, one message a step: the two requests decode together
    assert sent.count("outputs") <= engine.snapshot()["steps"] - steps < 16


def test_front_process_serves_grpc_http_and_metrics_then_ends_open_streams(engine, model):
    """Last: stopping the servers stops the file's engine. The servers in a spawned process answer as the engine
    would (greedy tokens equal hcfjax.generate's), the metrics scrape counts what they served, and stopping them ends
    an open stream with ABORT and frees its pages."""
    front = FrontProcess(engine, Listen(grpc_port=0, http_port=0, metrics_port=free_port()))
    up = front.start()
    try:
        assert set(up.ports) == {"grpc", "http", "metrics"} and len(up.lines) == 3
        ref = hcfjax.generate(model, ["def fibonacci(n):"], max_new_tokens=12)
        channel, stub = client.connect("127.0.0.1", up.ports["grpc"], ready_timeout=10)
        got = client.generate(stub, "def fibonacci(n):", max_new_tokens=12, ignore_eos=True)
        assert got.token_ids == ref.tokens[0]
        status, body = post(
            up.ports["http"], "/v1/completions", {"prompt": "def fibonacci(n):", "max_tokens": 12, "temperature": 0}
        )
        assert status == 200 and body["choices"][0]["text"] == got.text
        assert 'hcfjax_requests_total{finish_reason="length"} 2.0' in scrape(up.ports["metrics"])
        assert "hcfjax_engine_steps_total" in scrape(up.ports["metrics"])  # the engine's gauges, over the link
        call = client.generate_stream(stub, "def f(x):", max_new_tokens=N_LONG, ignore_eos=True)
        next(call)
        front.shutdown(grace=2)
        chunks = list(call)
        assert chunks[-1].finish_reason == pb.FINISH_REASON_ABORT and chunks[-1].usage.output_tokens < N_LONG
        channel.close()
    finally:
        front.shutdown(0)
    assert not front.alive()
    engine_helpers.assert_idle(engine, timeout=10)
