"""gRPC serving end to end: the server over the real Engine with the embedded model (through the engine link, as
`hcfjax serve` runs it, and directly), and `hcfjax client` as a subprocess (`hcfjax serve` as a process:
test_serve_process.py). Every test leaves the engine with all its pages free."""

import functools
import math
import os
import subprocess
import sys
import threading
import time
import types
import urllib.error
import urllib.request

import grpc
import jax.numpy as jnp
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from prometheus_client.parser import text_string_to_metric_families

import hcfjax
from hcfjax.engine import Engine, EngineConfig
from hcfjax.serving import client
from hcfjax.serving import hcfjax_pb2 as pb
from hcfjax.serving.metrics import Metrics
from hcfjax.serving.server import SERVICE_NAME, Server
from tests import engine_helpers

MAX_LEN = 256
CONFIG = EngineConfig(max_slots=4, max_queue=4, max_model_len=MAX_LEN, token_budget=64)
PROMPTS = ["def fibonacci(n):", "class LRUCache:", "import os\n", "for i in range(10):\n    "]
LONG = dict(max_new_tokens=240, ignore_eos=True)  # ~3 s of decoding on CPU: still running when we act on it
CLI = [sys.executable, "-m", "hcfjax.cli"]
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


@pytest.fixture(scope="module")
def model():
    return hcfjax.load(dtype=jnp.float32)


@pytest.fixture(scope="module")
def served(model):
    """The server as `hcfjax serve` runs it, over a LinkedEngine (hcfjax.serving.engine_link), here with both ends in
    this process (test_engine_link spawns the front-end process); `engine` is the Engine itself."""
    engine = Engine(model, CONFIG)
    engine.start()
    linked, _ = engine_helpers.linked(engine)
    metrics = Metrics(linked)
    server = Server(linked, metrics=metrics).start()
    channel, stub = client.connect("127.0.0.1", server.port, ready_timeout=10)
    yield types.SimpleNamespace(engine=engine, server=server, metrics=metrics, channel=channel, stub=stub)
    channel.close()
    server.shutdown()
    assert_idle(engine, timeout=0)
    engine.shutdown()


assert_idle = functools.partial(engine_helpers.assert_idle, timeout=60.0)


def rpc_error(fn) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value


def test_concurrent_streams_equal_generate(served, model):
    n = 24
    results = [None] * len(PROMPTS)

    def run(i):
        chunks = list(client.generate_stream(served.stub, PROMPTS[i], max_new_tokens=n))
        results[i] = chunks

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for prompt, chunks in zip(PROMPTS, results, strict=True):
        ref = hcfjax.generate(model, prompt, max_new_tokens=n)  # alone, greedy, stops at eos like the server
        tokens = [t for c in chunks for t in c.token_ids]
        assert tokens == list(ref.tokens[0])
        assert "".join(c.text for c in chunks) == ref.text[0]
        assert len(chunks) > 1 and all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
        last = chunks[-1]
        stopped = tokens[-1] in model.cfg.eos_token_ids
        assert last.finish_reason == (pb.FINISH_REASON_STOP if stopped else pb.FINISH_REASON_LENGTH)
        u = last.usage
        assert u.output_tokens == len(tokens) and u.prompt_tokens == len(served.engine.tokenize(prompt))
        assert u.HasField("ttft_s") and u.ttft_s > 0
    # A prompt given as token ids is the same request.
    ids = client.tokenize(served.stub, PROMPTS[0])
    by_ids = client.generate(served.stub, ids, max_new_tokens=n)
    assert by_ids.token_ids == [t for c in results[0] for t in c.token_ids]
    assert_idle(served.engine)


BAD = [
    (dict(prompt=""), "empty"),
    (dict(prompt=[]), "empty"),
    (dict(prompt=[5] * (MAX_LEN + 10)), "context"),
    (dict(prompt="word " * 400), "context"),  # 800 tokens
    (dict(prompt="x", temperature=-1.0), "temperature"),
    (dict(prompt="x", temperature=math.nan), "temperature"),
    (dict(prompt="x", top_p=0.0), "top_p"),
    (dict(prompt="x", top_p=1.5), "top_p"),
    (dict(prompt="x", top_k=-1), "top_k"),
    (dict(prompt="x", min_p=1.0), "min_p"),
    (dict(prompt="x", max_new_tokens=0), "max_new_tokens"),
    (dict(prompt="x", max_new_tokens=MAX_LEN), "context"),
    (dict(prompt=[5, 99999]), "99999"),
    (dict(prompt=[5, -3]), "-3"),
    (dict(prompt="x", stop_token_ids=[10**6]), "stop token"),
    (dict(prompt="x", top_k=2**31 - 1), "top_k"),  # fits the message's int32, beyond the vocabulary
    (dict(prompt="x", stop=["s"] * 17), "stop strings"),
    (dict(prompt="x", stop=[""]), "stop strings"),
    (dict(prompt="x", request_id="r" * 257), "request_id"),
    (dict(prompt="x" * 20_000), "characters"),
]


