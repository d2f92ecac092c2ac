"""A bounded soak on loopback: a few hundred tiny requests, over gRPC and HTTP (streamed and not) against one engine,
sent from a thread pool with faults drawn from a seeded RNG: cancellations at a random point, short gRPC deadlines,
clients that disconnect before reading anything. Afterwards no request is lost (each one the client did not abandon
ended with a finish reason or a clean error status), none hung, every KV page is free, the metrics agree with what
the clients saw, and the engine still answers a greedy request as hcfjax.generate does."""

import dataclasses
import http.client
import json
import time
from concurrent import futures

import grpc
import jax.numpy as jnp
import numpy as np
import pytest

import hcfjax
from hcfjax.engine import Engine, EngineConfig
from hcfjax.serving import client
from hcfjax.serving import hcfjax_pb2 as pb
from hcfjax.serving.http import HTTPServer
from hcfjax.serving.metrics import Metrics
from hcfjax.serving.server import Server
from tests import engine_helpers

# one prefill row and one chunk bucket: few step shapes, all compiled by the warm-up before the soak starts
CONFIG = EngineConfig(
    max_slots=4, max_queue=8, max_model_len=256, token_budget=64, max_prefill_rows=1, min_prefill_bucket=64
)
REQUESTS = 300
CLIENTS = 8  # threads sending at once
PROMPTS = ["def f(x):", "import os\n", "class A:", "x = [", "for i in", "# sum", "return", "while True:"]
CALL_TIMEOUT_S = 60.0  # any one call; a request without a short deadline that reaches it counts as hung
SOAK_BOUND_S = 240.0  # the whole soak's threads; far above its run time, only a hang reaches it
CLEAN_GRPC = {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE}  # queue full, shutting down
CLEAN_HTTP = {429, 503}


@dataclasses.dataclass(frozen=True)
class Job:
    """One request and the fault its client plays: none, cancel (after `after` chunks or seconds), deadline (a gRPC
    timeout of `after` seconds) or disconnect (close before reading anything)."""

    front: str  # grpc | http-stream | http
    path: str  # the HTTP endpoint: /v1/completions or /v1/chat/completions
    prompt: str
    max_new_tokens: int
    temperature: float
    seed: int
    fault: str
    after: float


def draw_jobs(rng: np.random.Generator, n: int) -> list[Job]:
    jobs = []
    for _ in range(n):
        front = str(rng.choice(["grpc", "http-stream", "http"], p=[0.4, 0.35, 0.25]))
        odds = [0.45, 0.3, 0.15, 0.1] if front == "grpc" else [0.55, 0.35, 0.0, 0.1]  # deadlines are gRPC's
        fault = str(rng.choice(["none", "cancel", "deadline", "disconnect"], p=odds))
        new = int(rng.integers(1, 9))
        # cancel: after a number of chunks (streams) or seconds (a plain HTTP request); deadline: seconds
        stream_cancel = fault == "cancel" and front != "http"
        after = float(rng.integers(0, new + 1)) if stream_cancel else float(rng.uniform(0.0, 0.6))
        path = str(rng.choice(["/v1/completions", "/v1/chat/completions"], p=[0.75, 0.25]))
        prompt, temperature = str(rng.choice(PROMPTS)), float(rng.choice([0.0, 0.8]))
        jobs.append(Job(front, path, prompt, new, temperature, int(rng.integers(0, 2**31)), fault, after))
    return jobs


