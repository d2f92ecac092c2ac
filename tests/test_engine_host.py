"""The engine loop's host work a step: the decode rows' inputs when a request takes a new page, and the plan; and
the streams' readers, which merge the events they fell behind on."""

from __future__ import annotations

import dataclasses
import queue

import jax.numpy as jnp
import numpy as np
import pytest

import hcfjax
from hcfjax.engine import Engine, EngineConfig
from hcfjax.engine.balance import POLICIES
from hcfjax.engine.request import FinishReason, Output, Request, Status, Usage, next_output
from hcfjax.engine.scheduler import Scheduler, SchedulerConfig, StepPlan
from hcfjax.sampling import SamplingParams


@pytest.fixture(scope="module")
def model():
    return hcfjax.load(dtype=jnp.float32)


def _request(rid: str, slot: int, pages: list[int], temperature: float) -> Request:
    req = Request(rid, [1, 2, 3], SamplingParams(temperature=temperature), 8, frozenset(), 7 + slot, 0.0)
    req.slot, req.rank, req.pages, req.status = slot, 0, list(pages), Status.DECODING
    return req


def _host(inputs) -> list[np.ndarray]:
    return [np.asarray(x) for x in (inputs.active, inputs.page_table, inputs.seed, inputs.slot, inputs.sp.temperature)]


def test_a_new_page_rewrites_only_the_page_table_and_equals_a_fresh_build(model):
    """When a decoding request takes a new page, the last decode inputs are reused but for their page table, into
    which only the new pages are written; the result equals inputs built from nothing, whatever the order of the
    rows' growth, and a request joining or leaving builds them anew."""
    engine = Engine(model, EngineConfig(max_slots=4, page_size=16, max_model_len=256))
    runner = engine.runner
    reqs = [_request("a", 2, [5], 0.0), _request("b", 0, [9, 3], 0.7), _request("c", 3, [1], 1.0)]

    def fresh(plan):
        saved, runner._last_decode = runner._last_decode, None
        try:
            return runner._decode_inputs(plan)
        finally:
            runner._last_decode = saved

    plan = StepPlan([], reqs)
    first, rows = runner._decode_inputs(plan)
    for grow in ([0], [1, 2], [], [2, 2, 0]):  # requests taking pages (one twice: two pages at once)
        for i in grow:
            reqs[i].pages.append(20 + len(reqs[i].pages) + 4 * i)
        got, got_rows = runner._decode_inputs(plan)
        want, want_rows = fresh(plan)
        assert got_rows == want_rows == rows
        for a, b in zip(_host(got), _host(want), strict=True):
            np.testing.assert_array_equal(a, b)
        assert got.active is first.active and got.sp is first.sp  # only the table went to the device again
        assert np.asarray(got.page_table)[rows[0], : len(reqs[0].pages)].tolist() == reqs[0].pages
    reqs[1].pages.pop()  # (pages never shrink while decoding; if they did, the rows would be built anew)
    got, _ = runner._decode_inputs(plan)
    assert got.active is not first.active
    np.testing.assert_array_equal(_host(got)[1], _host(fresh(plan)[0])[1])
    joined, before = StepPlan([], reqs + [_request("d", 1, [30], 0.0)]), got
    got, _ = runner._decode_inputs(joined)
    assert got.active is not before.active and int(np.asarray(got.active).sum()) == 4


def test_a_plan_preempts_the_newest_request_of_a_rank_out_of_pages(model):
    """The scheduler's decode plan (which tells running requests by their slot): a rank out of pages preempts its
    newest request, which leaves the plan, frees its slot and pages, and waits again with its epoch bumped; the
    others each take the page they need."""
    engine = Engine(model, EngineConfig(max_slots=3, page_size=16, num_pages=5, max_model_len=64))
    sched = engine.scheduler
    reqs = [_request(r, -1, [], 0.0) for r in "abc"]
    for req in reqs:
        req.status, req.rank = Status.QUEUED, -1  # (waiting: no slot, no rank)
        sched.add(req)
        assert sched._admit(req, sched.loads())
        req.status = Status.DECODING
        req.computed = req.cached_bound = 16  # one page full: the next step needs a second page
    assert [len(r.pages) for r in reqs] == [1, 1, 1] and sched.alloc[0].num_free == 2
    decode = sched._plan_decode()
    assert decode == reqs[:2] and [len(r.pages) for r in reqs[:2]] == [2, 2]
    newest = reqs[2]
    assert newest.slot == -1 and newest.pages == [] and newest.epoch == 1 and newest.status == Status.QUEUED
    assert list(sched.waiting) == [newest] and sched.running == reqs[:2] and sched.preemptions == 1