@pytest.mark.parametrize("params,words", BAD, ids=[f"{w}-{i}" for i, (_, w) in enumerate(BAD)])
def test_bad_input_is_invalid_argument(served, params, words):
    err = rpc_error(lambda: client.generate(served.stub, **params))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in err.details(), err.details()
    # The server keeps serving.
    assert client.generate(served.stub, "x = 1", max_new_tokens=2).finish_reason in ("stop", "length")
    assert_idle(served.engine)


def test_stop_strings_end_the_stream_with_exact_usage(served, model):
    ref = hcfjax.generate(model, PROMPTS[0], max_new_tokens=24, stop_token_ids=[])
    stop, n, expected = engine_helpers.stop_across_tokens(model.tokenizer, ref.tokens[0])
    r = client.generate(served.stub, PROMPTS[0], max_new_tokens=24, ignore_eos=True, stop=["@@never@@", stop])
    assert (r.text, r.finish_reason, r.usage.output_tokens, r.token_ids) == (expected, "stop", n, ref.tokens[0][:n])
    assert_idle(served.engine)


def test_cli_client_stop_and_a_seed_the_message_cannot_hold(served, model, capsys):
    from hcfjax import cli

    ref = hcfjax.generate(model, PROMPTS[0], max_new_tokens=24)
    stop, _, expected = engine_helpers.stop_across_tokens(model.tokenizer, ref.tokens[0])
    args = ["client", "--port", str(served.server.port), "--prompt", PROMPTS[0], "--max-new-tokens", "24"]
    assert cli.main(args + ["--stop", stop]) == 0
    assert capsys.readouterr().out == expected + "\n"
    for seed in ("-5", str(2**70)):
        assert cli.main(args + ["--seed", seed]) == 2
        assert "error:" in capsys.readouterr().err
    assert_idle(served.engine)


def test_full_queue_is_resource_exhausted(served):
    """Long requests fill the decode slots (or the pages) and then the queue; the next one is refused at once."""
    calls, refused = [], None
    try:
        for i in range(CONFIG.max_slots + CONFIG.max_queue + 1):
            call = client.generate_stream(served.stub, f"x = {i}", **LONG)
            deadline = time.monotonic() + 10
            while True:  # wait until the engine holds this request, or the call has failed
                s = served.engine.snapshot()
                if s["queued"] + s["running"] == len(calls) + 1 or call.done():
                    break
                assert time.monotonic() < deadline, s
                time.sleep(0.01)
            if call.done() and call.code() != grpc.StatusCode.OK:
                refused = call
                break
            calls.append(call)
        assert refused is not None, "the queue never filled"
        assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_queue" in refused.details()
        assert len(calls) >= CONFIG.max_queue
    finally:
        for call in calls:
            call.cancel()
    assert_idle(served.engine)


def aborted(served) -> float:
    return served.metrics.registry.get_sample_value("hcfjax_requests_total", {"finish_reason": "abort"}) or 0


def assert_aborted(served, before: float, steps_before: int) -> None:
    """The engine dropped the request (finish ABORT) rather than decoding it to its end, and freed its pages."""
    assert_idle(served.engine)
    deadline = time.monotonic() + 5
    while aborted(served) != before + 1:  # recorded when the call ends, just after the abort
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert served.engine.snapshot()["steps"] - steps_before < LONG["max_new_tokens"]


def test_cancelled_stream_frees_its_pages(served):
    before, steps = aborted(served), served.engine.snapshot()["steps"]
    call = client.generate_stream(served.stub, "def f(x):", **LONG)
    first = [next(call), next(call)]
    assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED for c in first)
    assert served.engine.snapshot()["running"] == 1
    call.cancel()
    err = rpc_error(lambda: list(call))
    assert err.code() == grpc.StatusCode.CANCELLED
    assert_aborted(served, before, steps)


