"""The highest arrival rate a deployment serves within the SLO, sweeps over m:n splits and batch limits (a grid,
then a pattern search to finer steps around its best), and the throughput-vs-TPOT plot."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable

from hcfjax.sim.deployment import Deployment
from hcfjax.sim.simulator import Result, simulate
from hcfjax.sim.workload import SLO, Workload


@dataclasses.dataclass(frozen=True)
class Search:
    lo: float = 0.25  # arrivals per second
    hi: float = 16.0
    iters: int = 6  # bisection steps (geometric) between the last passing and failing rates


@dataclasses.dataclass
class Point:
    rate: float
    result: Result


def bisect_rate(meets: Callable[[float], bool], search: Search = Search()) -> float | None:
    """The fastest rate of search's range found to meet an SLO (meets(rate)), by geometric bisection: search.hi when
    the range's top meets it already, None when even search.lo misses it (the caller says which bound it hit).
    Assumes attainment falls with load; meets runs once per rate tried, top first, then the bottom."""
    if meets(search.hi):
        return search.hi
    if not meets(search.lo):
        return None
    lo, hi = search.lo, search.hi
    for _ in range(search.iters):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if meets(mid) else (lo, mid)
    return lo


def max_rate(dep: Deployment, wl: Workload, slo: SLO, search: Search = Search()) -> tuple[Point | None, list[Point]]:
    """(the fastest evaluated rate meeting the SLO, every point evaluated); assumes attainment falls with load."""
    points: list[Point] = []

    def run(rate: float) -> bool:
        points.append(Point(rate, simulate(dep, wl.replace(rate=rate), slo)))
        return points[-1].result.meets_slo

    best = bisect_rate(run, search)
    return next((p for p in points if p.rate == best), None), points


def max_rate_on_lattice(
    dep: Deployment, wl: Workload, slo: SLO, search: Search, start: float, ratio: float = 1.03
) -> tuple[Point | None, list[Point]]:
    """max_rate on the rates search.lo x ratio^i (up to search.hi), from the lattice rate nearest `start`: up or
    down in doubling strides until the SLO flips, then bisection. Layouts searched on one lattice compare at its
    resolution (3%), and one near the start costs two or three runs."""
    top = math.floor(math.log(search.hi / search.lo) / math.log(ratio) + 1e-9)
    rate = lambda i: search.lo * ratio**i
    points: list[Point] = []
    seen: dict[int, Point] = {}

    def ok(i: int) -> bool:
        if i not in seen:
            seen[i] = Point(rate(i), simulate(dep, wl.replace(rate=rate(i)), slo))
            points.append(seen[i])
        return seen[i].result.meets_slo

    i = min(max(round(math.log(start / search.lo) / math.log(ratio)), 0), top)
    stride = 1
    if ok(i):
        lo = i
        while True:
            hi = min(lo + stride, top)
            if hi == lo:
                return seen[lo], points  # the range's top meets it
            if not ok(hi):
                break
            lo, stride = hi, stride * 2
    else:
        hi = i
        while True:
            lo = max(hi - stride, 0)
            if ok(lo):
                break
            if lo == 0:
                return None, points
            hi, stride = lo, stride * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return seen[lo], points


@dataclasses.dataclass
class Candidate:
    label: str
    dep: Deployment
    best: Point | None
    points: list[Point]
    values: dict = dataclasses.field(default_factory=dict)  # the sweep keys' values of this layout

    @property
    def tok_s(self) -> float:
        return self.best.result.output_tok_s if self.best else 0.0

    @property
    def per_gpu(self) -> float:
        return self.tok_s / self.dep.gpus


PD_KEYS = ("prefill_instances", "prefill_tp", "decode_instances", "decode_dp", "max_slots", "token_budget")
COLOCATED_KEYS = ("instances", "dp", "max_slots", "token_budget")


def current(base: Deployment, key: str) -> int:
    """The base deployment's value of a sweep key."""
    if base.mode == "pd":
        pool, field = {
            "prefill_instances": (base.prefill, "instances"),
            "prefill_tp": (base.prefill, "tp"),
            "decode_instances": (base.decode, "instances"),
            "decode_dp": (base.decode, "dp"),
            "max_slots": (base.decode, "max_slots"),
            "token_budget": (base.prefill, "token_budget"),
        }[key]
        return getattr(pool, field)
    return getattr(base.colocated, key)


