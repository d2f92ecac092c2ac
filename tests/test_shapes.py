"""The engine's step shapes: whatever the scheduler plans pads to a shape the warm-up compiled, within the token
budget, and every prompt still gets prefilled (fuzzed with hypothesis over budgets, row limits and prompt mixes)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from hcfjax.engine.request import FinishReason, Request, Status
from hcfjax.engine.scheduler import Scheduler, SchedulerConfig
from hcfjax.engine.shapes import StepShapes
from hcfjax.sampling import SamplingParams


def test_shapes_stay_few_and_within_the_budget():
    shapes = StepShapes(token_budget=4096, max_rows=4, min_bucket=128)
    assert shapes.all() == [(1, t) for t in (128, 256, 512, 1024, 2048, 4096)] + [
        (2, t) for t in (128, 256, 512, 1024, 2048)
    ] + [(4, t) for t in (128, 256, 512, 1024)]
    odd = StepShapes(token_budget=3000, max_rows=3, min_bucket=16)  # a budget that is not a power of two
    assert max(t for _, t in odd.all()) == 3000 and odd.tokens(2500) == 3000 and odd.rows(3) == 3
    assert all(r * t <= 3000 for r, t in odd.all())
    spec = StepShapes(token_budget=256, max_rows=2, min_bucket=16, whole_prompts=True, max_len=1000)
    assert (1, 1024) in spec.all() and (2, 256) not in spec.all()  # whole prompts: long ones alone, up to max_len
    # the shapes a server compiles before it is ready: every other one fits one of them
    assert shapes.maximal() == [(1, 4096), (2, 2048), (4, 1024)]
    for s in (shapes, odd, spec):
        assert all(any(b >= r and u >= t for b, u in s.maximal()) for r, t in s.all())
        assert all(not (b >= r and u >= t) for r, t in s.maximal() for b, u in s.maximal() if (b, u) != (r, t))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    budget=st.integers(8, 600),
    max_rows=st.integers(1, 6),
    min_bucket=st.sampled_from([1, 4, 16, 64]),
    whole=st.booleans(),
    prompts=st.lists(st.integers(1, 700), min_size=1, max_size=12),
    finish_every=st.integers(1, 5),
)
def test_every_plan_pads_to_a_compiled_shape(budget, max_rows, min_bucket, whole, prompts, finish_every):
    max_len = 1024
    shapes = StepShapes(budget, max_rows, min_bucket, whole, max_len)
    compiled = set(shapes.all())
    cfg = SchedulerConfig(
        max_slots=4, num_pages=400, page_size=16, token_budget=budget, max_prefill_rows=max_rows,
        whole_prompts=whole, shapes=shapes, spf_window_s=0.0,
    )  # fmt: skip
    s = Scheduler(cfg)
    reqs = [Request(f"r{i}", [1] * n, SamplingParams(), 4, frozenset(), 0, 0.0) for i, n in enumerate(prompts)]
    for r in reqs:
        s.add(r)
    for step in range(2 * sum(prompts) + 100):  # a step prefills at least one token while any is left
        plan = s.schedule(now=float(step))
        if plan.chunks:
            rows, tokens = shapes.rows(len(plan.chunks)), shapes.tokens(max(c.n for c in plan.chunks))
            assert (rows, tokens) in compiled
            assert rows * tokens <= shapes.cap or (whole and len(plan.chunks) == 1)
            assert sum(c.n for c in plan.chunks) <= max(budget - len(plan.decode), 0) or (
                whole and len(plan.chunks) == 1
            )
        for r in plan.decode:  # decoding requests end after a few steps, freeing their slots
            r.output.append(1)
            if len(r.output) >= finish_every:
                s.finish(r, FinishReason.LENGTH)
        if all(r.status == Status.FINISHED for r in reqs):
            break
    assert all(r.status == Status.FINISHED for r in reqs)  # nothing starves behind the padded budget
