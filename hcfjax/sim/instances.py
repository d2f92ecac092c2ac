"""Simulated instances: the engine's Scheduler, unchanged, driven by a simulated clock; the model step is a cost.

- `EngineInstance` is hcfjax's engine loop (hcfjax/engine/engine.py `step`): take the inbox, plan step n + 1,
  dispatch it, then read back step n's tokens and retire finished requests. The device runs steps back to back;
  step n + 1 starts when the device is free and the host has planned it (`host_dispatch_s` after the iteration
  began). Reading step n back waits for it to end and costs `host_process_s`; its tokens are stamped then. So a
  finished request still runs in step n + 1, as in the engine.
- `DecodeInstance` (PD): the same loop, but the Scheduler's admissions are not prefilled here. A request the
  Scheduler admits keeps its rank, slot and pages and goes to a prefill instance; when its KV cache has arrived it
  turns into a decoding request whose first token is the one the prefill sampled: the Scheduler's remote-prefill
  mode (StepPlan.remote, Scheduler.activate), as on a real PD decode worker (hcfjax/pd/decode.py).
- `PrefillInstance` (PD): chunked prefill of whole prompts with its own Scheduler; a prompt's last chunk samples
  the first token, then the KV cache goes to the decode rank: whole after the last layer below the threshold,
  layerwise above it (streamed while the prompt is computed, so about one layer's share is left at the end).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import random
from collections.abc import Callable

from hcfjax.engine.request import FinishReason, Request, Status
from hcfjax.engine.scheduler import Chunk, Scheduler, SchedulerConfig, StepPlan
from hcfjax.sampling import SamplingParams

_GREEDY = SamplingParams()


class Clock:
    """The event loop: callbacks at simulated times, in time order (ties in the order they were scheduled)."""

    def __init__(self):
        self.now = 0.0
        self._heap: list = []
        self._seq = itertools.count()
        self.stopped = False

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn))

    def run(self) -> None:
        while self._heap and not self.stopped:
            t, _, fn = heapq.heappop(self._heap)
            self.now = t
            fn()


class Tokens:
    """A token sequence known only by its length: the scheduler reads lengths, never ids (saves the memory of
    millions of prompt tokens). Supports what Scheduler does with prompts: len() and `prompt + output`."""

    __slots__ = ("n",)

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __add__(self, other) -> Tokens:
        return Tokens(self.n + len(other))


def _no_trace(event: str, rid: str, t: float) -> None:
    pass


def new_request(rid: str, prompt_len: int, max_new: int, arrival: float) -> Request:
    p = Tokens(prompt_len)
    return Request(rid, p, _GREEDY, max_new, frozenset(), 0, arrival, fill=p)


@dataclasses.dataclass
class _Step:
    end: float
    chunks: list[tuple[Chunk, int]]  # the chunks this step computed, with their request's epoch at dispatch
    decode: list[tuple[Request, int]]


@dataclasses.dataclass(frozen=True)
class Host:
    dispatch_s: float = 0.0
    process_s: float = 0.0


class Acceptance:
    """Draws how many of k drafts a verification step accepts, from acceptance rates per depth (conditional)."""

    def __init__(self, rates: list[float], seed: int):
        self.rates, self.rng = list(rates), random.Random(seed)

    @property
    def k(self) -> int:
        return len(self.rates)

    def draw(self) -> int:
        n = 0
        for a in self.rates:
            if self.rng.random() >= a:
                break
            n += 1
        return n


class EngineInstance:
    """A colocated instance: hcfjax's engine loop over one Scheduler (every DP rank of the instance)."""

    def __init__(
        self,
        clock: Clock,
        name: str,
        cfg: SchedulerConfig,
        step_seconds: Callable[[StepPlan], float],
        host: Host = Host(),
        acceptance: Acceptance | None = None,
        on_finish: Callable[[Request, EngineInstance], None] = lambda r, i: None,
    ):
        self.clock, self.name, self.step_seconds, self.host = clock, name, step_seconds, host
        self.sched = Scheduler(cfg)
        self.acceptance, self.on_finish = acceptance, on_finish
        self.k = acceptance.k if acceptance else 0
        self.inbox: list[Request] = []
        self.pending: _Step | None = None
        self.dev_free = 0.0
        self.busy = 0.0
        self.steps = 0
        self.decode_rows = 0
        self.awake = False
        self.processed_end = 0.0  # when the step the last iteration read back ended (the one dispatched before it)
        self.iteration = 0
        self.trace = _no_trace  # (event, request id, simulated time): hcfjax.trace's events, for the PD breakdown

    # -- outside ----------------------------------------------------------------------------------------------------
    def submit(self, req: Request) -> None:
        self.trace("arrive", req.id, self.clock.now)
        self.inbox.append(req)
        self.wake()

    def wake(self) -> None:
        if not self.awake:
            self.awake = True
            self.clock.at(self.clock.now, self._iterate)

    def queued_tokens(self) -> int:
        s = self.sched
        return sum(len(r.fill) for r in [*self.inbox, *s.waiting]) + sum(
            len(r.fill) - r.computed for r in s.running if r.status == Status.PREFILLING
        )

    # -- the loop ---------------------------------------------------------------------------------------------------
    def _iterate(self) -> None:
        t = self.clock.now
        self.iteration += 1
        self._before_plan(t)
        for req in self.inbox:
            self.sched.add(req)
        self.inbox.clear()
        plan = self.sched.schedule(t)
        admitted = self._after_plan(plan, t)
        ready = t + self.host.dispatch_s
        current = None
        seconds = self.step_seconds(plan) if (plan.decode or self._computes_chunks(plan)) else 0.0
        if seconds > 0:
            start = max(ready, self.dev_free)
            self.dev_free = start + seconds
            self.busy += seconds
            self.steps += 1
            self.decode_rows += len(plan.decode)
            chunks = [(c, c.req.epoch) for c in plan.chunks] if self._computes_chunks(plan) else []
            current = _Step(self.dev_free, chunks, [(r, r.epoch) for r in plan.decode])
        nxt = ready
        processed = self.pending is not None
        if processed:
            nxt = max(ready, self.pending.end) + self.host.process_s
            self._process(self.pending, nxt)
            self.processed_end = self.pending.end
        self.pending = current
        if current is None and not processed and not admitted and not self._waiting_to_land():
            self.awake = False  # nothing changes until a request or a KV cache arrives
            return
        self.clock.at(nxt, self._iterate)

    def _computes_chunks(self, plan: StepPlan) -> bool:
        return bool(plan.chunks)

    def _waiting_to_land(self) -> bool:
        return False

    def _before_plan(self, t: float) -> None:
        pass

    def _after_plan(self, plan: StepPlan, t: float) -> bool:
        return False

    def _process(self, step: _Step, now: float) -> None:
        """Engine._process: the step's sampled tokens, dropped for requests finished or preempted since dispatch."""
        new: dict[Request, int] = {}
        for c, epoch in step.chunks:
            if c.final and not c.req.done and c.req.epoch == epoch:
                new[c.req] = 1
        for req, epoch in step.decode:
            if req.done or req.epoch != epoch:
                continue
            n = 1
            if self.acceptance is not None:
                acc = self.acceptance.draw()
                n += acc
                req.drafts += self.k
                req.accepted += acc
            new[req] = n
        for req, n in new.items():
            self._emit(req, n, now)

    def _emit(self, req: Request, n: int, now: float) -> None:
        kept = min(n, req.max_new_tokens - len(req.output))
        req.output += [0] * kept
        if req.first_token_time is None:
            self.trace("first", req.id, now)
        req.first_token_time = req.first_token_time or now
        req.last_token_time = now
        if len(req.output) >= req.max_new_tokens:
            self.sched.finish(req, FinishReason.LENGTH)
            self.on_finish(req, self)
        elif self.k:  # the bound assumed every draft accepted: correct it (one step in flight)
            req.cached_bound = req.length - 1 + self.k + 1


