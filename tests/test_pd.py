"""Prefill/decode disaggregation: a prefill worker (prefill plan) and a decode worker (decode plan) give the same
tokens as the colocated engine, with the cache sent whole or layer by layer over every transport; as separate
processes behind the router too (over gRPC and its OpenAI HTTP API), where a decode worker killed mid-stream gives
its client UNAVAILABLE and leaves no pages held on the prefill side."""

import dataclasses
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import jax
import jax.numpy as jnp
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import hcfjax
from hcfjax import cache as kvcache
from hcfjax.engine import Engine, EngineConfig
from hcfjax.pd.decode import LocalPrefill, RemotePrefill
from hcfjax.pd.prefill import PrefillConfig, PrefillWorker
from hcfjax.pd.transport import make_transport
from hcfjax.sampling import SamplingParams
from hcfjax.serving import pd_pb2 as pdpb
from hcfjax.serving import pd_pb2_grpc as pd_grpc
from tests.pd_procs import start, stop

PROMPTS = [
    "def fib(n):",
    "import os\n",
    "# a long one\n" + "x = [i * 2 for i in range(100)]\n" * 9,  # 131 tokens: layerwise (threshold 64), 2 chunks of 128
    "class Foo:\n    def __init__(self):",
    "for i in range(10):\n    ",
]
N = 12
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95)
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@pytest.fixture(scope="module")
def model():
    return hcfjax.load(dtype=jnp.float32)


@pytest.fixture(scope="module")
def colocated(model):
    """The colocated engine's tokens: greedy for every prompt, and one sampled request (seed 7)."""
    engine = Engine(model, EngineConfig(max_slots=4, token_budget=64))
    reqs = [engine.submit(p, max_new_tokens=N) for p in PROMPTS]
    reqs.append(engine.submit(PROMPTS[0], max_new_tokens=N, sampling=SAMPLED, seed=7))
    while engine.has_work() or engine._inbox:
        engine.step()
    return [[t for o in engine.stream(r, timeout=0) for t in o.token_ids] for r in reqs]


def run_pd(model, kind: str, plans: bool, merge: bool = True, warm: bool = False):
    from sharding.plans import decode_plan, prefill_plan

    transport = make_transport(kind, merge=merge)
    receiver = transport.receiver()
    rows = 1 if warm else 4  # one row per batch keeps the warm-up's shapes few
    config = PrefillConfig(num_pages=64, page_size=16, max_rows=rows, layerwise_threshold=64, layer_group=2, chunk=128)
    worker = PrefillWorker(model, transport.sender(), config, prefill_plan(2) if plans else None)
    remote = RemotePrefill(receiver, [LocalPrefill(worker)], timeout_s=60)
    dp = 2 if plans else 1
    # a context of the warm-up's 256 tokens: the warm-up compiles a device transport's padding for every page count
    # up to it (17 pages, not the model context's 129)
    config = EngineConfig(max_slots=2, dp=dp, max_model_len=256)
    engine = Engine(model, config, decode_plan(2) if plans else None, remote=remote)
    compiles: list[str] = []  # XLA compiles after the warm-up, eager ops' too (a send's gather, an install's pad)
    count = lambda event, secs, **kw: compiles.append(kw.get("fun_name", "?")) if event == BACKEND_COMPILE else None
    if warm:  # every prefill, decode and install shape compiled first: none compiles while serving
        told = []
        worker.warmup(256, progress=lambda done, total: told.append((done, total)))
        total = told[0][1]  # every shape's programs and every gather
        assert told == [(i, total) for i in range(total + 1)] and total > len(worker.shapes(256))
        engine.warmup()
        compiled = (engine.snapshot()["compiles"], engine.runner._install._cache_size())
        jax.monitoring.register_event_duration_secs_listener(count)
    worker.start()
    engine.start()
    try:
        reqs = [engine.submit(p, max_new_tokens=N) for p in PROMPTS]
        reqs.append(engine.submit(PROMPTS[0], max_new_tokens=N, sampling=SAMPLED, seed=7))
        outs = [list(engine.stream(r, timeout=120)) for r in reqs]
        assert all(o[-1].error is None for o in outs), [o[-1].error for o in outs]
        tokens = [[t for o in out for t in o.token_ids] for out in outs]
        deadline = time.monotonic() + 10
        while worker.pages_held and time.monotonic() < deadline:
            time.sleep(0.05)
        assert worker.pages_held == 0
        snap = engine.snapshot()
        assert snap["free_pages"] == snap["total_pages"] and snap["running"] == 0
        if warm:
            assert worker.compiles == []
            assert (snap["compiles"], engine.runner._install._cache_size()) == compiled
            # left: the decode side joins a layerwise request's pieces (it does not know the prefill's layer groups)
            assert set(compiles) <= {"jit(concatenate)"}, compiles
        return tokens, worker, worker.sender.stats
    finally:
        if warm:
            jax.monitoring.unregister_event_duration_listener(count)
        engine.shutdown()
        worker.shutdown()
        worker.sender.close()
        receiver.close()
        remote.shutdown()


