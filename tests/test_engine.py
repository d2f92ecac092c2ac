"""The serving engine: outputs equal hcfjax.generate under continuous batching, chunking, DP ranks and preemption;
pages always come back (the scheduler, page allocator and balancer alone: test_scheduler.py)."""

import dataclasses
import threading

import jax
import jax.numpy as jnp
import pytest

import hcfjax
from hcfjax.engine import Engine, EngineConfig, EngineStopped, FinishReason, InvalidRequest, QueueFull
from hcfjax.engine.request import Status
from hcfjax.engine.runner import decode_key
from hcfjax.options import Options
from hcfjax.sampling import SamplingParams
from tests import engine_helpers
from tests.engine_helpers import xla_compiles

PROMPTS = [
    "def fib(n):",
    "import os\n",
    "class Foo:\n    def __init__(self):",
    "# a long one\n" + "x = [i * 2 for i in range(100)]\n" * 4,
    "for i in range(10):\n    ",
    "return",
]


@pytest.fixture(scope="module")
def model():
    return hcfjax.load(dtype=jnp.float32)


@pytest.fixture(scope="module")
def eos_ref(model):
    """generate's greedy tokens for PROMPTS, 24 each, stopping at eos as the engine does by default."""
    return hcfjax.generate(model, PROMPTS, max_new_tokens=24)


@pytest.fixture(scope="module")
def plan_ref(eos_ref):
    """generate's tokens for the decode-plan tests, which ask for 10: the first 10 of eos_ref's (greedy rows do not
    depend on their batch, nor on how far they run)."""
    return [row[:10] for row in eos_ref.tokens[:5]]


def run_all(engine: Engine) -> None:
    while engine.has_work() or engine._inbox:
        engine.step()


def collect(engine: Engine, req) -> tuple[list[int], str, FinishReason]:
    outs = list(engine.stream(req, timeout=0))
    return [t for o in outs for t in o.token_ids], "".join(o.text for o in outs), outs[-1].finish


def assert_all_free(engine: Engine) -> None:
    snap = engine.snapshot()
    assert snap["free_pages"] == snap["total_pages"] and snap["running"] == 0 and snap["queued"] == 0
    assert all(len(f) == engine.config.max_slots for f in engine.scheduler.free_slots)


@pytest.mark.parametrize(
    "config",
    [
        # queueing, chunks, two ranks; prefill attention fused (generate's reference runs the blocked form)
        EngineConfig(
            max_slots=2, dp=2, token_budget=32, balance="least_pages", options=Options(prefill_attention="fused")
        ),
        EngineConfig(max_slots=4, num_pages=12, page_size=8, token_budget=64),  # too few pages: preemption
    ],
    ids=["chunked-dp2", "preempt"],
)
def test_concurrent_requests_equal_generate(model, eos_ref, config):
    n, ref = 24, eos_ref  # stops at eos like the engine's default
    engine = Engine(model, config)
    engine.scheduler.out_lens.append(1)  # recent outputs look short: admission over-commits, decode must preempt
    reqs = [engine.submit(p, max_new_tokens=n) for p in PROMPTS]
    run_all(engine)
    for i, r in enumerate(reqs):
        toks, text, finish = collect(engine, r)
        assert toks == ref.tokens[i], i
        assert text == ref.text[i]
        assert finish == (FinishReason.STOP if toks[-1] in model.cfg.eos_token_ids else FinishReason.LENGTH)
    assert engine.snapshot()["compiles"] <= 8
    if config.num_pages == 12:
        assert engine.scheduler.preemptions > 0
    assert_all_free(engine)


def test_engine_under_the_decode_plan(model, plan_ref):
    """Two DP ranks on two devices: each rank's attention over its own slots and pages, experts over EP with the
    all_to_all exchange, mock rows on the rank with less work; same tokens as generate. Decode steps of 1 and 2
    rows per rank (min_decode_rows=1): each rank decodes its first rows of its own slots."""
    from sharding.plans import decode_plan

    config = EngineConfig(max_slots=2, dp=2, token_budget=32, balance="fewest_requests", min_decode_rows=1)
    engine = Engine(model, config, decode_plan=decode_plan(2))
    reqs = [engine.submit(p, max_new_tokens=10) for p in PROMPTS[:5]]
    run_all(engine)
    assert [collect(engine, r)[0] for r in reqs] == plan_ref
    assert {decode_key(2), decode_key(4)} <= set(engine.runner.executables)  # 1 and 2 rows on each of 2 ranks
    assert_all_free(engine)
    with pytest.raises(ValueError, match="dp=1"):
        Engine(model, EngineConfig(), decode_plan=decode_plan(2))