def test_passed_deadline_aborts(served):
    before, steps = aborted(served), served.engine.snapshot()["steps"]
    err = rpc_error(lambda: client.generate(served.stub, "def f(x):", timeout=0.5, **LONG))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_aborted(served, before, steps)


def test_tokenize_health_and_reflection(served):
    assert client.tokenize(served.stub, "def f():") == served.engine.tokenize("def f():")
    health = health_pb2_grpc.HealthStub(served.channel)
    for name in ("", SERVICE_NAME):
        status = health.Check(health_pb2.HealthCheckRequest(service=name)).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    db = ProtoReflectionDescriptorDatabase(served.channel)
    assert SERVICE_NAME in db.get_services() and "grpc.health.v1.Health" in db.get_services()
    methods = [m.name for m in db.FindFileContainingSymbol(SERVICE_NAME).service[0].method]
    assert methods == ["Generate", "Tokenize"]


def test_engine_error_stopped_engine_and_health_at_shutdown(model):
    """A failing engine step answers INTERNAL; a stopped engine UNAVAILABLE; shutdown turns health NOT_SERVING."""
    engine = Engine(model, EngineConfig(max_slots=2, max_model_len=64))

    def broken(*args, **kwargs):
        raise RuntimeError("device on fire")

    engine.runner.dispatch = broken  # every step fails, and nothing compiles
    server = Server(engine).start()
    channel, stub = client.connect("127.0.0.1", server.port, ready_timeout=10)
    try:
        err = rpc_error(lambda: client.generate(stub, "x = 1", max_new_tokens=4))
        assert err.code() == grpc.StatusCode.INTERNAL and "device on fire" in err.details()
        assert_idle(engine)
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        engine.shutdown()
        err = rpc_error(lambda: client.generate(stub, "x = 1", max_new_tokens=4))
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.details()
        stopper = threading.Thread(target=server.shutdown, kwargs=dict(grace=1.0))
        stopper.start()
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        stopper.join(10)
        assert not stopper.is_alive()
    finally:
        channel.close()
        server.shutdown(grace=0)
    assert_idle(engine, timeout=0)


def test_an_engine_that_fails_turns_health_not_serving(model):
    """An error that stops the engine's loop (not one step's: a device fault, say) ends the call in flight with
    INTERNAL, turns health NOT_SERVING so an orchestrator restarts the process, and later calls get UNAVAILABLE
    with the error."""
    engine = Engine(model, EngineConfig(max_slots=2, max_model_len=64))

    def broken():
        raise RuntimeError("CUDA_ERROR_LAUNCH_FAILED")

    engine.step = broken  # the loop's iteration itself fails (nothing compiles)
    server = Server(engine).start()
    channel, stub = client.connect("127.0.0.1", server.port, ready_timeout=10)
    try:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        err = rpc_error(lambda: client.generate(stub, "x = 1", max_new_tokens=4))
        assert err.code() == grpc.StatusCode.INTERNAL and "CUDA_ERROR_LAUNCH_FAILED" in err.details()
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        err = rpc_error(lambda: client.generate(stub, "x = 1", max_new_tokens=4))
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "stopped after an error" in err.details()
    finally:
        channel.close()
        server.shutdown(grace=0)


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "le")
            if "le" not in s.labels:
                out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def test_metrics(served):
    port = served.metrics.serve(0)
    try:
        before = scrape(port)
        client.generate(served.stub, "import sys\n", max_new_tokens=8, ignore_eos=True)
        rpc_error(lambda: client.generate(served.stub, "x", top_p=0.0))
        after = scrape(port)
    finally:
        served.metrics.close()
    delta = lambda k: after.get(k, 0) - before.get(k, 0)
    assert delta("hcfjax_requests_total{finish_reason=length}") == 1
    assert delta("hcfjax_rejected_requests_total{code=INVALID_ARGUMENT}") == 1
    assert delta("hcfjax_time_to_first_token_seconds_count") == 1
    assert delta("hcfjax_time_per_output_token_seconds_count") == 1
    assert 0 < after["hcfjax_time_per_output_token_seconds_sum"] < 60
    assert delta("hcfjax_output_tokens_total") == 8
    assert after["hcfjax_queue_length"] == after["hcfjax_running_requests"] == 0
    assert after["hcfjax_cache_usage_ratio"] == 0 and after["hcfjax_free_pages"] > 0
    assert after["hcfjax_engine_steps_total"] > 0 and math.isnan(after["hcfjax_draft_acceptance_rate"])