def test_pd_in_process_equals_colocated_under_both_plans(model, colocated):
    """Prefill under TP=2, decode under DP=2 x EP=2; short prompts whole, the long one layer by layer (in pieces
    of two layers, its prompt in two chunks); greedy and sampled requests equal the colocated engine's."""
    tokens, worker, _ = run_pd(model, "inprocess", plans=True)
    assert tokens == colocated
    assert worker.stats["layerwise"] >= 1 and worker.stats["jobs"] == len(PROMPTS) + 1
    embeds = [key for key, _ in worker.compiles if key[0] == "embed"]  # ("embed", rows, padded length, chunk)
    assert any(length > chunk for _, _, length, chunk in embeds), embeds  # a prompt ran as several chunks


def test_pd_over_the_jax_transport_after_a_warm_up(model, colocated):
    """jax.experimental.transfer pulls (the socket transport runs in the speculative test below) under both plans,
    after a warm-up, which leaves nothing to compile while serving: the prefill worker's programs compiled ahead of
    time for the shapes and shardings its batches meet."""
    tokens, _, stats = run_pd(model, "jax", plans=True, warm=True)
    assert tokens == colocated
    assert stats["messages"] >= 1


def test_a_restarted_prefill_worker_loads_its_compiled_programs(tmp_path, request):
    """Programs kept under executable_cache: a second worker of the same config loads every one its warm-up needs,
    compiles nothing, and makes the same first tokens. (bfloat16, as the engine's restart test: XLA:CPU cannot
    serialize the float32 sort of top-p sampling.)"""
    import numpy as np

    from tests.engine_helpers import xla_compiles

    model = hcfjax.load()
    config = PrefillConfig(num_pages=8, page_size=16, max_rows=1, chunk=32, layerwise_threshold=64)
    config = dataclasses.replace(config, executable_cache=str(tmp_path))
    first = PrefillWorker(model, make_transport("socket").sender(), config)
    request.addfinalizer(first.sender.close)
    first.warmup(64)
    stored = len(list(tmp_path.glob("*.step")))
    assert first.disk.misses == len(first._programs) == stored and first.disk.hits == 0
    second = PrefillWorker(model, make_transport("socket").sender(), config)
    request.addfinalizer(second.sender.close)
    prompt = model.tokenizer.encode(PROMPTS[0]).ids
    tokens, table = np.zeros((1, 64), np.int32), np.arange(4, dtype=np.int32)[None]
    tokens[0, : len(prompt)] = prompt
    n, zero = np.array([len(prompt)], np.int32), np.zeros(1, np.int32)
    with xla_compiles() as compiles:
        second.warmup(64)
        firsts = [
            w._forward(tokens, n, table, zero.astype(np.uint32), zero, [SAMPLED], 32, None, False)[0]
            for w in (first, second)
        ]
    assert second.disk.hits == stored and second.disk.misses == 0 and second.compiles == []
    assert not [c for c in compiles if "concatenate" not in c], compiles
    assert int(firsts[0][0]) == int(firsts[1][0])