def test_requests_are_bounded_by_what_a_ranks_pages_hold(model):
    """An explicit pool smaller than one request at max_model_len bounds the context a request may ask for: a longer
    one could never be admitted and would wait forever, so the front door refuses it (context_length_exceeded). A pool
    that cannot hold one token of output, or a max_model_len past the model's context, is refused at start."""
    from hcfjax.engine import InvalidRequest
    from hcfjax.kernels import engine_summary

    engine = Engine(model, EngineConfig(max_slots=2, page_size=16, num_pages=2))  # 32 tokens, 2 of lookahead
    assert engine.max_model_len == 30 and engine.context_from_pages
    assert "requests of up to 30 tokens (what a rank's pages hold)" in engine_summary(engine)
    with pytest.raises(InvalidRequest, match="exceed the context of 30") as e:
        engine.submit([5] * 10, max_new_tokens=21)
    assert e.value.code == "context_length_exceeded"
    engine.submit([5] * 10, max_new_tokens=20)  # fits: queued
    with pytest.raises(ValueError, match="cannot hold one request"):
        Engine(model, EngineConfig(max_slots=2, page_size=2, num_pages=1))
    too_long = model.cfg.max_position_embeddings + 1
    with pytest.raises(ValueError, match=f"max_model_len {too_long} is longer than the model's context"):
        Engine(model, EngineConfig(max_model_len=too_long))
    roomy = Engine(model, EngineConfig(max_slots=2, page_size=16, num_pages=5, max_model_len=64))
    assert roomy.max_model_len == 64 and not roomy.context_from_pages


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("remote", [False, True])
def test_admissions_keep_the_ranks_loads_as_a_fresh_count_gives_them(policy, remote):
    """A plan counts the ranks' loads once and updates them at each admission: after every one they equal what
    loads() counts afresh, over two ranks with requests already running (grown, with outputs), until a rank runs
    out of slots and another of pages."""
    cfg = SchedulerConfig(dp=2, max_slots=4, num_pages=20, page_size=16, token_budget=4096, max_prefill_rows=16)
    sched = Scheduler(dataclasses.replace(cfg, balance=policy, remote_prefill=remote))
    sched.out_lens.extend([20, 40, 37])
    for i, (prompt, out) in enumerate([(30, 5), (70, 0), (5, 60)]):
        req = Request(f"run{i}", list(range(prompt)), SamplingParams(), 100, frozenset(), 0, 0.0)
        req.output = list(range(out))
        sched.add(req)
    sched.schedule(0.0)
    for req in sched.running:
        req.status, req.computed = Status.DECODING, len(req.fill)
        req.cached_bound = req.computed
    checked, admit = [], sched._admit

    def admit_and_compare(req, loads):
        admitted = admit(req, loads)
        if admitted:
            assert loads == sched.loads()
            checked.append(req.id)
        return admitted

    sched._admit = admit_and_compare
    for i, prompt in enumerate([3, 40, 17, 100, 9, 64, 2]):
        sched.add(Request(f"new{i}", list(range(prompt)), SamplingParams(), 30 + i, frozenset(), 0, 0.5 + i))
    sched.schedule(1.0)
    assert len(checked) >= 3 and sched.waiting  # some admitted, the rest left waiting for room
    assert {r.rank for r in sched.running} == {0, 1}


def test_a_reader_behind_the_engine_gets_what_it_missed_in_one_event():
    """next_output: one event when the reader keeps up; the events queued behind it merged into one (tokens and
    text in order, the last one's finish, usage and error) when it fell behind; queue.Empty after the timeout."""
    events = queue.SimpleQueue()

    def put(tokens, text, finish=None, error=None):
        events.put(Output("r", tokens, text, finish, Usage(3, len(tokens), 0.1), error))

    put([5], "a")
    assert next_output(events, 0.1) == Output("r", [5], "a", None, Usage(3, 1, 0.1))
    put([6], "b")
    put([7, 8], "cd")
    assert next_output(events, 0.1) == Output("r", [6, 7, 8], "bcd", None, Usage(3, 2, 0.1))
    put([9], "e")
    put([], "", FinishReason.ERROR, "boom")
    put([1], "late")  # nothing is merged past a request's last event
    assert next_output(events, 0.1) == Output("r", [9], "e", FinishReason.ERROR, Usage(3, 0, 0.1), "boom")
    assert next_output(events, 0.1).token_ids == [1]
    with pytest.raises(queue.Empty):
        next_output(events, 0.01)
