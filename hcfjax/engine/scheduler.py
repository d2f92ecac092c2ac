"""What runs in the next step: decode rows, chunked-prefill work, admissions and preemptions.

Pure host logic over Requests and page allocators, driven by a `now` the caller passes in (the engine's clock, or
a simulator's), so the same code runs live and simulated.

- Token budget: every decoding request costs `step_tokens` (1, or 1 + k drafts); prefill chunks fill the rest. A
  step that decodes has `mixed_token_budget` instead (at most the budget), when set: a smaller one bounds how long
  the decoding requests wait on the prefill chunks that share their step (time per output token), at some prefill
  throughput.
- Prefill: requests already prefilling continue first (oldest first). New ones are admitted shortest prompt first
  among those that arrived in the same window of `spf_window_s`; a request that has waited `max_wait_s` goes ahead
  of every shorter one, so long prompts never starve.
- Admission: a request needs a decode slot on some rank and the pages its prompt plus its expected output will take
  there. The expected output is the mean of recent requests' output lengths (a sliding window), capped by its
  max_new_tokens; pages promised to running requests the same way are not counted as free. When the head of the
  queue cannot be admitted, `should_grow` says capacity is short.
- Padded shapes (`shapes`, the engine's): a chunk joins a step only if the step's padded prefill shape (rows x
  tokens, hcfjax.engine.shapes) stays within the token budget; a chunk is cut short to fit one.
- Speculative decoding prefills each prompt whole (the MTP modules' caches need every anchor); a prompt longer
  than what is left of the budget waits for the next step unless it is the step's first chunk.
- Preemption: when a decoding request needs a page and none is free, the most recently admitted request on that
  rank gives back its pages and slot and is re-queued first; it is recomputed later from prompt + output.
- Remote prefill (a PD decode worker): admission reserves the slot and pages as above, but the prompt is prefilled
  elsewhere: admitted requests go to `StepPlan.remote` (status TRANSFERRING, no local chunks, no token budget) until
  `activate` says their cache has landed. A transferring request is never a preemption victim, since its pages are
  about to be written.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq

from hcfjax.engine.balance import Balancer, RankLoad
from hcfjax.engine.pages import PageAllocator
from hcfjax.engine.request import FinishReason, Request, Status
from hcfjax.engine.shapes import StepShapes


@dataclasses.dataclass
class Chunk:
    req: Request
    start: int  # first position of the chunk
    n: int  # tokens in the chunk
    final: bool  # the chunk ends the prompt: the step samples the request's next token


@dataclasses.dataclass
class StepPlan:
    chunks: list[Chunk]
    decode: list[Request]
    remote: list[Request] = dataclasses.field(default_factory=list)  # admitted, to be prefilled elsewhere

    @property
    def empty(self) -> bool:
        return not self.chunks and not self.decode


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    dp: int = 1
    max_slots: int = 8  # per rank
    num_pages: int = 256  # per rank
    page_size: int = 16
    token_budget: int = 256
    mixed_token_budget: int | None = None  # the budget of a step that also decodes (None: token_budget)
    max_prefill_rows: int = 4
    step_tokens: int = 1  # tokens a decode step costs per request (1 + k with speculation)
    page_slack: int = 0  # positions past the step's tokens that a step may write (the MTP drafts: k)
    whole_prompts: bool = False  # prefill prompts in one chunk (speculation: the MTP modules need every anchor)
    remote_prefill: bool = False  # prompts are prefilled by another worker (PD): admit into StepPlan.remote
    spf_window_s: float = 0.05
    max_wait_s: float = 2.0
    balance: str = "round_robin"
    output_window: int = 64  # finished requests in the sliding mean of output lengths
    default_output_len: int = 128  # the mean before any request finished
    shapes: StepShapes | None = None  # keep each step's padded prefill shape within the budget (None: no padding)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg
        self.alloc = [PageAllocator(cfg.num_pages, cfg.page_size, base=r * cfg.num_pages) for r in range(cfg.dp)]
        # heaps: a request takes its rank's lowest free slot (the runner packs decode rows whatever the slots)
        self.free_slots = [list(range(r * cfg.max_slots, (r + 1) * cfg.max_slots)) for r in range(cfg.dp)]
        self.balancer = Balancer(cfg.balance, cfg.dp)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []  # holding a slot, in admission order
        self.out_lens: collections.deque[int] = collections.deque(maxlen=cfg.output_window)
        self.should_grow = False
        self.preemptions = 0

    # -- bookkeeping ---------------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def finish(self, req: Request, reason: FinishReason) -> None:
        """Ends a request wherever it is; its pages and slot are free for the next plan."""
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self._release(req)
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.out_lens.append(len(req.output))
        req.finish = reason
        req.status = Status.FINISHED if reason in (FinishReason.STOP, FinishReason.LENGTH) else Status.ABORTED

    def _release(self, req: Request) -> None:
        self.running.remove(req)
        self.alloc[req.rank].release(req.pages)
        heapq.heappush(self.free_slots[req.rank], req.slot)
        req.pages, req.slot, req.rank = [], -1, -1

    @property
    def expected_output(self) -> float:
        return sum(self.out_lens) / len(self.out_lens) if self.out_lens else self.cfg.default_output_len

    def _expected_pages(self, req: Request, tokens: int, expected: float | None = None) -> int:
        """Pages `req` will hold at the end if it produces the expected output (`expected`, default
        self.expected_output), at least for `tokens` positions."""
        a = self.alloc[0]
        expected = self.expected_output if expected is None else expected
        out = min(req.max_new_tokens, max(expected, len(req.output) + 1))
        return max(a.pages_for(len(req.prompt) + int(out) + self.cfg.step_tokens), a.pages_for(tokens))

    def loads(self) -> list[RankLoad]:
        """Each rank's requests, free slots and pages not promised to them, in one pass over the running requests (a
        plan counts them once and updates them as it admits, `_admit`)."""
        expected = self.expected_output
        requests, promised = [0] * self.cfg.dp, [0] * self.cfg.dp
        for q in self.running:
            requests[q.rank] += 1
            promised[q.rank] += max(0, self._expected_pages(q, q.cached_bound, expected) - len(q.pages))
        return [
            RankLoad(r, requests[r], len(self.free_slots[r]), self.alloc[r].num_free - promised[r])
            for r in range(self.cfg.dp)
        ]

    def _grow(self, req: Request, tokens: int) -> bool:
        """Gives req pages for `tokens` positions; False when its rank is out of pages."""
        a = self.alloc[req.rank]
        need = a.pages_for(tokens) - len(req.pages)
        if need > a.num_free:
            return False
        if need > 0:
            req.pages += a.allocate(need)
        return True

    # -- the plan --------------------------------------------------------------------------------------------------
    def schedule(self, now: float) -> StepPlan:
        cfg = self.cfg
        decode = self._plan_decode()
        total = min(cfg.mixed_token_budget or cfg.token_budget, cfg.token_budget) if decode else cfg.token_budget
        budget = total - len(decode) * cfg.step_tokens
        chunks: list[Chunk] = []
        for req in [q for q in self.running if q.status == Status.PREFILLING]:
            n = self._room(chunks, budget, len(req.fill) - req.computed)
            if n <= 0:
                break
            chunks.append(self._chunk(req, n))
            budget -= n
        self.should_grow = False
        if cfg.remote_prefill:
            return StepPlan(chunks, decode, self._admit_remote(now))
        loads = None  # the ranks' loads, made when the first waiting request asks (admissions update them)
        for req in sorted(self.waiting, key=lambda q: self._priority(q, now)):
            n = self._room(chunks, budget, len(req.prompt) + len(req.output))
            if n <= 0:
                break
            loads = loads or self.loads()
            if not self._admit(req, loads):
                self.should_grow = True
                break
            chunks.append(self._chunk(req, n))
            budget -= n
        return StepPlan(chunks, decode)

    def _room(self, chunks: list[Chunk], budget: int, left: int) -> int:
        """Tokens of a prompt with `left` tokens to prefill that join this step's `chunks` (0: it waits). With
        whole prompts it is all of them or none, except that the step's first chunk always runs."""
        if len(chunks) >= self.cfg.max_prefill_rows or budget <= 0:
            return 0
        room = budget
        if self.cfg.shapes is not None:
            room = min(room, self.cfg.shapes.room(len(chunks), max((c.n for c in chunks), default=0)))
        if self.cfg.whole_prompts:
            return left if not chunks or left <= room else 0
        return min(left, room)

    def _admit_remote(self, now: float) -> list[Request]:
        admitted, loads = [], self.loads() if self.waiting else []
        for req in sorted(self.waiting, key=lambda q: self._priority(q, now)):
            if not self._admit(req, loads):
                self.should_grow = True
                break
            req.status = Status.TRANSFERRING
            admitted.append(req)
        return admitted

    def activate(self, req: Request) -> None:
        """A remotely prefilled request's cache has landed: it decodes from the next plan on (the caller appends
        the token the prefill sampled to its output, as for a local final chunk)."""
        if req.status != Status.TRANSFERRING:
            raise ValueError(f"request {req.id} is {req.status.value}, not transferring")
        req.computed = req.cached_bound = len(req.fill)
        req.status = Status.DECODING

    def _priority(self, req: Request, now: float):
        starving = now - req.arrival >= self.cfg.max_wait_s
        window = int(req.arrival // self.cfg.spf_window_s) if self.cfg.spf_window_s > 0 else 0
        return (not starving, req.arrival if starving else window, len(req.fill), req.arrival)

    def _plan_decode(self) -> list[Request]:
        """Every decoding request, each with pages for one more step; where its rank runs out, the newest requests
        there are preempted. A request holds a slot exactly while it is running (`_admit`, `_release`), which is
        what is checked here: a list membership test per request made a plan quadratic in the batch."""
        decode = []
        for req in list(self.running):
            if req.status != Status.DECODING or req.slot < 0:  # (preempted by an earlier request's growth)
                continue
            target = req.cached_bound + self.cfg.step_tokens
            while not self._grow(req, target + self.cfg.page_slack):
                victim = [q for q in self.running if q.rank == req.rank and q.status != Status.TRANSFERRING][-1]
                self._preempt(victim)
                if victim is req:
                    break
            if req.slot >= 0:
                req.cached_bound = target
                decode.append(req)
        return [q for q in decode if q.slot >= 0]

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.status, req.computed, req.cached_bound = Status.QUEUED, 0, 0
        req.epoch += 1
        self.waiting.appendleft(req)
        self.preemptions += 1

    def _admit(self, req: Request, loads: list[RankLoad]) -> bool:
        """Admits req where `loads` (this plan's, from `loads()`) has room, and updates them for it."""
        req.fill = req.prompt + req.output  # a preempted request recomputes what it already produced
        expected = self.expected_output
        rank = self.balancer.choose(loads, self._expected_pages(req, len(req.fill), expected))
        if rank is None:
            return False
        req.rank, req.slot = rank, heapq.heappop(self.free_slots[rank])
        if not self._grow(req, len(req.fill) + self.cfg.page_slack):  # loads() promised these: cannot fail
            raise AssertionError("admission found pages that are not there")
        # what loads() would now give: the pages it took, and those it is still promised
        promised = max(0, self._expected_pages(req, req.cached_bound, expected) - len(req.pages))
        r = loads[rank]
        loads[rank] = RankLoad(rank, r.requests + 1, r.free_slots - 1, r.free_pages - len(req.pages) - promised)
        self.waiting.remove(req)
        self.running.append(req)
        req.status = Status.PREFILLING
        return True

    def _chunk(self, req: Request, n: int) -> Chunk:
        chunk = Chunk(req, req.computed, n, req.computed + n == len(req.fill))
        req.computed += n
        req.cached_bound = req.computed
        if chunk.final:
            req.status = Status.DECODING
        return chunk