def test_a_host_staged_cache_installs_on_one_program_per_power_of_two_pages(model):
    """A decode worker's warm-up compiles one install per power of two pages and, for host-staged transports,
    nothing per page count: the cache is padded on the host. Any page count then stages and installs without a
    compile, into exactly its pages; a cache of the wrong shape or dtype is refused."""
    import numpy as np

    from hcfjax.generate import bucket

    for cache_dtype in ("auto", "int8"):
        runner = Engine(model, EngineConfig(max_slots=2, max_model_len=160, cache_dtype=cache_dtype)).runner
        cache = runner.state.cache
        compiles = []
        count = lambda event, secs, seen=compiles, **kw: (
            seen.append(kw.get("fun_name")) if event == BACKEND_COMPILE else None
        )
        jax.monitoring.register_event_duration_secs_listener(count)
        try:
            installs = runner._install._cache_size()  # (shared by the jit objects of one function)
            runner.warmup_install()
            powers = len(range(bucket(runner.max_pages, 1).bit_length()))  # 1, 2, 4, ... up to the bucket
            installs = runner._install._cache_size() - installs
            assert (installs, len(compiles)) == (powers, powers), (cache_dtype, compiles)
            pages = [5, 9, 2]
            shape = (cache.kv.shape[0], len(pages), runner.cache_page_size, cache.kv.shape[-1])
            kv = np.arange(np.prod(shape)).reshape(shape).astype(cache.kv.dtype)
            scale = None if cache.scale is None else np.full(kvcache.scale_shape(shape), 0.5, np.float32)
            before = np.asarray(runner.state.cache.kv)  # (the install donates the state it is given)
            landed = runner.landing.stage(kv, scale)
            assert landed.kv.shape[1] == 4 and landed.pages == 3
            runner._install_pages(pages, landed, 0, 7, 40, 3)
            for n in range(1, runner.max_pages + 1):
                part = None if scale is None else np.zeros(kvcache.scale_shape((shape[0], n, *shape[2:])), np.float32)
                runner.landing.stage(np.zeros(shape[:1] + (n,) + shape[2:], kv.dtype), part)
            assert len(compiles) == powers, compiles
        finally:
            jax.monitoring.unregister_event_duration_listener(count)
        after = np.asarray(runner.state.cache.kv)
        np.testing.assert_array_equal(after[:, pages], kv)
        others = [p for p in range(cache.kv.shape[1]) if p not in pages]
        np.testing.assert_array_equal(after[:, others], before[:, others])
        assert int(runner.state.tok[0]) == 7 and int(runner.state.length[0]) == 40
        if scale is not None:
            np.testing.assert_array_equal(np.asarray(runner.state.cache.scale)[:, pages], scale)
        with pytest.raises(ValueError, match="shape"):
            runner.landing.stage(kv[..., :-1], scale)
        with pytest.raises(ValueError, match="scales|transferred cache is"):
            runner.landing.stage(kv.astype(np.float16), scale)
        if scale is not None:
            with pytest.raises(ValueError, match="transferred scales are float16"):
                runner.landing.stage(kv, scale.astype(np.float16))


