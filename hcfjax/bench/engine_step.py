"""Engine step benchmark: the serving engine's own step programs timed at the shapes serving runs, and where their
time goes.

    python -m hcfjax.bench.engine_step --preset v2-lite --scheme w4a8c8 --max-slots 64 --page-size 64 \\
        --max-model-len 20480 --token-budget 4096 --cases 1x4096@0,1x4096@8192,2x2048@0,14@3860,1x4096@0+14@3860 \\
        [--profile]

A case is one engine iteration (`hcfjax.engine.runner.ModelRunner.dispatch`, as the server calls it), its prefill
part, its decode part or both joined by `+`:
- `RxT@C`: R prompt chunks of T tokens each, after C tokens of each prompt already in the cache (a chunked prompt's
  later chunks attend over its earlier ones);
- `B@C`: B decode rows at a context of C tokens (the other slots inactive).
Each case is timed as the server runs it: inputs built on the host from the plan, the step dispatched, its outputs
waited for (the median of --reps iterations after a compiling one). Floors as in `hcfjax.bench.generate` (matmul
FLOPs at the bf16 rate for prefill, bytes at copy bandwidth for decode; for a mixed case their sum), from ceilings
measured in the same run. --profile adds, per case, the GPU kernels of a profiler trace: their sum against the
wall time (the rest is launch gaps and host work) and the longest of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import re
import statistics
import time

import jax
import numpy as np

from hcfjax.bench.common import copy_bandwidth, header, kernel_times, matmul_flops, torch_copy_bandwidth
from hcfjax.bench.generate import _active_params, ceilings_line, decode_bytes
from hcfjax.engine.request import Request
from hcfjax.engine.scheduler import Chunk, StepPlan
from hcfjax.options import Options
from hcfjax.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class Case:
    rows: int = 0  # prefill chunks (0: no prefill part)
    tokens: int = 0  # tokens per chunk
    before: int = 0  # tokens of each chunk's prompt already in the cache
    batch: int = 0  # decode rows (0: no decode part)
    context: int = 0  # decode rows' context

    @classmethod
    def parse(cls, text: str) -> Case:
        fields = {}
        for part in text.split("+"):
            if m := re.fullmatch(r"(\d+)x(\d+)@(\d+)", part):
                fields.update(rows=int(m[1]), tokens=int(m[2]), before=int(m[3]))
            elif m := re.fullmatch(r"(\d+)@(\d+)", part):
                fields.update(batch=int(m[1]), context=int(m[2]))
            else:
                raise argparse.ArgumentTypeError(f"{part!r} is neither RxT@C (prefill) nor B@C (decode)")
        case = cls(**fields)
        if min(v for v in dataclasses.astuple(case) if v) < 0 or not (case.rows or case.batch):
            raise argparse.ArgumentTypeError(f"{text!r}: no work")
        return case

    def __str__(self) -> str:
        parts = [f"{self.rows}x{self.tokens}@{self.before}"] if self.rows else []
        return " + ".join(parts + ([f"{self.batch}@{self.context}"] if self.batch else []))


class Bench:
    """An engine (not started: this drives its runner directly) and requests placed in its cache for each case."""

    def __init__(self, engine, seed: int = 0):
        self.engine, self.runner, self.sched = engine, engine.runner, engine.scheduler
        self.rng = np.random.default_rng(seed)
        self.vocab = engine.cfg.vocab_size
        self.n = 0

    def _request(self, length: int) -> Request:
        alloc = self.sched.alloc[0]
        req = Request(
            f"bench-{self.n}",
            list(self.rng.integers(2, self.vocab, length)),
            SamplingParams(),
            1 << 20,
            frozenset(),
            self.n,
            0.0,
        )
        self.n += 1
        pages = alloc.pages_for(length + 64)
        if pages > alloc.num_free:
            raise SystemExit(f"the cache has {alloc.num_free} free pages; this case needs {pages} more")
        req.rank, req.slot, req.pages = 0, heapq.heappop(self.sched.free_slots[0]), alloc.allocate(pages)
        return req

    def _release(self, reqs) -> None:
        for req in reqs:
            self.sched.alloc[0].release(req.pages)
            heapq.heappush(self.sched.free_slots[0], req.slot)

    def plan(self, case: Case) -> tuple[StepPlan, list[Request]]:
        chunks = []
        for _ in range(case.rows):
            req = self._request(case.before + case.tokens)
            chunks.append(Chunk(req, case.before, case.tokens, final=False))
        decode = [self._request(case.context) for _ in range(case.batch)]
        if decode:  # the decode rows' slots hold `context` tokens (their cache's contents do not change the time)
            runner = self.runner
            slots = np.array([r.slot for r in decode])
            runner.state = dataclasses.replace(runner.state, length=runner.state.length.at[slots].set(case.context))
        return StepPlan(chunks, decode), [c.req for c in chunks] + decode

    def time(self, case: Case, reps: int, profile: bool):
        """-> (median seconds of an iteration, {kernel: seconds per iteration} or None)."""
        plan, reqs = self.plan(case)
        runner = self.runner

        def iteration():
            d = runner.dispatch(plan)
            return [x for x in (d.first, d.nxt) if x is not None]  # (the state is donated to the next step)

        jax.block_until_ready(iteration())  # compiles the shapes on first use
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(iteration())
            times.append(time.perf_counter() - t0)
        kernels = kernel_times(iteration, reps=min(reps, 5)) if profile else None
        self._release(reqs)
        return statistics.median(times), kernels


def floor_s(cfg, params, case: Case, cache_dtype, flops, bw) -> float | None:
    """Prefill matmul FLOPs (active parameters, and attention over the cached and causal positions) at the bf16
    rate, plus decode bytes at copy bandwidth."""
    if flops is None or bw is None:
        return None
    t = 0.0
    if case.rows:
        tokens = case.rows * case.tokens
        attended = case.rows * case.tokens * (case.before + case.tokens / 2)
        attn = 2 * 2 * cfg.num_hidden_layers * cfg.num_attention_heads * attended * cfg.qk_head_dim
        t += (2 * tokens * _active_params(cfg) + attn) / flops
    if case.batch:
        t += decode_bytes(cfg, params, case.batch, case.context, cache_dtype) / bw
    return t


def run_cases(model, config, args, flops, bw) -> list[str]:
    """Prints the table of args.cases on an engine of `config`; -> its profile's table rows."""
    from hcfjax.engine import Engine
    from hcfjax.kernels import engine_summary

    engine = Engine(model, config)
    bench = Bench(engine)
    cache_dtype = engine.runner.state.cache.kv.dtype
    mode = config.options.prefill_attention
    print(
        f"\nPrefill attention {mode}; engine: {args.max_slots} slots, page {args.page_size}, context "
        f"{engine.max_model_len}; {engine_summary(engine)}\n"
    )
    print("| case | wall | tokens/s | floor | floor / wall | GPU kernels / wall |")
    print("|---|---|---|---|---|---|", flush=True)
    profiles = []
    for case in args.cases:
        wall, kernels = bench.time(case, args.reps, args.profile)
        floor = floor_s(model.cfg, model.params, case, cache_dtype, flops, bw)
        tokens = case.rows * case.tokens + case.batch
        busy = f"{sum(kernels.values()) / wall:.0%}" if kernels else "n/a"
        shown = "n/a | n/a" if floor is None else f"{floor * 1e3:.2f} ms | {floor / wall:.0%}"
        print(f"| {case} | {wall * 1e3:.2f} ms | {tokens / wall:,.0f} | {shown} | {busy} |", flush=True)
        if kernels:
            top = sorted(kernels.items(), key=lambda kv: -kv[1])[: args.top]
            profiles += [f"| {mode} | {case} | {name[:70]} | {t * 1e6:,.1f} | {t / wall:.1%} |" for name, t in top]
    del engine, bench
    return profiles