class DecodeInstance(EngineInstance):
    """PD decode: admissions are prefilled by `send(req, epoch, self)`; `deliver(req, epoch)` when the KV arrived.

    waits_for_step (Deployment.transfer_waits_for_step): a transfer whose bytes arrive while a decode step runs
    completes when that step ends, just after the engine began its next iteration, so the following one installs
    it (the engine's `_take_inbox`): about one and a half steps after the bytes arrived, against half a step."""

    def __init__(self, *args, send: Callable[[Request, int, DecodeInstance], None], waits_for_step: bool = False, **kw):
        super().__init__(*args, **kw)
        self.send, self.waits_for_step = send, waits_for_step
        self.arrived: list[tuple[int, Request, int]] = []  # (the iteration that installs it, request, epoch)

    def deliver(self, req: Request, epoch: int) -> None:
        now, k = self.clock.now, self.iteration
        done, install = now, k + 1
        if self.waits_for_step and self.processed_end > now:
            # the step iteration k reads back is running: the transfer completes as it ends, just after iteration
            # k + 1 (which that end starts) took its inbox
            done, install = self.processed_end, k + 2
        elif self.waits_for_step and self.pending is not None:  # the step iteration k dispatched: read back by k + 1
            done, install = self.pending.end, k + 3
        self.clock.at(done, lambda: self.trace("received", req.id, done))
        self.arrived.append((install, req, epoch))
        self.wake()

    def _computes_chunks(self, plan: StepPlan) -> bool:
        return False

    def _waiting_to_land(self) -> bool:
        return bool(self.arrived)

    def _before_plan(self, t: float) -> None:
        now = [(r, e) for i, r, e in self.arrived if i <= self.iteration]
        self.arrived = [a for a in self.arrived if a[0] > self.iteration]
        for req, epoch in now:
            if req.done or req.epoch != epoch or req not in self.sched.running:
                continue  # preempted (or aborted) while its prompt was away: it is queued again
            self.sched.activate(req)
            self.trace("first", req.id, t)
            req.output.append(0)  # the prefill's token (its value does not matter here)
            req.first_token_time = req.first_token_time or t
            req.last_token_time = t
            if len(req.output) >= req.max_new_tokens:
                self.sched.finish(req, FinishReason.LENGTH)
                self.on_finish(req, self)

    def _after_plan(self, plan: StepPlan, t: float) -> bool:
        for req in plan.remote:
            self.trace("remote", req.id, t)
            self.send(req, req.epoch, self)
        return bool(plan.remote)


