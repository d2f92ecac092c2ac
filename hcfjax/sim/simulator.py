"""Run a workload through a simulated deployment and measure it as hcfjax/bench/serve.py measures the engine.

    from hcfjax.sim import Deployment, Pool, Workload, simulate
    res = simulate(Deployment(mode="colocated", colocated=Pool(dp=8, ep=8)), Workload(requests=500, rate=2.0))
    print(res.output_tok_s, res.tpot[50])

Routing: a request goes to the instance owning the DP rank the engine's Balancer picks over every instance's rank
loads (the decode instances' in PD); in PD the decode instance's Scheduler admits it, then the prefill instance with
the fewest queued prompt tokens computes it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from hcfjax.engine.balance import Balancer, RankLoad
from hcfjax.engine.request import Request
from hcfjax.engine.scheduler import StepPlan
from hcfjax.sim.cost import CostModel
from hcfjax.sim.deployment import Deployment, Pool
from hcfjax.sim.instances import (
    Acceptance,
    Clock,
    DecodeInstance,
    EngineInstance,
    Host,
    PrefillInstance,
    new_request,
)
from hcfjax.sim.work import actual_works
from hcfjax.sim.workload import SLO, Workload


@dataclasses.dataclass
class Result:
    requests: int
    finished: int
    wall_s: float
    output_tokens: int
    input_tokens: int  # of all requests
    ttft: dict[int, float]  # percentile -> seconds
    tpot: dict[int, float]
    good: int  # requests meeting the SLO
    preemptions: int
    utilisation: dict[str, float]  # instance -> device busy share of the wall time
    parts: dict[str, dict[str, float]]  # pool -> where its step time went (seconds, summed over steps)
    mean_decode_batch: float  # decode rows per decode step, per DP rank
    drained: bool = True
    window_s: float = 0.0  # the steady-state window (drain False)
    window_output_tokens: float = 0.0
    window_finished: int = 0
    slo: SLO = SLO()

    @property
    def qpm(self) -> float:
        if not self.drained:
            return self.window_finished / self.window_s * 60 if self.window_s else 0.0
        return self.finished / self.wall_s * 60 if self.wall_s else 0.0

    @property
    def output_tok_s(self) -> float:
        """Over the whole run when drained (as the bench measures), else over the steady-state window."""
        if not self.drained:
            return self.window_output_tokens / self.window_s if self.window_s else 0.0
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    @property
    def total_tok_s(self) -> float:
        """Output tokens/s plus prompt tokens/s (prompt tokens of the requests per unit time)."""
        per_req_in = self.input_tokens / self.requests if self.requests else 0.0
        return self.output_tok_s + self.qpm / 60 * per_req_in

    @property
    def attainment(self) -> float:
        return self.good / self.requests if self.requests else 0.0

    @property
    def meets_slo(self) -> bool:
        return (self.finished == self.requests or not self.drained) and self.attainment >= self.slo.attainment

    def row(self) -> str:
        t, p = self.ttft, self.tpot
        return (
            f"| {self.qpm:.1f} | {self.output_tok_s:,.0f} | {self.total_tok_s:,.0f} | "
            f"{t[50]:.2f} / {t[90]:.2f} / {t[99]:.2f} | {p[50] * 1e3:.1f} / {p[90] * 1e3:.1f} / {p[99] * 1e3:.1f} | "
            f"{self.good}/{self.requests} ({self.good / self.wall_s * 60:.1f} per min) | {self.mean_decode_batch:.1f} |"
        )

    HEADER = (
        "| QPM | output tok/s | total tok/s | TTFT p50 / p90 / p99 (s) | TPOT p50 / p90 / p99 (ms) | "
        "goodput (SLO) | decode batch / rank |\n|---|---|---|---|---|---|---|"
    )


def _pct(xs: list[float]) -> dict[int, float]:
    return {q: float(np.percentile(xs, q)) if xs else float("nan") for q in (50, 90, 99)}


def _emitted_by(r: Request, t: float) -> float:
    """Output tokens r had emitted by time t (spread evenly between its first and latest token)."""
    if r.first_token_time > t:
        return 0.0
    if r.last_token_time <= t or len(r.output) < 2:
        return float(len(r.output))
    return 1 + (len(r.output) - 1) * (t - r.first_token_time) / (r.last_token_time - r.first_token_time)


class _Router:
    """The Balancer over every target instance's ranks; when none has room, the instance with the shortest queue."""

    def __init__(self, targets: list, policy: str):
        self.targets = targets
        self.balancer = Balancer(policy, sum(t.sched.cfg.dp for t in targets))

    def choose(self, req: Request):
        if len(self.targets) == 1:
            return self.targets[0]
        loads, owner = [], []
        for inst in self.targets:
            for load in inst.sched.loads():
                loads.append(RankLoad(len(loads), load.requests, load.free_slots, load.free_pages))
                owner.append(inst)
        need = self.targets[0].sched._expected_pages(req, len(req.fill))
        rank = self.balancer.choose(loads, need)
        if rank is None:
            return min(self.targets, key=lambda i: len(i.sched.waiting) + len(i.inbox))
        return owner[rank]


