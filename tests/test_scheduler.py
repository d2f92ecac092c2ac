"""The serving engine's host-side parts alone, on a fake clock: the page allocator's reference counts, the
scheduler's policies (shortest prompt first within a window, bounded waits, the token budget and chunking,
admission by expected output) and the DP balancer's."""

import pytest

from hcfjax.engine import FinishReason
from hcfjax.engine.balance import Balancer, RankLoad
from hcfjax.engine.pages import OutOfPages, PageAllocator
from hcfjax.engine.request import Request
from hcfjax.engine.scheduler import Scheduler, SchedulerConfig
from hcfjax.sampling import SamplingParams


def test_page_allocator_reference_counts():
    a = PageAllocator(4, 16, base=8)
    p = a.allocate(3)
    assert sorted(p) == [8, 9, 10] and a.num_free == 1 and a.pages_for(33) == 3
    a.share(p[:1])
    a.release(p)
    assert a.num_free == 3 and a.refcount(p[0]) == 1
    a.release(p[:1])
    assert a.num_free == 4
    with pytest.raises(ValueError, match="twice"):
        a.release(p[:1])
    with pytest.raises(OutOfPages):
        a.allocate(5)
    with pytest.raises(ValueError, match="range"):
        a.release([3])


def make_req(rid, n, arrival, max_new=8):
    return Request(rid, list(range(1, n + 1)), SamplingParams(), max_new, frozenset(), 0, arrival)


def test_shortest_prompt_first_within_a_window_and_bounded_wait():
    s = Scheduler(SchedulerConfig(max_slots=8, token_budget=1000, max_prefill_rows=1, spf_window_s=1.0, max_wait_s=5))
    long_, short = make_req("long", 50, 0.1), make_req("short", 5, 0.2)
    later = make_req("later", 2, 1.5)  # shorter, but arrived in the next window
    for r in (long_, later, short):
        s.add(r)
    order = [s.schedule(now=2.0).chunks[0].req.id for _ in range(3)]
    assert order == ["short", "long", "later"]

    s = Scheduler(SchedulerConfig(max_slots=8, token_budget=1000, max_prefill_rows=1, spf_window_s=1.0, max_wait_s=5))
    old = make_req("old", 50, 0.0)
    s.add(old)
    for i in range(3):
        s.add(make_req(f"s{i}", 3, 0.5))
    assert s.schedule(now=1.0).chunks[0].req.id == "s0"  # not yet starving
    assert s.schedule(now=6.0).chunks[0].req.id == "old"  # waited max_wait_s: goes first


def test_token_budget_and_chunking():
    s = Scheduler(SchedulerConfig(max_slots=4, token_budget=20, max_prefill_rows=4))
    a, b = make_req("a", 30, 0.0), make_req("b", 4, 0.0)
    s.add(a)
    s.add(b)
    plan = s.schedule(0.0)
    assert [(c.req.id, c.start, c.n, c.final) for c in plan.chunks] == [("b", 0, 4, True), ("a", 0, 16, False)]
    plan = s.schedule(0.0)  # b decodes (1 token of budget), a continues
    assert [r.id for r in plan.decode] == ["b"] and [(c.start, c.n, c.final) for c in plan.chunks] == [(16, 14, True)]
    # with mixed_token_budget a step that decodes carries fewer prefill tokens; one that does not, the full budget
    s = Scheduler(SchedulerConfig(max_slots=4, token_budget=20, mixed_token_budget=8, max_prefill_rows=4))
    a, b = make_req("a", 40, 0.0), make_req("b", 4, 0.0)
    s.add(a)
    s.add(b)
    assert [(c.req.id, c.n) for c in s.schedule(0.0).chunks] == [("b", 4), ("a", 16)]  # nothing decodes yet
    plan = s.schedule(0.0)
    assert [r.id for r in plan.decode] == ["b"] and [(c.start, c.n) for c in plan.chunks] == [(16, 7)]
    s.finish(b, FinishReason.LENGTH)
    assert [(c.start, c.n) for c in s.schedule(0.0).chunks] == [(23, 17)]  # prefill alone again


def test_admission_uses_expected_output_and_reports_growth():
    cfg = SchedulerConfig(max_slots=8, num_pages=10, page_size=10, token_budget=1000, max_prefill_rows=8)
    s = Scheduler(cfg)
    s.out_lens.extend([40] * 4)  # recent requests produced 40 tokens
    reqs = [make_req(f"r{i}", 10, 0.0, max_new=100) for i in range(4)]
    for r in reqs:
        s.add(r)
    plan = s.schedule(0.0)
    # each needs pages for 10 + 40 + 1 tokens = 6 pages; 10 pages admit one, the second would need 12
    assert len(plan.chunks) == 1 and s.should_grow
    s.out_lens.extend([5] * 64)  # outputs got short: 10 + 5 + 1 tokens = 2 pages each
    plan = s.schedule(0.0)
    assert len(plan.chunks) == 3 and not s.should_grow


@pytest.mark.parametrize(
    "policy,expected",
    [("round_robin", [1, 2, 0, 1]), ("fewest_requests", [2, 2, 2, 2]), ("least_pages", [0, 0, 0, 0])],
)
def test_balance_policies(policy, expected):
    b = Balancer(policy, 3)
    b._next = 1
    loads = [RankLoad(0, 5, 2, 90), RankLoad(1, 3, 1, 40), RankLoad(2, 1, 3, 10)]
    assert [b.choose(loads, 5) for _ in range(4)] == expected
    assert b.choose(loads, 95) is None
    assert Balancer(policy, 3).choose([RankLoad(0, 0, 0, 100), RankLoad(1, 9, 1, 1), RankLoad(2, 0, 4, 0)], 1) == 1