def main(argv=None) -> None:
    from hcfjax.engine import EngineConfig
    from hcfjax.serving.config import SCHEMES, load_model

    ap = argparse.ArgumentParser(prog="python -m hcfjax.bench.engine_step", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="v2-lite", help="the random model's shape (hcfjax.random_model.PRESETS)")
    ap.add_argument("--scheme", choices=SCHEMES, help="quantise the random model first")
    ap.add_argument("--cases", required=True, type=lambda s: [Case.parse(c) for c in s.split(",")])
    ap.add_argument("--max-slots", type=int, default=64)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=20480)
    ap.add_argument("--token-budget", type=int, default=4096)
    ap.add_argument("--prefill-rows", type=int, default=4)
    ap.add_argument(
        "--prefill-attention",
        default=["auto"],
        type=lambda s: s.split(","),
        help="Options.prefill_attention (auto, fused, blocked), or several (fused,blocked) timed in turn",
    )
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--profile", action="store_true", help="also the GPU kernels of each case")
    ap.add_argument("--top", type=int, default=6, help="kernels shown per case with --profile")
    args = ap.parse_args(argv)

    model = load_model(None, args.preset, args.scheme)
    on_gpu = jax.devices()[0].platform == "gpu"
    torch_bw = torch_copy_bandwidth() if on_gpu else None
    xla_bw = copy_bandwidth() if on_gpu else None
    flops = matmul_flops() if on_gpu else None
    print(f"## `python -m hcfjax.bench.engine_step` (preset {args.preset}, random weights, {args.scheme or 'bf16'})")
    print(f"\n{header()}\n\n{ceilings_line(torch_bw, xla_bw, flops)}")
    profiles = []
    for mode in args.prefill_attention:
        config = EngineConfig(
            max_slots=args.max_slots,
            page_size=args.page_size,
            max_model_len=args.max_model_len,
            token_budget=args.token_budget,
            max_prefill_rows=args.prefill_rows,
            min_prefill_bucket=64,
            options=Options(prefill_attention=mode),
        )
        profiles += run_cases(model, config, args, flops, torch_bw or xla_bw)
    if profiles:
        print("\nThe longest GPU kernels of each case (a profiler trace):\n")
        print("| prefill attention | case | kernel | us per iteration | share of the wall time |")
        print("|---|---|---|---|---|")
        print("\n".join(profiles), flush=True)


if __name__ == "__main__":
    main()