@dataclasses.dataclass
class _Job:
    req: Request  # the decode instance's request
    epoch: int
    target: DecodeInstance
    first_start: float | None = None


class PrefillInstance:
    """PD prefill: whole prompts in chunks through its own Scheduler (max_new_tokens 1, finished as the last chunk
    lands), then the KV transfer to the decode rank the request holds."""

    def __init__(
        self,
        clock: Clock,
        name: str,
        cfg: SchedulerConfig,
        step_seconds: Callable[[StepPlan], float],
        transfer: Callable[[_Job, float, float], float],
        host: Host = Host(),
    ):
        self.clock, self.name, self.step_seconds, self.transfer, self.host = clock, name, step_seconds, transfer, host
        self.sched = Scheduler(cfg)
        self.jobs: dict[Request, _Job] = {}
        self.inbox: list[Request] = []
        self.busy = 0.0
        self.steps = 0
        self.awake = False
        self._ids = itertools.count()
        self.trace = _no_trace

    def submit(self, req: Request, epoch: int, target: DecodeInstance) -> None:
        job = new_request(f"{self.name}-{next(self._ids)}", len(req.fill), 1, self.clock.now)
        self.jobs[job] = _Job(req, epoch, target)
        self.inbox.append(job)
        if not self.awake:
            self.awake = True
            self.clock.at(self.clock.now, self._iterate)

    def queued_tokens(self) -> int:
        return sum(len(j.fill) - j.computed for j in self.jobs)

    def _iterate(self) -> None:
        t = self.clock.now
        for job in self.inbox:
            self.sched.add(job)
        self.inbox.clear()
        plan = self.sched.schedule(t)
        if plan.decode:
            raise AssertionError("a prefill instance planned decode rows")
        if not plan.chunks:
            self.awake = False
            return
        start = t + self.host.dispatch_s
        seconds = self.step_seconds(plan)
        end = start + seconds
        self.busy += seconds
        self.steps += 1
        for c in plan.chunks:
            job = self.jobs[c.req]
            if job.first_start is None:
                job.first_start = start
                self.trace("batch", job.req.id, start)
        self.clock.at(end, lambda: self._done(plan, end))

    def _done(self, plan: StepPlan, end: float) -> None:
        for c in plan.chunks:
            if c.final:
                job = self.jobs.pop(c.req)
                self.sched.finish(c.req, FinishReason.LENGTH)
                self.trace("computed", job.req.id, end)
                arrive = self.transfer(job, job.first_start, end)
                self.clock.at(arrive, lambda j=job: j.target.deliver(j.req, j.epoch))
        self.clock.at(end + self.host.process_s, self._iterate)