def test_api_key_guards_generation_but_not_health(served, monkeypatch, capsys):
    """A second server over the same engine with a key: Generation calls without it are UNAUTHENTICATED before
    their request is checked; health and reflection stay open; the key in HCFJAX_API_KEY reaches `hcfjax client`."""
    from hcfjax import cli

    rejected = lambda: (
        served.metrics.registry.get_sample_value(  # noqa: E731
            "hcfjax_rejected_requests_total", {"code": "UNAUTHENTICATED"}
        )
        or 0
    )
    before = rejected()
    server = Server(served.engine, metrics=served.metrics, api_key="sesame").start()
    channel, stub = client.connect("127.0.0.1", server.port, ready_timeout=10)
    try:
        for call in (
            lambda: client.generate(stub, "x", max_new_tokens=2),
            lambda: client.generate(stub, "x", top_p=0.0, api_key="wrong"),  # no INVALID_ARGUMENT without the key
            lambda: client.tokenize(stub, "x"),
        ):
            err = rpc_error(call)
            assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in err.details()
        assert rejected() == before + 3
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        assert SERVICE_NAME in ProtoReflectionDescriptorDatabase(channel).get_services()
        assert client.generate(stub, "x = 1", max_new_tokens=2, api_key="sesame").finish_reason in ("stop", "length")
        args = ["client", "--port", str(server.port), "--prompt", "x = 1", "--max-new-tokens", "2"]
        assert cli.main(args) == 1 and "UNAUTHENTICATED" in capsys.readouterr().err
        monkeypatch.setenv("HCFJAX_API_KEY", "sesame")
        assert cli.main(args) == 0 and capsys.readouterr().out.endswith("\n")
    finally:
        channel.close()
        server.shutdown(grace=1.0, stop_engine=False)
    assert_idle(served.engine)


def test_calls_past_the_concurrency_limit_are_refused_and_counted(served):
    """Two long streams fill a server of two calls: a third is RESOURCE_EXHAUSTED and counted as rejected; health
    still answers."""
    exhausted = lambda: (
        served.metrics.registry.get_sample_value(  # noqa: E731
            "hcfjax_rejected_requests_total", {"code": "RESOURCE_EXHAUSTED"}
        )
        or 0
    )
    before = exhausted()
    server = Server(served.engine, metrics=served.metrics, max_workers=2).start()
    channel, stub = client.connect("127.0.0.1", server.port, ready_timeout=10)
    calls = []
    try:
        for i in range(2):
            calls.append(client.generate_stream(stub, f"x = {i}", **LONG))
            next(calls[-1])  # streaming: the call holds its thread
        err = rpc_error(lambda: client.generate(stub, "x", max_new_tokens=2))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "concurrent calls" in err.details()
        assert exhausted() == before + 1
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        assert status.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        for call in calls:
            call.cancel()
        channel.close()
        server.shutdown(grace=1.0, stop_engine=False)
    assert_idle(served.engine)


def test_metrics_port_with_a_key():
    metrics = Metrics()
    port = metrics.serve(0, api_key="sesame")
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url, timeout=10)
        assert e.value.code == 401
        scraped = urllib.request.Request(url, headers={"Authorization": "Bearer sesame"})
        assert b"hcfjax_rejected_requests" in urllib.request.urlopen(scraped, timeout=10).read()
    finally:
        metrics.close()


def test_cli_client(served):
    port = str(served.server.port)
    args = ["client", "--port", port, "--prompt", "def add(a, b):", "--max-new-tokens", "12"]
    good = subprocess.Popen(CLI + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    bad = subprocess.Popen(
        CLI + args + ["--temperature", "-1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV
    )
    out, err = good.communicate(timeout=60)
    assert good.returncode == 0, err
    assert out == client.generate(served.stub, "def add(a, b):", max_new_tokens=12).text + "\n"
    out, err = bad.communicate(timeout=60)
    assert bad.returncode == 1 and out.strip() == ""
    assert "INVALID_ARGUMENT" in err and "temperature" in err
    assert_idle(served.engine)