def layout(base: Deployment, values: dict, total_gpus: int | None) -> tuple[str, Deployment] | None:
    """The deployment these sweep values make of `base` (PD keys: prefill_instances, prefill_tp, decode_instances,
    decode_dp, max_slots (decode, per rank), token_budget (prefill); colocated keys: instances, dp, max_slots,
    token_budget), experts over every GPU of an instance (ep = tp or dp); None if it needs more than total_gpus or
    its weights do not fit."""
    keys = PD_KEYS if base.mode == "pd" else COLOCATED_KEYS
    unknown = set(values) - set(keys)
    if unknown:
        raise ValueError(f"unknown sweep keys {sorted(unknown)} for a {base.mode} deployment (known: {list(keys)})")
    g = {k: values.get(k, current(base, k)) for k in keys}
    if base.mode == "pd":
        tp, dp = g["prefill_tp"], g["decode_dp"]
        pre = dataclasses.replace(
            base.prefill, instances=g["prefill_instances"], tp=tp, ep=tp, token_budget=g["token_budget"]
        )
        dec = dataclasses.replace(base.decode, instances=g["decode_instances"], dp=dp, ep=dp, max_slots=g["max_slots"])
        dep = base.replace(prefill=pre, decode=dec)
        label = f"{pre.instances}P(tp{tp}) {dec.instances}D(dp{dp}) slots {dec.max_slots} budget {pre.token_budget}"
    else:
        c = base.colocated
        col = dataclasses.replace(
            c,
            instances=g["instances"],
            dp=g["dp"],
            ep=g["dp"] * c.tp,
            max_slots=g["max_slots"],
            token_budget=g["token_budget"],
        )
        dep = base.replace(colocated=col)
        label = f"{col.instances}x(dp{col.dp}) slots {col.max_slots} budget {col.token_budget}"
    if total_gpus and dep.gpus > total_gpus:
        return None
    try:
        for pool in [dep.colocated] if dep.mode == "colocated" else [dep.prefill, dep.decode]:
            dep.pages_per_rank(pool, dep.cost_model(pool))
    except ValueError:
        return None  # the weights do not fit this layout
    return f"{label} ({dep.gpus} GPUs)", dep


def candidates(base: Deployment, grid: dict[str, list], total_gpus: int | None) -> list[tuple[str, Deployment, dict]]:
    """(label, deployment, values) for every layout of the grid's product that fits (see `layout`)."""
    keys = sorted(grid)
    out = []
    for combo in itertools.product(*(grid[k] for k in keys)):
        values = dict(zip(keys, combo, strict=True))
        made = layout(base, values, total_gpus)
        if made is not None:
            out.append((*made, values))
    return out


def sweep(
    base: Deployment,
    wl: Workload,
    slo: SLO,
    grid: dict,
    total_gpus: int | None,
    search: Search = Search(),
    log=print,
    refine: dict[str, int] | None = None,
) -> list[Candidate]:
    """Every grid candidate's best rate within the SLO, then (with `refine`: sweep key -> smallest step) a pattern
    search around the best of them; best output tokens/s per GPU first."""
    out = []
    for label, dep, values in candidates(base, grid, total_gpus):
        best, points = max_rate(dep, wl, slo, search)
        out.append(Candidate(label, dep, best, points, values))
        log(f"  {label}: {out[-1].tok_s:,.0f} output tok/s within the SLO")
    if refine and out:
        fine = refine_best(base, wl, slo, out, grid, refine, total_gpus, search, log)
        refined = {c.label for c in fine}
        out = [c for c in out if c.label not in refined] + fine  # a layout's lattice rate replaces its grid rate
    return sorted(out, key=lambda c: -c.per_gpu)


def refine_best(
    base: Deployment,
    wl: Workload,
    slo: SLO,
    done: list[Candidate],
    grid: dict,
    steps: dict[str, int],
    total_gpus: int | None,
    search: Search = Search(),
    log=print,
) -> list[Candidate]:
    """Pattern search from the best of `done` (the grid's candidates), one key at a time: try the value a span
    below and above (the span starts at the widest gap to the key's grid neighbours, or half the value off the
    grid), move while that raises output tokens/s per GPU, else halve the span, down to the key's step. Every
    layout here, the grid's best first, gets its rate on one lattice (max_rate_on_lattice, from the incumbent's
    rate), so they compare at its 3% resolution rather than the grid search's. -> the candidates evaluated."""
    full = lambda values: tuple(sorted({**{k: current(base, k) for k in steps}, **values}.items()))
    tried: dict[tuple, Candidate | None] = {}
    best = max(done, key=lambda c: c.per_gpu)
    out: list[Candidate] = []
    values = dict(full(best.values))

    def evaluate(trial: dict) -> Candidate | None:
        key = full(trial)
        if key in tried:
            return tried[key]
        tried[key] = None
        made = layout(base, trial, total_gpus)
        if made is None:
            return None
        start = best.best.rate if best.best else math.sqrt(search.lo * search.hi)
        top, points = max_rate_on_lattice(made[1], wl, slo, search, start)
        c = Candidate(*made, top, points, dict(trial))
        tried[key] = c
        out.append(c)
        log(f"  refine {made[0]}: {c.tok_s:,.0f} output tok/s within the SLO")
        return c

    best = evaluate(values) or best

    for key, step in steps.items():
        v = values[key]
        on_grid = sorted(grid.get(key, []))
        gaps = [abs(v - g) for g in on_grid if g != v]
        span = max(step, (max(gaps) if gaps else v // 2) // step * step)
        while True:
            moved = False
            for trial_v in (v - span, v + span):
                if trial_v <= 0:
                    continue
                c = evaluate({**values, key: trial_v})
                if c is not None and c.per_gpu > best.per_gpu:
                    best, v, moved = c, trial_v, True
                    values = dict(c.values)
            if not moved:
                if span <= step:
                    break
                span = max(step, span // 2 // step * step)
    return out


def plot(curves: list[Candidate], path: str, title: str = "") -> None:
    """Output tokens/s against median TPOT for each candidate's evaluated rates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for c in curves:
        pts = sorted(c.points, key=lambda p: p.rate)
        ax.plot([p.result.tpot[50] * 1e3 for p in pts], [p.result.output_tok_s for p in pts], "o-", label=c.label)
    if curves:
        ax.axvline(curves[0].points[0].result.slo.tpot_s * 1e3, color="grey", ls="--", lw=1, label="TPOT SLO")
    ax.set_xlabel("TPOT p50 (ms)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