# Outcomes: stop | length | abort (a finish reason), refused (queue full), deadline (it passed), abandoned (the client
# cancelled or disconnected before an end); the failures: lost (no end, no clean status), error (a server error).
def run_grpc(job: Job, port: int, stub) -> str:
    params = dict(max_new_tokens=job.max_new_tokens, temperature=job.temperature, seed=job.seed)
    if job.fault == "disconnect":  # its own connection, closed once the request is sent
        channel, own_stub = client.connect("127.0.0.1", port, ready_timeout=CALL_TIMEOUT_S)
        call = client.generate_stream(own_stub, job.prompt, timeout=CALL_TIMEOUT_S, **params)
        channel.close()
        return "abandoned"
    timeout = job.after if job.fault == "deadline" else CALL_TIMEOUT_S
    call = client.generate_stream(stub, job.prompt, timeout=timeout, **params)
    chunks = 0
    try:
        while not (job.fault == "cancel" and chunks >= job.after):
            chunk = next(call, None)
            if chunk is None:
                return "lost"  # the stream ended without a finish reason
            if chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                return pb.FinishReason.Name(chunk.finish_reason).removeprefix("FINISH_REASON_").lower()
            chunks += 1
        call.cancel()
        return "abandoned"
    except grpc.RpcError as e:
        if e.code() in CLEAN_GRPC:
            return "refused"
        if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and job.fault == "deadline":
            return "deadline"
        if e.code() == grpc.StatusCode.CANCELLED and job.fault == "cancel":
            return "abandoned"
        return f"error {e.code().name}: {e.details()}"


def http_body(job: Job, stream: bool) -> dict:
    body = dict(max_tokens=job.max_new_tokens, temperature=job.temperature, seed=job.seed, stream=stream)
    if job.path.endswith("chat/completions"):
        return body | {"messages": [{"role": "user", "content": job.prompt}]}
    return body | {"prompt": job.prompt}


def run_http(job: Job, port: int) -> str:
    stream = job.front == "http-stream"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=CALL_TIMEOUT_S)
    try:
        body = json.dumps(http_body(job, stream))
        conn.request("POST", job.path, body, {"Content-Type": "application/json"})
        if job.fault == "disconnect":
            return "abandoned"
        if job.fault == "cancel" and not stream:
            time.sleep(job.after)
            return "abandoned"
        r = conn.getresponse()
        if r.status in CLEAN_HTTP:
            r.read()
            return "refused"
        if r.status != 200:
            return f"error HTTP {r.status}: {r.read()[:200]!r}"
        if not stream:
            return json.loads(r.read())["choices"][0]["finish_reason"]
        events = 0
        while not (job.fault == "cancel" and events >= job.after):
            line = r.readline()
            if not line:
                return "lost"  # the stream ended without a finish reason
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return "refused" if event["error"].get("code") == "shutting_down" else f"error {event['error']}"
            if event["choices"] and event["choices"][0]["finish_reason"] is not None:
                return event["choices"][0]["finish_reason"]
            events += 1
        return "abandoned"
    except (ConnectionError, http.client.HTTPException, TimeoutError) as e:
        return f"lost ({type(e).__name__}: {e})"
    finally:
        conn.close()


@pytest.fixture(scope="module")
def model():
    return hcfjax.load(dtype=jnp.float32)


@pytest.fixture(scope="module")
def served(model):
    engine = Engine(model, CONFIG)
    engine.warmup()
    metrics = Metrics(engine)
    grpc_server = Server(engine, metrics=metrics).start()
    http_server = HTTPServer(engine, metrics=metrics).start()
    channel, stub = client.connect("127.0.0.1", grpc_server.port, ready_timeout=10)
    yield engine, metrics, grpc_server.port, http_server.port, stub
    channel.close()
    http_server.shutdown(stop_engine=False)
    grpc_server.shutdown()


def counter(metrics: Metrics, name: str, label: str) -> dict[str, float]:
    """{label value: count} of a labelled counter."""
    (family,) = (f for f in metrics.registry.collect() if f.name == name)
    return {s.labels[label]: s.value for s in family.samples if s.name.endswith("_total")}