def test_pd_speculative_decoding_across_the_split(model, colocated):
    """The prefill worker runs the MTP modules and makes the first drafts; the decode worker verifies from its first
    step. Exact verification of greedy drafts gives the plain greedy tokens; the draft state crosses the prefill
    service's gRPC reply (a real server on loopback, behind an API key) and the cache (MTP layers included) the
    socket transport."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from hcfjax.pd.service import GrpcPrefill, prefill_server

    spec = hcfjax.SpeculativeConfig(num_draft_tokens=2)
    transport = make_transport("socket")
    receiver = transport.receiver()
    config = PrefillConfig(num_pages=64, page_size=16, layerwise_threshold=64, chunk=128, speculative=spec)
    worker = PrefillWorker(model, transport.sender(), config)
    worker.start()
    server = prefill_server(worker, "socket", api_key="sesame").start()
    with grpc.insecure_channel(server.address) as ch:  # without the key only health answers
        with pytest.raises(grpc.RpcError) as e:
            pd_grpc.WorkerStub(ch).Info(pdpb.InfoRequest(), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    client = GrpcPrefill(server.address, api_key="sesame")
    remote = RemotePrefill(receiver, [client], timeout_s=60)
    engine = Engine(model, EngineConfig(max_slots=2, speculative=spec), remote=remote)
    engine.start()
    try:
        reqs = [engine.submit(p, max_new_tokens=N) for p in PROMPTS[1:3]]  # the long one goes layerwise
        outs = [list(engine.stream(r, timeout=120)) for r in reqs]
        assert all(o[-1].error is None for o in outs), [o[-1].error for o in outs]
        assert [[t for o in out for t in o.token_ids] for out in outs] == colocated[1:3]
        usage = [o[-1].usage for o in outs]
        assert sum(u.draft_tokens for u in usage) > 0 and sum(u.accepted_draft_tokens for u in usage) > 0
    finally:
        engine.shutdown()
        server.stop()
        worker.shutdown()
        worker.sender.close()
        receiver.close()
        remote.shutdown()
        client.close()


# -- separate processes behind the router ----------------------------------------------------------------------------


def stream(addr: str, prompt, max_new: int, timeout: float = 120, on_token=None):
    from hcfjax.serving import hcfjax_pb2 as pb
    from hcfjax.serving import hcfjax_pb2_grpc as pb_grpc

    with grpc.insecure_channel(addr) as ch:
        req = pb.GenerateRequest(text=prompt, max_new_tokens=max_new)
        out = []
        for r in pb_grpc.GenerationStub(ch).Generate(req, timeout=timeout):
            out += r.token_ids
            if on_token is not None and r.token_ids:
                on_token()
        return out


def prefill_info(addr: str):
    from hcfjax.serving import pd_pb2 as pdpb
    from hcfjax.serving import pd_pb2_grpc as pd_grpc

    with grpc.insecure_channel(addr) as ch:
        return pd_grpc.WorkerStub(ch).Info(pdpb.InfoRequest(), timeout=10)


def test_pd_processes_behind_the_router(model, colocated, tmp_path):
    """Router + prefill (TP=2 on 2 fake devices) + decode (DP=2 x EP=2) as processes over the socket transport:
    concurrent requests give the colocated tokens, and every process marked each request's way in order
    (hcfjax.trace, what bench.sim_validate's PD breakdown reads); a bounded soak loses none; the router's OpenAI
    HTTP API (--http-port) gives the colocated text and errors; then the decode worker is killed mid-stream: its
    client gets UNAVAILABLE within the timeout and the prefill worker holds no pages (an HTTP client then gets 503);
    a decode worker restarted on the same address rejoins."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", "HCFJAX_TRACE_DIR": str(tmp_path)}
    common = ["--dtype", "float32", "--cpu-devices", "2", "--page-size", "16", "--no-warmup"]
    procs = []
    try:
        pre, pre_addr, _ = start(
            ["--role", "prefill", "--mesh", "prefill:tp=2", "--layerwise-threshold", "64", *common], "prefill", env
        )
        procs.append(pre)
        decode_args = ["--role", "decode", "--mesh", "decode:dp=2", "--max-slots", "4", *common]
        dec, dec_addr, _ = start(decode_args, "decode", env)
        procs.append(dec)
        router, addr, said = start(
            ["--role", "router", "--prefill", pre_addr, "--decode", dec_addr, "--request-timeout", "60"]
            + ["--http-port", "0"],
            "router",
            env,
            until=": ready",
        )
        procs.append(router)

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: stream(addr, p, N), PROMPTS))
        assert got == colocated[: len(PROMPTS)]
        from hcfjax.bench.sim_validate_pd import STAGES, request_marks
        from hcfjax.trace import read

        way = [a for _, a, _ in STAGES[1:]] + ["relay_first"]  # the client's marks are bench.serve's
        marks = request_marks(read(tmp_path), "rt-")
        assert len(marks) == len(PROMPTS), marks
        for rid, m in marks.items():
            assert all(ev in m for ev in way), (rid, sorted(m))
            assert [m[ev] for ev in way] == sorted(m[ev] for ev in way), (rid, m)

        # a bounded soak: 12 concurrent requests (more than the decode worker's 8 slots) all end with their tokens
        soak = [(PROMPTS[i % len(PROMPTS)], 1 + i % 7) for i in range(12)]
        with ThreadPoolExecutor(12) as pool:
            lens = list(pool.map(lambda a: len(stream(addr, *a)), soak))
        assert all(0 < n <= m for n, (_, m) in zip(lens, soak, strict=True)), lens

        # the OpenAI API through the router (--http-port): the colocated server's greedy text (test_http shows it is
        # hcfjax.generate's), streamed or not; a request the front door refuses is the colocated server's 400
        url = re.search(r"HTTP on (http://\S+/v1)", said).group(1)
        web = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
        ref = hcfjax.generate(model, PROMPTS[:2], max_new_tokens=N)
        assert ref.tokens == colocated[:2]
        whole = web.completions.create(model="stdlib-v3", prompt=PROMPTS[0], max_tokens=N, temperature=0)
        assert whole.choices[0].text == ref.text[0] and whole.usage.completion_tokens == len(colocated[0])
        chunks = web.completions.create(model="stdlib-v3", prompt=PROMPTS[1], max_tokens=N, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in chunks) == ref.text[1]
        with pytest.raises(openai.BadRequestError) as bad:
            web.completions.create(model="stdlib-v3", prompt=PROMPTS[0], max_tokens=10**6)
        assert (bad.value.code, bad.value.param) == ("context_length_exceeded", "max_tokens")

        # kill the decode worker while a long generation streams
        started = threading.Event()
        fut = ThreadPoolExecutor(1).submit(stream, addr, PROMPTS[2], 400, 60, started.set)
        assert started.wait(60)
        dec.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            fut.result(timeout=60)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
        assert time.monotonic() - t0 < 30
        deadline = time.monotonic() + 20
        while prefill_info(pre_addr).pages_held and time.monotonic() < deadline:
            time.sleep(0.2)
        assert prefill_info(pre_addr).pages_held == 0
        with pytest.raises(grpc.RpcError) as err:  # no decode worker is up
            time.sleep(1.5)
            stream(addr, PROMPTS[0], 4, timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(openai.APIStatusError) as down:  # over HTTP too: 503
            web.completions.create(model="stdlib-v3", prompt=PROMPTS[0], max_tokens=4)
        assert down.value.status_code == 503, down.value

        # a decode worker restarted on the same address rejoins (the router's health checks see it)
        dec2, _, _ = start([*decode_args, "--port", dec_addr.rsplit(":", 1)[1]], "decode", env)
        procs.append(dec2)
        deadline = time.monotonic() + 30
        while True:
            try:
                assert stream(addr, PROMPTS[0], N) == colocated[0]
                break
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    finally:
        stop(procs)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 600), min_size=1, max_size=12), st.integers(1, 4), st.sampled_from([64, 200, 512]))
def test_every_batch_the_worker_takes_has_a_warmed_up_shape(model, lengths, rows, budget):
    """`shapes(max_len)` leaves out multi-row batches whose longest prompt cannot fit beside the other rows in the
    token budget, or is layerwise; every batch `_take_batch` forms from any queue still has its shape in it."""
    from hcfjax.pd.prefill import PrefillJob

    config = PrefillConfig(num_pages=512, max_rows=rows, token_budget=budget, layerwise_threshold=300)
    worker = PrefillWorker(model, make_transport("socket").sender(), config)
    warmed = set(worker.shapes(600))
    every = {worker._shape(r, k) for r in range(1, rows + 1) for k in (16, 32, 64, 128, 256, 512, 1024)}
    assert warmed <= every and (len(warmed) < len(every)) == (rows > 1)
    pending = [PrefillJob(str(i), [1] * n, SamplingParams(), 0, 0, "") for i, n in enumerate(lengths)]
    while pending:
        batch = worker._take_batch(pending)
        assert worker._shape(len(batch), max(len(j.tokens) for j in batch)) in warmed
        for j in batch:
            worker._release(j)
            pending.remove(j)
