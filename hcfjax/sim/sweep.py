"""The highest arrival rate a deployment serves within the SLO, sweeps over m:n splits and batch limits, and the
throughput-vs-TPOT plot."""

from __future__ import annotations

import dataclasses
import itertools
import math

from hcfjax.sim.deployment import Deployment
from hcfjax.sim.simulator import SLO, Result, Workload, simulate


@dataclasses.dataclass(frozen=True)
class Search:
    lo: float = 0.25  # arrivals per second
    hi: float = 16.0
    iters: int = 6  # bisection steps (geometric) between the last passing and failing rates


@dataclasses.dataclass
class Point:
    rate: float
    result: Result


def max_rate(dep: Deployment, wl: Workload, slo: SLO, search: Search = Search()) -> tuple[Point | None, list[Point]]:
    """(the fastest evaluated rate meeting the SLO, every point evaluated); assumes attainment falls with load."""
    points: list[Point] = []

    def run(rate: float) -> bool:
        points.append(Point(rate, simulate(dep, wl.replace(rate=rate), slo)))
        return points[-1].result.meets_slo

    if run(search.hi):
        return points[-1], points  # the range's top already meets it
    if not run(search.lo):
        return None, points
    lo, hi, best = search.lo, search.hi, points[-1]
    for _ in range(search.iters):
        mid = math.sqrt(lo * hi)
        if run(mid):
            lo, best = mid, points[-1]
        else:
            hi = mid
    return best, points


@dataclasses.dataclass
class Candidate:
    label: str
    dep: Deployment
    best: Point | None
    points: list[Point]

    @property
    def tok_s(self) -> float:
        return self.best.result.output_tok_s if self.best else 0.0


def candidates(base: Deployment, grid: dict[str, list], total_gpus: int | None) -> list[tuple[str, Deployment]]:
    """Deployments over the grid's product. PD keys: prefill_instances, prefill_tp, decode_instances, decode_dp,
    max_slots (decode, per rank), token_budget (prefill); colocated keys: instances, dp, max_slots, token_budget.
    Experts go over every GPU of an instance (ep = tp or dp). Layouts over total_gpus are left out."""
    keys = sorted(grid)
    out = []
    for values in itertools.product(*(grid[k] for k in keys)):
        g = dict(zip(keys, values, strict=True))
        if base.mode == "pd":
            p, d = base.prefill, base.decode
            tp, dp = g.get("prefill_tp", p.tp), g.get("decode_dp", d.dp)
            pre = dataclasses.replace(
                p,
                instances=g.get("prefill_instances", p.instances),
                tp=tp,
                ep=tp,
                token_budget=g.get("token_budget", p.token_budget),
            )
            dec = dataclasses.replace(
                d,
                instances=g.get("decode_instances", d.instances),
                dp=dp,
                ep=dp,
                max_slots=g.get("max_slots", d.max_slots),
            )
            dep = base.replace(prefill=pre, decode=dec)
            label = f"{pre.instances}P(tp{tp}) {dec.instances}D(dp{dp}) slots {dec.max_slots}"
        else:
            c = base.colocated
            dp = g.get("dp", c.dp)
            col = dataclasses.replace(
                c,
                instances=g.get("instances", c.instances),
                dp=dp,
                ep=dp * c.tp,
                max_slots=g.get("max_slots", c.max_slots),
                token_budget=g.get("token_budget", c.token_budget),
            )
            dep = base.replace(colocated=col)
            label = f"{col.instances}x(dp{dp}) slots {col.max_slots} budget {col.token_budget}"
        if total_gpus and dep.gpus > total_gpus:
            continue
        try:
            for pool in [dep.colocated] if dep.mode == "colocated" else [dep.prefill, dep.decode]:
                dep.pages_per_rank(pool, dep.cost_model(pool))
        except ValueError:
            continue  # the weights do not fit this layout
        out.append((f"{label} ({dep.gpus} GPUs)", dep))
    return out


def sweep(
    base: Deployment, wl: Workload, slo: SLO, grid: dict, total_gpus: int | None, search: Search = Search(), log=print
) -> list[Candidate]:
    """Every candidate's best rate within the SLO, best output tokens/s per GPU first."""
    out = []
    for label, dep in candidates(base, grid, total_gpus):
        best, points = max_rate(dep, wl, slo, search)
        out.append(Candidate(label, dep, best, points))
        log(f"  {label}: {out[-1].tok_s:,.0f} output tok/s within the SLO")
    return sorted(out, key=lambda c: -c.tok_s / c.dep.gpus)


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
