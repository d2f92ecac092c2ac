"""The serving benchmark's load runs: one batch of Poisson requests at a rate through a running server, measured as
the simulator measures (hcfjax.sim.simulator.Result, judged by hcfjax.sim.workload.SLO); a sweep of rates and the
search for the highest rate within the SLO (hcfjax.sim.sweep.bisect_rate) over one server; their table and JSON.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import threading
import time
from collections.abc import Callable

import numpy as np

from hcfjax.sim.simulator import Result
from hcfjax.sim.sweep import Search, bisect_rate
from hcfjax.sim.workload import SLO

PERCENTILES = (50, 90, 99)


class StepStats:
    """The decode rows and the context they attend, summed over the engine's steps, and the engine's time by kind of
    step: wraps engine.runner.dispatch and engine._process (the engine itself is unchanged; hcfjax.bench.sim_validate
    observes it the same way). A step's time runs from the later of its dispatch and the previous step's end to its
    tokens' arrival on the host: the GPU's time on it while the engine keeps the GPU fed (it dispatches step n + 1
    before it waits for step n). A step whose requests had all finished before its tokens came (the one dispatched
    beside a request's last, which the engine drops) is not counted: it runs after the clients' wall time."""

    KINDS = ("decode", "mixed", "prefill")  # decode rows only, prefill chunks and decode rows, prefill chunks only

    def __init__(self, engine):
        import jax

        dispatch, process = engine.runner.dispatch, engine._process
        in_flight = collections.deque()

        def observed(plan, *args):
            out = dispatch(plan, *args)
            if plan.decode:
                self.decode_steps += 1
                self.decode_rows += len(plan.decode)
                self.rows_run += jax.tree.leaves(out.nxt)[0].shape[0]
                self.context_tokens += sum(req.length for req in plan.decode)
            kind = "prefill" if not plan.decode else "mixed" if plan.chunks else "decode"
            in_flight.append((kind, sum(c.n for c in plan.chunks), time.perf_counter()))
            return out

        def processed(d):
            jax.block_until_ready([x for x in (d.first, d.nxt) if x is not None])
            done = time.perf_counter()
            live = any(not c.req.done for c in d.plan.chunks) or any(not req.done for req, *_ in d.decode_rows)
            if in_flight:
                kind, tokens, sent = in_flight.popleft()
                if live:
                    self.seconds[kind] += done - max(sent, self._last_done)
                    self.count[kind] += 1
                    self.prefill_tokens[kind] += tokens
            self._last_done = done
            return process(d)

        engine.runner.dispatch = observed
        engine._process = processed
        from hcfjax.bench.engine_loop import Timings

        self.host = Timings(engine)  # the loop thread's own time, per iteration (wraps the wrappers above)
        self.reset()

    def reset(self) -> None:
        self.decode_steps = self.decode_rows = self.rows_run = self.context_tokens = 0
        self.seconds = dict.fromkeys(self.KINDS, 0.0)
        self.count = dict.fromkeys(self.KINDS, 0)
        self.prefill_tokens = dict.fromkeys(self.KINDS, 0)
        self._last_done = 0.0
        self.host.reset()

    @property
    def decode_batch(self) -> float:
        """Decode rows per step that decodes."""
        return self.decode_rows / self.decode_steps if self.decode_steps else 0.0

    @property
    def decode_rows_run(self) -> float:
        """Rows per step that decodes that its decode program runs (the compiled size that holds its requests)."""
        return self.rows_run / self.decode_steps if self.decode_steps else 0.0

    @property
    def mean_context(self) -> float:
        """Tokens a decode row attends, averaged over rows."""
        return self.context_tokens / self.decode_rows if self.decode_rows else 0.0

    def split(self) -> dict:
        """Per kind of step: steps, seconds, mean milliseconds a step, prefill tokens a step; and the decode rows
        run a step."""
        kinds = {
            k: {
                "steps": self.count[k],
                "seconds": self.seconds[k],
                "ms_per_step": 1e3 * self.seconds[k] / self.count[k] if self.count[k] else None,
                "prefill_tokens_per_step": self.prefill_tokens[k] / self.count[k] if self.count[k] else None,
            }
            for k in self.KINDS
        }
        host = {f"host_{k}_ms": 1e3 * v for k, v in self.host.per_iteration().items()}
        return {"decode_rows_run": self.decode_rows_run} | host | kinds


def time_split(split: dict, wall: float) -> str:
    """A sentence on where a run's wall time went, by kind of engine step (StepStats.split), and the loop thread's
    own time an iteration: its plan, dispatch, wait for a step's tokens and their processing (engine_loop.Timings)."""
    from hcfjax.bench.engine_loop import Timings

    parts = []
    for kind in StepStats.KINDS:
        s = split[kind]
        if s["steps"]:
            tokens = f", {s['prefill_tokens_per_step']:,.0f} prefill tokens" if s["prefill_tokens_per_step"] else ""
            parts.append(
                f"{kind} steps {s['seconds']:.1f} s ({s['seconds'] / wall:.0%}; {s['steps']} at "
                f"{s['ms_per_step']:.2f} ms{tokens})"
            )
    busy = sum(split[k]["seconds"] for k in StepStats.KINDS)
    return (
        f"Engine time over the {wall:.1f} s run: "
        + "; ".join(parts)
        + f"; no step in flight {wall - busy:.1f} s. Decode rows run a step: {split['decode_rows_run']:.1f}. "
        + "The loop's host work an iteration (ms): "
        + ", ".join(f"{k} {split[f'host_{k}_ms']:.2f}" for k in Timings.PARTS if f"host_{k}_ms" in split)
        + "."
    )


@dataclasses.dataclass
class RateRun:
    """One batch of requests at a Poisson rate: the simulator's measures (result), plus what only a real server shows:
    requests that ended in an error, requests that got no terminal response at all (lost: must be 0), and the
    engine's mean decode batch and context (None when the engine runs in another process)."""

    rate: float
    kind: str  # "sweep" or "search"
    result: Result
    errors: int
    lost: int
    decode_batch: float | None = None
    mean_context: float | None = None
    split: dict | None = None  # the engine's time by kind of step (StepStats.split)

    @property
    def goodput(self) -> float:
        """Requests per second that met the SLO."""
        r = self.result
        return r.good / r.wall_s if r.wall_s else 0.0

    def json(self) -> dict:
        r = self.result
        pcts = lambda d: {f"p{q}": _num(d[q]) for q in PERCENTILES}
        return {
            "rate": self.rate,
            "kind": self.kind,
            "requests": r.requests,
            "finished": r.finished,
            "errors": self.errors,
            "lost": self.lost,
            "wall_s": r.wall_s,
            "qpm": r.qpm,
            "output_tok_s": r.output_tok_s,
            "total_tok_s": r.total_tok_s,
            "ttft_s": pcts(r.ttft),
            "tpot_s": pcts(r.tpot),
            "goodput_req_s": self.goodput,
            "slo_attainment": r.attainment,
            "meets_slo": r.meets_slo,
            "preemptions": r.preemptions,
            "decode_batch": self.decode_batch,
            "mean_context": self.mean_context,
            "step_time": self.split,
        }

    def row(self) -> str:
        r, t, p = self.result, self.result.ttft, self.result.tpot
        opt = lambda x, f: "n/a" if x is None else format(x, f)
        return (
            f"| {self.rate:g}{'' if self.kind == 'sweep' else ' (search)'} | {r.qpm:.1f} | {r.output_tok_s:,.0f} | "
            f"{r.total_tok_s:,.0f} | {t[50]:.2f} / {t[90]:.2f} / {t[99]:.2f} | "
            f"{p[50] * 1e3:.1f} / {p[90] * 1e3:.1f} / {p[99] * 1e3:.1f} | {self.goodput:.2f} | "
            f"{r.good}/{r.requests} ({'meets' if r.meets_slo else 'misses'}) | {opt(r.preemptions, 'd')} | "
            f"{r.finished} / {self.errors} / {self.lost} | {opt(self.decode_batch, '.1f')} | "
            f"{opt(self.mean_context, ',.0f')} |"
        )

    HEADER = (
        "| rate (req/s) | QPM | output tok/s | total tok/s | TTFT p50 / p90 / p99 (s) | TPOT p50 / p90 / p99 (ms) | "
        "goodput (req/s in SLO) | in SLO | preemptions | finished / errors / lost | decode batch | mean context |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|"
    )


def _num(x: float) -> float | None:
    return None if x is None or math.isnan(x) else x


def _pct(xs: list[float]) -> dict[int, float]:
    return {q: float(np.percentile(xs, q)) if xs else float("nan") for q in PERCENTILES}


def measure(
    rate: float, kind: str, record: list[dict], ins, wall: float, slo: SLO, preemptions: int | None, steps=None
) -> RateRun:
    """A batch's client records (hcfjax.bench.serve_clients.run_one: ttft, tpot, out tokens, finish) -> its
    RateRun. A request counts as finished when it ended at its length (every request ignores eos), lost when the
    client saw no terminal response (no record, or a stream that ended without a finish reason)."""
    n = len(ins)
    ok = [r for r in record if r["finish"] == "length"]
    lost = n - len(record) + sum(r["finish"] is None for r in record)
    good = sum(1 for r in ok if r["ttft"] < slo.ttft_s and (r["tpot"] or 0) < slo.tpot_s)
    result = Result(
        requests=n,
        finished=len(ok),
        wall_s=wall,
        output_tokens=sum(r["out"] for r in record),
        input_tokens=int(np.sum(ins)),
        ttft=_pct([r["ttft"] for r in ok]),
        tpot=_pct([r["tpot"] for r in ok if r["tpot"] is not None]),
        good=good,
        preemptions=preemptions,
        utilisation={},
        parts={},
        mean_decode_batch=steps.decode_batch if steps else 0.0,
        slo=slo,
    )
    errors = len(record) - len(ok) - sum(r["finish"] is None for r in record)
    batch, context, split = (steps.decode_batch, steps.mean_context, steps.split()) if steps else (None, None, None)
    return RateRun(rate, kind, result, errors, lost, batch, context, split)


def wait_idle(engine, timeout: float = 60.0) -> None:
    """Until the engine holds no request (a batch's last ones retire a step after their streams end)."""
    deadline = time.monotonic() + timeout
    while True:
        snap = engine.snapshot()
        if not (snap["running"] or snap["queued"]):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the engine still holds requests {timeout:.0f} s after a batch ended: {snap}")
        time.sleep(0.05)


def search(run: Callable[[float, str], RateRun], bounds: Search) -> tuple[RateRun | None, list[RateRun], str]:
    """The highest rate within bounds at which the SLO holds (run(rate, "search") -> RateRun, a fresh batch each), by
    geometric bisection: (its run or None, every run, a sentence saying what was found and whether a bound was
    hit)."""
    runs: list[RateRun] = []

    def meets(rate: float) -> bool:
        runs.append(run(rate, "search"))
        return runs[-1].result.meets_slo

    best = bisect_rate(meets, bounds)
    top = next((r for r in runs if r.rate == best), None)
    if best is None:
        said = f"even {bounds.lo:g} req/s misses the SLO: the highest rate within it is below the search's lower bound"
    elif best == bounds.hi:
        said = f"{bounds.hi:g} req/s meets the SLO: the search's upper bound was hit (the highest rate is above it)"
    else:
        failed = min((r.rate for r in runs if not r.result.meets_slo), default=bounds.hi)
        said = f"highest rate within the SLO: {best:.3g} req/s (the next rate tried, {failed:.3g} req/s, misses it)"
    return top, runs, said


def saturation(runs: list[RateRun]) -> RateRun | None:
    """The run of the highest output tokens/s: where the engine's throughput tops out."""
    return max(runs, key=lambda r: r.result.output_tok_s, default=None)


def table(runs: list[RateRun]) -> str:
    return "\n".join([RateRun.HEADER, *(r.row() for r in sorted(runs, key=lambda r: (r.kind != "sweep", r.rate)))])


def offline_efficiency(
    model, sat: RateRun, options, seed: int, most_new_tokens: int = 128, max_prefill_tokens: int = 16384
) -> dict:
    """The saturated run's output tokens/s over hcfjax.generate's offline decode tokens/s at its mean decode batch
    and context (bench.generate.decode_rate: prompts of context - new_tokens / 2 tokens, new_tokens each, up to
    most_new_tokens, fewer where the context is shorter; prefilled in groups of max_prefill_tokens)."""
    from hcfjax.bench.generate import decode_rate

    batch = max(1, round(sat.decode_batch))
    context = max(2, round(sat.mean_context))
    new_tokens = max(2, min(most_new_tokens, 2 * (context - 1)))
    prompt = max(1, context - new_tokens // 2)
    rng = np.random.default_rng(seed)
    stats, _ = decode_rate(model, batch, prompt, new_tokens, options, rng, max_prefill_tokens=max_prefill_tokens)
    offline = stats["decode_tokens_per_s"]
    ratio = sat.result.output_tok_s / offline if offline else None
    said = (
        f"Engine efficiency: {sat.result.output_tok_s:,.0f} output tok/s served at saturation over {offline:,.0f} "
        f"tok/s decoding offline at batch {batch} and context {prompt + new_tokens // 2:,} "
        f"(hcfjax.bench.generate.decode_rate, {new_tokens} new tokens a prompt) = "
        + ("n/a" if ratio is None else f"{ratio:.0%}")
        + "."
    )
    decode = (sat.split or {}).get("decode", {})
    if decode.get("ms_per_step") and offline:  # the engine's steps that only decode, against the offline step
        said += (
            f" The engine's decode-only steps took {decode['ms_per_step']:.2f} ms against "
            f"{batch / offline * 1e3:.2f} ms a step offline."
        )
    return {"batch": batch, "context": prompt + new_tokens // 2, "offline_tok_s": offline, "ratio": ratio, "said": said}


class GpuWindow:
    """A jax.profiler trace of the server's process over a window of a run (from `delay` seconds after start() for
    `seconds`): the GPU's kernels per engine step and how much of the window they cover, where the time between
    steps goes when the engine serves clients (their threads and the servers' share the process with its loop)."""

    def __init__(self, engine, delay: float, seconds: float):
        self.engine, self.delay, self.seconds = engine, delay, seconds
        self.result: dict | None = None
        self._thread = threading.Thread(target=self._trace, name="bench-profile", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _trace(self) -> None:
        import tempfile

        import jax

        from hcfjax.bench.common import gpu_gaps, kernel_seconds, read_planes

        time.sleep(self.delay)
        with tempfile.TemporaryDirectory() as d:
            jax.profiler.start_trace(d)
            steps, t0 = self.engine.runner.steps, time.perf_counter()
            time.sleep(self.seconds)
            steps, wall = max(1, self.engine.runner.steps - steps), time.perf_counter() - t0
            jax.profiler.stop_trace()  # (it writes the trace out: seconds not in the window)
            planes = read_planes(d)
        kernels = kernel_seconds(planes, steps)
        idle, pairs = gpu_gaps(planes, steps)
        self.result = {"steps": steps, "wall": wall, "kernels": kernels, "idle": idle, "gaps": pairs}

    def said(self) -> str:
        """What the window showed, once the run is over."""
        from hcfjax.bench.common import longest, widest

        self._thread.join()
        r = self.result
        if r is None:
            return "The profiled window produced no trace."
        if not r["kernels"]:
            return f"The profiled window ({r['wall']:.1f} s, {r['steps']} steps) holds no GPU kernels (no GPU)."
        per_step = r["wall"] / r["steps"]
        kernels = sum(r["kernels"].values())
        return (
            f"Profiled window: {r['wall']:.1f} s, {r['steps']} engine steps ({per_step * 1e3:.2f} ms each); GPU "
            f"kernels {kernels * 1e3:.2f} ms a step ({kernels / per_step:.0%} of the window), idle between records "
            f"{r['idle'] * 1e3:.2f} ms a step. Longest kernels a step, ms: {longest(r['kernels'])}. Longest gaps a "
            f"step, ms: {widest(r['gaps'])}."
        )