def test_live_eplb_under_the_decode_plan(model, plan_ref):
    """EPLB while serving: 16 experts in 20 physical slots over 2 ranks, re-placed every 2 steps from the routed
    loads. The tokens equal generate's across the re-placements, nothing compiles after the first two steps (the
    placement changes contents, never shapes or shardings), and the window holds exactly the routed token copies
    of the real tokens the steps ran (prompt + output, the last fed by the step of lag), mock rows excluded."""
    import jax
    import numpy as np

    from hcfjax.model import hidden_states
    from sharding.plans import decode_plan

    config = EngineConfig(
        max_slots=2, dp=2, token_budget=64, max_prefill_rows=2, eplb_interval=2, eplb_redundant=4, eplb_window=64
    )
    engine = Engine(model, config, decode_plan=decode_plan(2))
    eplb = engine.runner.eplb
    first_placement = eplb.placement[0].copy()
    reqs = [engine.submit(p, max_new_tokens=10) for p in PROMPTS[:2]]  # one per rank; 4 slots: 2 mock rows
    engine.step()
    engine.step()  # prefill (both prompts) and the first decode step: both shapes compiled
    with xla_compiles() as compiles:
        run_all(engine)
    outs = [collect(engine, r)[0] for r in reqs]
    assert outs == plan_ref[:2]
    assert eplb.rebalances >= 3 and not np.array_equal(eplb.placement[0], first_placement)
    assert compiles == [] and engine.snapshot()["compiles"] == 2
    assert eplb.window.step == engine.steps < 64  # every step observed, none dropped from the window
    # direct count: the real tokens teacher-forced on one device, padding masked out of the count
    seqs = [engine.tokenize(p) + o for p, o in zip(PROMPTS[:2], outs, strict=True)]
    tokens = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
    for i, q in enumerate(seqs):
        tokens[i, : len(q)] = q
    real = jnp.arange(tokens.shape[1]) < jnp.asarray([[len(q)] for q in seqs])
    pos = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    count = jax.jit(lambda t, pos, real: hidden_states(model.params, model.cfg, t, pos, with_load=real)[2])
    load = count(jnp.asarray(tokens), pos, real)
    assert np.array_equal(eplb.window.total(), np.asarray(load))