class _Priced:
    """A pool's step pricing: the cost model over the works the plan means, with where the time went summed."""

    def __init__(self, dep: Deployment, pool: Pool, cost: CostModel, works: Callable[[StepPlan], list]):
        self.cost, self.works = cost, works
        self.parts: dict[str, float] = {}

    def __call__(self, plan: StepPlan) -> float:
        c = self.cost.step(self.works(plan))
        for k, v in c.parts.items():
            self.parts[k] = self.parts.get(k, 0.0) + v
        return c.seconds


def _host(cost: CostModel) -> Host:
    return Host(cost.eff.host_dispatch_s, cost.eff.host_process_s)


def simulate(dep: Deployment, wl: Workload, slo: SLO | None = None, trace=None) -> Result:
    """slo: what a request must meet to count as good (default SLO()). trace: (event, request id, simulated
    seconds) -> None, called with hcfjax.trace's event names (arrive, remote, batch, computed, received, first) as
    the simulated requests pass them."""
    slo = SLO() if slo is None else slo
    cfg = dep.model_config()
    clock = Clock()
    done: list[Request] = []
    on_finish = lambda req, inst: done.append(req)
    k = dep.spec_k
    seeds = iter(range(dep.seed * 1000 + 1, dep.seed * 1000 + 1000))
    acceptance = lambda: Acceptance(list(dep.acceptance), next(seeds)) if k else None
    priced: dict[str, _Priced] = {}
    engines: list[EngineInstance] = []
    prefills: list[PrefillInstance] = []

    if dep.mode == "colocated":
        pool = dep.colocated
        cost = dep.cost_model(pool, cfg)
        step_shapes = None
        if dep.engine_shapes:
            shapes = dep.engine_shapes_for(pool, cfg)
            pages = dep.engine_limits(pool, cfg)[2]
            works, step_shapes = shapes.works, shapes.step_shapes
        else:
            pages = dep.pages_per_rank(pool, cost)
            works = lambda plan: actual_works(plan, pool.dp, k)
        priced["colocated"] = _Priced(dep, pool, cost, works)
        scfg = dep.scheduler_config(pool, "colocated", pages, step_shapes)
        for i in range(pool.instances):
            engines.append(
                EngineInstance(clock, f"colocated{i}", scfg, priced["colocated"], _host(cost), acceptance(), on_finish)
            )
    else:
        pc, dc = dep.cost_model(dep.prefill, cfg), dep.cost_model(dep.decode, cfg)
        if dep.engine_shapes:  # hcfjax's PrefillWorker and its decode engine (decode steps only, every slot)
            pre_works = dep.prefill_shapes_for(dep.prefill).works
            dec_works = dep.engine_shapes_for(dep.decode, cfg).works
            dec_pages = dep.engine_limits(dep.decode, cfg)[2]
        else:
            pre_works = lambda plan: actual_works(plan, 1, k)
            dec_works = lambda plan: actual_works(plan, dep.decode.dp, k, chunks=False)
            dec_pages = dep.pages_per_rank(dep.decode, dc)
        priced["prefill"] = _Priced(dep, dep.prefill, pc, pre_works)
        priced["decode"] = _Priced(dep, dep.decode, dc, dec_works)
        nic_free: dict[tuple, float] = {}
        page = dep.prefill.page_size

        def transfer(job, first_start: float, end: float) -> float:
            key = (id(job.target), job.req.rank)
            tokens = len(job.req.fill)
            nbytes = dc.kv_bytes(-(-tokens // page) * page if dep.engine_shapes else tokens)  # hcfjax sends pages
            begin = max(end, nic_free.get(key, 0.0))
            arrive = begin + dc.transfer_seconds(nbytes)
            if len(job.req.fill) >= dep.layerwise_threshold:  # streamed while computed: one layer's share remains
                layers = cfg.num_hidden_layers + k
                streamed = max(first_start, nic_free.get(key, 0.0)) + dc.transfer_seconds(nbytes)
                arrive = max(end + dc.transfer_seconds(nbytes / layers), streamed)
            nic_free[key] = arrive
            return arrive

        pcfg = dep.scheduler_config(dep.prefill, "prefill", dep.pages_per_rank(dep.prefill, pc))
        for i in range(dep.prefill.instances):
            prefills.append(PrefillInstance(clock, f"prefill{i}", pcfg, priced["prefill"], transfer, _host(pc)))

        def send(req: Request, epoch: int, target: DecodeInstance) -> None:
            min(prefills, key=lambda p: p.queued_tokens()).submit(req, epoch, target)

        dcfg = dep.scheduler_config(dep.decode, "decode", dec_pages)
        for i in range(dep.decode.instances):
            engines.append(
                DecodeInstance(
                    clock,
                    f"decode{i}",
                    dcfg,
                    priced["decode"],
                    _host(dc),
                    acceptance(),
                    on_finish,
                    send=send,
                    waits_for_step=dep.transfer_waits_for_step,
                )
            )

    if trace is not None:
        for inst in [*engines, *prefills]:
            inst.trace = trace
    router = _Router(engines, (dep.colocated or dep.decode).balance)
    reqs = [new_request(f"r{i}", n_in, n_out, t) for i, (t, n_in, n_out) in enumerate(wl.requests_list())]
    sched = engines[0].sched
    longest = max(reqs, key=lambda r: len(r.prompt) + r.max_new_tokens, default=None)
    if longest is not None:  # the engine refuses requests beyond its context; here: beyond what a rank can hold
        need = sched.alloc[0].pages_for(len(longest.prompt) + longest.max_new_tokens + 2 * k + 1)
        if need > sched.cfg.num_pages:
            raise ValueError(
                f"a request of {len(longest.prompt)} + {longest.max_new_tokens} tokens needs {need} pages; a rank "
                f"holds {sched.cfg.num_pages} (lower the workload's max_model_len or give the cache more memory)"
            )
    for req in reqs:
        clock.at(req.arrival, lambda r=req: router.choose(r).submit(r))
    if not wl.drain and reqs:

        def check():
            if all(r.first_token_time is not None for r in reqs):
                clock.stopped = True
            else:
                clock.at(clock.now + 0.25, check)

        clock.at(reqs[-1].arrival, check)
    clock.run()

    started = [r for r in reqs if r.first_token_time is not None]
    wall = clock.now if not wl.drain else max((r.last_token_time for r in done), default=0.0)
    tpot_of = lambda r: (r.last_token_time - r.first_token_time) / (len(r.output) - 1) if len(r.output) > 1 else None
    ttft = [r.first_token_time - r.arrival for r in started]
    tpot = [t for t in map(tpot_of, started) if t is not None]
    good = sum(1 for r in started if r.first_token_time - r.arrival < slo.ttft_s and (tpot_of(r) or 0) < slo.tpot_s)
    w0 = reqs[len(reqs) // 5].arrival if reqs else 0.0
    w1 = reqs[-1].arrival if reqs else 0.0
    util = {i.name: i.busy / wall if wall else 0.0 for i in [*prefills, *engines]}
    steps = sum(e.steps for e in engines)
    dp = (dep.colocated or dep.decode).dp
    return Result(
        requests=len(reqs),
        finished=len(done),
        drained=wl.drain,
        window_s=w1 - w0,
        window_output_tokens=sum(_emitted_by(r, w1) - _emitted_by(r, w0) for r in started),
        window_finished=sum(1 for r in done if w0 < r.last_token_time <= w1),
        wall_s=wall,
        output_tokens=sum(len(r.output) for r in done),
        input_tokens=sum(len(r.prompt) for r in reqs),
        ttft=_pct(ttft),
        tpot=_pct(tpot),
        good=good,
        preemptions=sum(e.sched.preemptions for e in engines),
        utilisation=util,
        parts={name: p.parts for name, p in priced.items()},
        mean_decode_batch=sum(e.decode_rows for e in engines) / steps / dp if steps else 0.0,
        slo=slo,
    )