def test_soak_loses_nothing_hangs_nothing_leaks_nothing(served, model):
    engine, metrics, grpc_port, http_port, stub = served
    compiled = engine.snapshot()["compiles"]
    jobs = draw_jobs(np.random.default_rng(40), REQUESTS)

    def run(job: Job) -> str:
        try:
            return run_grpc(job, grpc_port, stub) if job.front == "grpc" else run_http(job, http_port)
        except Exception as e:  # noqa: BLE001 - reported with the other failures
            return f"error ({type(e).__name__}: {e})"

    t0 = time.monotonic()
    pool = futures.ThreadPoolExecutor(CLIENTS)
    tasks = [pool.submit(run, job) for job in jobs]
    done, hung = futures.wait(tasks, timeout=SOAK_BOUND_S)
    pool.shutdown(wait=False, cancel_futures=True)
    seconds = time.monotonic() - t0
    outcomes = [t.result() for t in done]

    counts = {o: outcomes.count(o) for o in sorted(set(outcomes))}
    faults = {f: sum(j.fault == f for j in jobs) for f in ("none", "cancel", "deadline", "disconnect")}
    print(f"\nsoak: {REQUESTS} requests in {seconds:.1f} s from {CLIENTS} threads; faults {faults}; outcomes {counts}")
    assert not hung, f"{len(hung)} of {REQUESTS} clients did not return within {SOAK_BOUND_S} s"
    failures = [(j, o) for j, o in zip(jobs, (t.result() for t in tasks), strict=True)
                if o not in ("stop", "length", "abort", "refused", "deadline", "abandoned")]  # fmt: skip
    assert not failures, f"{len(failures)} requests lost or failed, e.g. {failures[:3]}"
    assert counts.get("abandoned", 0) < REQUESTS  # the faults left some requests to run to their end
    assert counts.get("stop", 0) + counts.get("length", 0) > REQUESTS // 4
    engine_helpers.assert_idle(engine, timeout=10.0)

    # The metrics: every request the server took is recorded once, so no more than were sent; each end the clients
    # saw is among them; no request is recorded as failed by the engine; the engine holds nothing.
    finished = counter(metrics, "hcfjax_requests", "finish_reason")
    rejected = counter(metrics, "hcfjax_rejected_requests", "code")
    print(f"soak: metrics finished {finished}, rejected {rejected}")
    assert sum(finished.values()) + sum(rejected.values()) <= REQUESTS
    assert finished.get("stop", 0) + finished.get("length", 0) >= counts.get("stop", 0) + counts.get("length", 0)
    assert sum(rejected.values()) >= counts.get("refused", 0)
    assert finished.get("error", 0) == 0
    assert 0 < metrics.registry.get_sample_value("hcfjax_output_tokens_total") <= sum(j.max_new_tokens for j in jobs)
    gauges = {f.name: f.samples[0].value for f in metrics.registry.collect() if f.type == "gauge"}
    assert gauges["hcfjax_queue_length"] == gauges["hcfjax_running_requests"] == gauges["hcfjax_cache_usage_ratio"] == 0
    s = engine.snapshot()
    assert (s["queued"], s["running"], s["free_pages"], s["cache_used"]) == (0, 0, s["total_pages"], 0)
    assert s["compiles"] == compiled  # the warm-up compiled every shape the soak ran

    # The engine still serves: a greedy request over each front end equals hcfjax.generate.
    ref = hcfjax.generate(model, PROMPTS[0], max_new_tokens=8)
    r = client.generate(stub, PROMPTS[0], max_new_tokens=8, timeout=CALL_TIMEOUT_S)
    assert (r.token_ids, r.text) == (list(ref.tokens[0]), ref.text[0])
    conn = http.client.HTTPConnection("127.0.0.1", http_port, timeout=CALL_TIMEOUT_S)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps(dict(prompt=PROMPTS[0], max_tokens=8, temperature=0)),
        {"Content-Type": "application/json"},
    )
    assert json.loads(conn.getresponse().read())["choices"][0]["text"] == ref.text[0]
    conn.close()
    engine_helpers.assert_idle(engine, timeout=10.0)