def test_hierarchical_eplb_keeps_replicas_on_their_node(model, plan_ref):
    """eplb_nodes=2 over dp=4 ranks (2 ranks per node; 4 expert groups split over the nodes): through the engine's
    re-placements, every replica of an expert sits on one node's ranks, in the placement and in the experts the
    device runs, and the tokens stay generate's."""
    import numpy as np

    from sharding.eplb import moe_experts
    from sharding.plans import decode_plan

    with pytest.raises(ValueError, match="eplb_nodes"):
        EngineConfig(dp=4, eplb_nodes=3)
    config = EngineConfig(
        max_slots=1, dp=4, token_budget=64, eplb_interval=2, eplb_redundant=4, eplb_window=8, eplb_nodes=2
    )
    engine = Engine(model, config, decode_plan=decode_plan(4))
    eplb = engine.runner.eplb
    assert eplb.num_nodes == 2 and eplb.num_replicas == 20
    reqs = [engine.submit(p, max_new_tokens=10) for p in PROMPTS[:4]]
    run_all(engine)
    assert [collect(engine, r)[0] for r in reqs] == plan_ref[:4]
    assert eplb.rebalances >= 2
    slots_per_rank, ranks_per_node = 20 // 4, 4 // 2
    for log2phy in [eplb.placement[1]] + [
        np.asarray(ex["log2phy"]) for ex in moe_experts(engine.runner.params, model.cfg)
    ]:
        for layer in log2phy.reshape(-1, *log2phy.shape[-2:]):
            for slots in layer:
                slots = slots[slots >= 0]
                assert len(set(slots // slots_per_rank // ranks_per_node)) == 1, slots
    assert (eplb.placement[2] > 1).any()  # some expert really is replicated


def test_speculative_engine_equals_plain_greedy(model, eos_ref):
    """exact verification with greedy sampling: the same tokens as plain decoding, also in reused slots and pages
    (two slots for three requests), with acceptance counted in the usage. Under the decode plan (DP=2 x EP=2) the MTP
    modules' MoE exchanges tokens over EP like the target's: the greedy drafts, hence the acceptance counts, are the
    same as on one device (were the MTP experts run on a rank's local shards alone, they would differ)."""
    from sharding.plans import decode_plan

    spec = hcfjax.SpeculativeConfig(2)
    accepted = []
    for ranks in (1, 2):
        config = EngineConfig(max_slots=2 // ranks, dp=ranks, token_budget=32, speculative=spec, min_prefill_bucket=32)
        engine = Engine(model, config, decode_plan(2) if ranks == 2 else None)
        reqs = [engine.submit(p, max_new_tokens=24) for p in PROMPTS[:3]]
        run_all(engine)
        accepted.append([])
        for i, r in enumerate(reqs):
            outs = list(engine.stream(r, timeout=0))
            assert [t for o in outs for t in o.token_ids] == eos_ref.tokens[i], (ranks, i)
            usage = outs[-1].usage
            assert usage.draft_tokens > 0 and 0 < usage.accepted_draft_tokens <= usage.draft_tokens
            accepted[-1].append(usage.accepted_draft_tokens)
        assert_all_free(engine)
    assert accepted[0] == accepted[1]


def test_serving_while_smaller_shapes_compile_in_the_background(model, eos_ref, monkeypatch):
    """warmup(rest_later=True), as a server starts: the decode step and the prefill shape that holds the others now;
    the smaller one in the background (held back here until the requests are served). Meanwhile steps pad to the
    compiled shape, never compile on the serving thread, and give generate's tokens; then every shape is there."""
    engine = Engine(model, EngineConfig(max_slots=2, token_budget=24, max_prefill_rows=1))
    runner, release = engine.runner, threading.Event()
    compile_now = runner._compile

    def held_back(pre, dec):
        if pre is not None and pre.tokens.shape == (1, 16) and threading.current_thread().name.startswith("hcfjax-"):
            assert release.wait(120)  # (the warm-up's compile threads only)
        return compile_now(pre, dec)

    monkeypatch.setattr(runner, "_compile", held_back)
    engine.warmup(rest_later=True)
    assert set(runner.executables) == {decode_key(2), (1, 24)} and runner.compiling()  # chunks of 16 tokens: not yet
    n = 6
    ref = [row[:n] for row in eos_ref.tokens]  # generate's for n tokens (greedy rows do not depend on how far they run)
    reqs = [engine.submit(p, max_new_tokens=n) for p in PROMPTS]
    run_all(engine)
    assert [collect(engine, r)[0] for r in reqs] == ref
    assert runner.compiles == []  # nothing compiled on first use
    release.set()
    runner._later.join(120)
    assert set(runner.executables) == {decode_key(2), (1, 16), (1, 24)} and not runner.compiling()
    with xla_compiles() as compiles:
        req = engine.submit(PROMPTS[0], max_new_tokens=n)
        run_all(engine)
    assert compiles == [] and collect(engine, req)[0] == ref[0]


def test_a_restart_loads_its_compiled_steps(tmp_path):
    """Compiled steps kept under executable_cache: a second engine of the same config loads every shape, compiles
    nothing, and serves the same tokens; a new shape makes a new entry. (bfloat16: XLA:CPU cannot serialize
    the float32 sort of top-p sampling; a step it cannot store is compiled and used all the same.)"""
    model = hcfjax.load()
    config = EngineConfig(max_slots=2, token_budget=24, max_prefill_rows=1, executable_cache=str(tmp_path))
    first = Engine(model, config)
    first.warmup()
    assert first.runner.disk.misses == 3 and len(list(tmp_path.glob("*.step"))) == 3
    second = Engine(model, config)
    with xla_compiles() as compiles:
        second.warmup()
        outs = []
        for engine in (first, second):
            req = engine.submit(PROMPTS[0], max_new_tokens=5, stop_token_ids=[])
            run_all(engine)
            outs.append(collect(engine, req)[0])
    assert second.runner.disk.hits == 3 and second.runner.disk.misses == 0 and compiles == []
    assert outs[0] == outs[1]
    Engine(model, dataclasses.replace(config, token_budget=32)).warmup()
    assert len(list(tmp_path.glob("*.step"))) == 4  # only (1, 32) is new: the other programs are the same


@pytest.mark.parametrize("spec", [None, "rejection"])
def test_sampled_request_does_not_depend_on_its_batch(model, eos_ref, spec):
    """A seeded request samples the same tokens alone and among others: its keys come from its seed and counter,
    with speculation too (drafts, verification and recovered tokens). Plain: alone it decodes in a 1-row step, in
    the crowd (slot 2) in a 3-row one. Speculative: both in 4-row steps of 8 slots, and the crowd's prompts prefilled
    one a step, as the request's is (two programs fewer to compile).
    With branch-free sampling (a GPU's default) the crowd's greedy requests decode in steps without the filters'
    sort until the top-p request joins and after it ends, and give generate's tokens (plain)."""
    sp = SamplingParams(temperature=0.9, top_p=0.95)
    spec = spec and hcfjax.SpeculativeConfig(2, method=spec)
    rows = dict(max_slots=8, min_decode_rows=4, max_prefill_rows=1) if spec else dict(max_slots=4, min_decode_rows=1)
    config = EngineConfig(**rows, speculative=spec, options=Options(branch_free_sampling=True))
    alone = Engine(model, config)
    r = alone.submit(PROMPTS[0], sampling=sp, seed=7, max_new_tokens=12, stop_token_ids=[])
    run_all(alone)
    crowd = Engine(model, config)
    keys, run = [], crowd.runner._run
    crowd.runner._run = lambda key, *a: keys.append(key) or run(key, *a)
    others = [crowd.submit(p, max_new_tokens=24) for p in PROMPTS[1:3]]
    for _ in range(4):
        crowd.step()
    r2 = crowd.submit(PROMPTS[0], sampling=sp, seed=7, max_new_tokens=12, stop_token_ids=[])
    run_all(crowd)
    assert collect(alone, r)[0] == collect(crowd, r2)[0]
    decoded = [k[2] for k in keys if k[0] == "decode"]  # with the filters, or not
    assert decoded[0] is False and decoded[-1] is False and True in decoded
    if not spec:
        assert [collect(crowd, o)[0] for o in others] == eos_ref.tokens[1:3]


def test_decode_steps_pack_their_requests_into_the_fewest_rows(model, eos_ref):
    """min_decode_rows=1 over 4 slots: a step decodes 1, 2, 3 or 4 rows (`decode_bucket`), the fewest that hold the
    requests decoding, wherever their slots are. Three requests of 4, 6 and 8 tokens decode in slots 0-2 (3 rows)
    when a long one joins in slot 3; once they end, the long one decodes alone (one row, reading and writing slot 3).
    All give generate's greedy tokens. (Speculative steps of fewer rows than slots:
    test_sampled_request_does_not_depend_on_its_batch.)
    The plain sampled test's config, branch-free sampling included (these greedy rows decode in steps without the
    filters): the steps it compiled serve this engine too."""
    config = EngineConfig(max_slots=4, min_decode_rows=1, options=Options(branch_free_sampling=True))
    engine = Engine(model, config)
    dispatch, rows = engine.runner.dispatch, []

    def seen(plan):
        d = dispatch(plan)
        if d.nxt is not None:
            rows.append((jax.tree.leaves(d.nxt)[0].shape[0], len(plan.decode), max(r.slot for r in plan.decode)))
        return d

    engine.runner.dispatch = seen
    lengths = {1: 4, 2: 6, 4: 8}  # PROMPTS index: tokens
    short = [engine.submit(PROMPTS[i], max_new_tokens=n) for i, n in lengths.items()]
    while not rows or rows[-1][1] < 3:  # the three decoding in slots 0-2
        engine.step()
    long = engine.submit(PROMPTS[0], max_new_tokens=24)
    run_all(engine)
    assert long.slot == -1 and collect(engine, long)[0] == eos_ref.tokens[0]
    assert [collect(engine, r)[0] for r in short] == [eos_ref.tokens[i][:n] for i, n in lengths.items()]
    assert all(n == k for n, k, _ in rows)  # (1 to 4 requests: as many rows)
    assert (3, 3, 2) in rows and (4, 4, 3) in rows and (1, 1, 3) in rows  # the long one joins in slot 3, then alone
    assert {n for n, _, _ in rows} == {1, 2, 3, 4} and engine.runner.decode_sizes == [1, 2, 3, 4]
    assert_all_free(engine)


def test_abort_and_shutdown_free_everything(model):
    # the warm-up test's config: the steps it compiled serve this engine too
    engine = Engine(model, EngineConfig(max_slots=2, token_budget=24, max_prefill_rows=1))
    a = engine.submit(PROMPTS[1], max_new_tokens=50, stop_token_ids=[])
    b = engine.submit(PROMPTS[2], max_new_tokens=50, stop_token_ids=[])
    c = engine.submit(PROMPTS[3], max_new_tokens=50, stop_token_ids=[])  # waits for a slot
    for _ in range(4):
        engine.step()
    engine.abort(a.id)
    engine.step()
    assert collect(engine, a)[2] == FinishReason.ABORT and a.status == Status.ABORTED
    engine.start()
    engine.shutdown()
    for r in (b, c):
        assert list(engine.stream(r, timeout=1))[-1].finish == FinishReason.ABORT
    assert_all_free(engine)
    with pytest.raises(Exception, match="shutting down"):
        engine.submit("x")


def test_an_error_that_stops_the_loop_ends_every_request(model):
    """An error outside a step's dispatch (a device fault that surfaces where the tokens are read) stops the loop:
    every request held, queued or running, ends with it, the engine is no longer ready, and a new request is
    refused with it, instead of streams that never end."""
    engine = Engine(model, EngineConfig(max_slots=2, token_budget=24, max_prefill_rows=1))
    process, told = engine._process, []

    def faulty(d):
        if engine.steps >= 3:
            raise RuntimeError("CUDA_ERROR_LAUNCH_FAILED: unspecified launch failure")
        process(d)

    engine._process = faulty
    engine.on_failure(told.append)
    reqs = [engine.submit(p, max_new_tokens=50, stop_token_ids=[]) for p in PROMPTS[1:4]]  # the third waits
    engine.start()
    for r in reqs:
        last = list(engine.stream(r, timeout=60))[-1]
        assert last.finish == FinishReason.ERROR and "unspecified launch failure" in last.error
    assert not engine.ready() and told == ["RuntimeError: CUDA_ERROR_LAUNCH_FAILED: unspecified launch failure"]
    with pytest.raises(EngineStopped, match="stopped after an error: RuntimeError: CUDA_ERROR_LAUNCH_FAILED"):
        engine.submit("x")
    engine.shutdown()


def test_steps_compile_from_shapes_while_the_weights_load(model, eos_ref):
    """Engine(weights=future): the model holds only its params' shapes, the decode step compiles from them, and
    the engine starts once the weights arrive (from another thread), with generate's tokens. Weights of other
    shapes are refused at start."""
    import concurrent.futures

    on = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on), model.params)
    config = EngineConfig(max_slots=2, token_budget=24, max_prefill_rows=1)
    weights = concurrent.futures.Future()
    engine = Engine(dataclasses.replace(model, params=shapes), config, weights=weights)
    assert engine.runner.warmup(prefill=False) == 1  # from the shapes alone
    threading.Timer(0.2, weights.set_result, (model.params,)).start()
    reqs = [engine.submit(p, max_new_tokens=24) for p in PROMPTS[:2]]
    engine.start()
    assert engine.model.params is model.params
    try:
        assert [collect_live(engine, r) for r in reqs] == eos_ref.tokens[:2]
    finally:
        engine.shutdown()
    other = concurrent.futures.Future()
    cut = jax.jit(lambda params: jax.tree.map(lambda x: x[..., :1], params))  # one program, not one a leaf
    other.set_result(cut(model.params))
    engine = Engine(dataclasses.replace(model, params=shapes), config, weights=other)
    with pytest.raises(ValueError, match="shapes the steps were compiled for"):
        engine.start()


def collect_live(engine: Engine, req) -> list[int]:
    return [t for o in engine.stream(req, timeout=120) for t in o.token_ids]


def test_bad_requests_are_refused(model):
    # the warm-up test's config, whose steps serve this engine too, with a queue of two
    engine = Engine(model, EngineConfig(max_slots=2, token_budget=24, max_prefill_rows=1, max_queue=2))
    context = engine.max_model_len
    assert context == 2048 and engine.door.max_prompt_chars < 100_000
    for kw, match in [
        (dict(prompt=""), "empty"),
        (dict(prompt=[]), "empty"),
        (dict(prompt=[1, model.cfg.vocab_size]), "outside the vocabulary"),
        (dict(prompt=[5] * (context + 36)), f"the context is {context}"),
        (dict(prompt="x" * 100_000), "characters"),
        (dict(prompt="\ud800abc", max_new_tokens=4), "UTF-8"),
        (dict(prompt="x", max_new_tokens=context), "exceed the context"),
        (dict(prompt="x", max_new_tokens=0), "max_new_tokens"),
        (dict(prompt="x", max_new_tokens=4, seed=-1), "seed"),
        (dict(prompt="x", max_new_tokens=4, stop_token_ids=[-3]), "stop token"),
        (dict(prompt="x", max_new_tokens=4, stop=["s"] * 17), "stop strings"),
        (dict(prompt="x", max_new_tokens=4, sampling=SamplingParams(top_k=2**31 - 1)), "top_k"),
        (dict(prompt="x", max_new_tokens=4, request_id="r" * 257), "request_id"),
    ]:
        with pytest.raises(InvalidRequest, match=match):
            engine.submit(**kw)
    engine.submit("a", max_new_tokens=2)
    engine.submit("b", max_new_tokens=2)
    with pytest.raises(QueueFull):
        engine.submit("c", max_new_tokens=2)
    run_all(engine)
    assert_all_free(engine)


def test_stop_strings_end_requests_with_exact_usage(model, eos_ref):
    """A stop string across a token boundary ends the request: its text cut just before it, the token that
    completed it the last one, counted in the usage; with speculation too (several tokens accepted per step, those
    after the stop dropped). Its first character is held back until the next token shows the string."""
    # generate's tokens without a stop token: eos_ref's rows that ran to the limit, hence met no eos
    ref = eos_ref.tokens[:2]
    assert all(len(toks) == 24 for toks in ref)
    cases = [engine_helpers.stop_across_tokens(model.tokenizer, toks) for toks in ref]
    for spec in (None, hcfjax.SpeculativeConfig(2)):
        # the speculative engine test's config: the steps it compiled serve this engine too
        engine = Engine(model, EngineConfig(max_slots=2, token_budget=32, speculative=spec, min_prefill_bucket=32))
        reqs = [
            engine.submit(p, max_new_tokens=24, stop_token_ids=[], stop=["@@never@@", stop])
            for p, (stop, _, _) in zip(PROMPTS, cases, strict=False)
        ]
        run_all(engine)
        for r, toks, (stop, n, text) in zip(reqs, ref, cases, strict=True):
            outs = list(engine.stream(r, timeout=0))
            assert [t for o in outs for t in o.token_ids] == toks[:n], (spec, stop)
            assert "".join(o.text for o in outs) == text and stop not in text
            assert outs[-1].finish == FinishReason.STOP and outs[-1].usage.output_tokens == n
        assert_all_free(engine)


def test_server_made_ids_do_not_collide_with_chosen_ones(model):
    engine = Engine(model, EngineConfig(max_queue=64))
    chosen = [engine.submit([5, 6], max_new_tokens=2, request_id=f"req-{i}").id for i in range(16)]
    made = [engine.submit([5, 6], max_new_tokens=2).id for _ in range(16)]
    assert len(set(chosen + made)) == 32
    with pytest.raises(InvalidRequest, match="in use"):
        engine.submit([5, 6], max_new_tokens=2, request_id="req-3")
    engine.shutdown()
    assert_all_free(engine)


def test_engine_steps_have_no_branch_the_host_decides(model):
    """With Options.branch_free_sampling (auto: on GPUs) no step program holds a conditional, speculative ones
    included: XLA's GPU runtime reads a conditional's predicate back to the host and waits for the stream, so the
    engine could not prepare step n + 1 while step n runs. Without it (a CPU's default) the sort is skipped by one.
    Branch-free, the runner also has decode steps without the filters: those hold no sort at all with
    Options.sort_free_routing (auto: on GPUs), which orders the experts' copies pairwise."""
    from hcfjax.speculative import SpeculativeConfig
    from hcfjax.step import jitted_step

    for branch_free in (True, False):
        for spec in (None, SpeculativeConfig(2)):
            opts = Options(branch_free_sampling=branch_free, sort_free_routing=branch_free)
            config = EngineConfig(max_slots=2, token_budget=16, max_prefill_rows=1, speculative=spec, options=opts)
            r = Engine(model, config).runner
            for pre, dec in ((r.idle_prefill((1, 16)), None), (None, r.idle_decode())):
                text = jitted_step.lower(r.params, r.cfg, r.state, pre, dec, r.spec, r.options).as_text()
                branches = "stablehlo.if" in text or "stablehlo.case" in text
                assert branches != branch_free, (branch_free, spec, pre is None)
            if branch_free:
                assert r.decode_filters == (True, False)
                dec = r.idle_decode(filters=False)
                text = jitted_step.lower(r.params, r.cfg, r.state, None, dec, r.spec, r.options).as_text()
                assert "stablehlo.sort" not in text and "stablehlo.if" not in text, spec
