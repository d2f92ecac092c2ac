"""Decoding in the serving engine's own loop against `hcfjax.generate`'s offline decode at the same batch and
context: how much of the loop's wall time the GPU's kernels cover, and where the rest goes.

    python -m hcfjax.bench.engine_loop --preset v2-lite --scheme w4a8c8 --batches 14,64,128 --context 2048 \\
        [--steps 64] [--max-slots 128] [--token-budget 4096]

For each batch B, B requests with prompts of --context random tokens go into an Engine, driven here step by step
(`Engine.step`, the iteration the server's loop thread runs: plan step n + 1, dispatch it, then read step n's tokens
and stream them). Once every request decodes, --steps iterations are timed by the wall clock, then as many again
under the profiler, whose GPU kernel records give the kernels' time per step: covered = kernels / wall (the rest is
launch gaps and host work the device waits for). The host's part of an iteration is split into the plan
(`Scheduler.schedule`), the dispatch (inputs and the jitted calls' launch) and the processing of the previous step's
tokens (after they are on the host; the wait for them is counted apart). Offline: bench.generate.decode_rate at the
same batch and context, generate's decode loop; with --profile too, the kernels whose time per step differs most
between the engine's step and generate's.

Under the profiler XLA runs its command buffers (CUDA graphs) as separate launches unless
`XLA_FLAGS=--xla_enable_command_buffers_during_profiling=true`: the kernels' times are the same either way, but
the gaps between them and the host's records (`command_buffer::update` when a step re-records a graph) are those
of the graphs only with the flag.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import jax
import numpy as np

from hcfjax.bench.common import (
    busiest_host,
    gpu_gaps,
    header,
    host_seconds,
    kernel_seconds,
    layers_per_iteration,
    longest,
    record_counts,
    traced_planes,
    widest,
    write_records,
)
from hcfjax.engine.request import Status


class Timings:
    """Seconds spent in the engine's plan, dispatch, wait for a step's tokens, processing of them and sending them
    on (the after-step hooks registered so far: a front-end process's link), by wrapping the engine's methods (the
    engine itself is unchanged)."""

    PARTS = ("plan", "dispatch", "wait", "process", "send")

    def __init__(self, engine):
        self.reset()
        schedule, dispatch, process = engine.scheduler.schedule, engine.runner.dispatch, engine._process

        def timed(part, fn):
            def call(*args):
                t0 = time.perf_counter()
                out = fn(*args)
                self.seconds[part] += time.perf_counter() - t0
                self.calls[part] += 1
                return out

            return call

        def waited(d):
            t0 = time.perf_counter()
            jax.block_until_ready([x for x in (d.first, d.nxt) if x is not None])
            self.seconds["wait"] += time.perf_counter() - t0
            return timed("process", process)(d)

        engine.scheduler.schedule = timed("plan", schedule)
        engine.runner.dispatch = timed("dispatch", dispatch)
        engine._process = waited
        engine._after_step.current = tuple(timed("send", hook) for hook in engine._after_step)

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.PARTS, 0.0)
        self.calls = dict.fromkeys(self.PARTS, 0)

    def per_iteration(self) -> dict[str, float]:
        """Seconds of each part per loop iteration (an iteration plans once)."""
        n = max(1, self.calls["plan"])
        return {k: v / n for k, v in self.seconds.items()}


def decoding(engine) -> bool:
    """Every request holds a slot and decodes (no prompt left to prefill)."""
    s = engine.scheduler
    return not s.waiting and not engine._inbox and all(r.status == Status.DECODING for r in s.running)


def output_room(batch: int, context: int, steps: int, budget: int) -> int:
    """Tokens each request may produce: enough that the first to decode still does when the last has prefilled,
    and through the settling, timed and profiled steps (the 64 covers the settling and the profiler's warm-up). The
    scheduler's token budget counts decode rows, and a step's first chunk takes min(what its prompt has left,
    budget - decode rows) tokens: each step finishes that prompt or moves it on by at least budget - batch tokens, so
    the prompts take at most batch * ceil(context / (budget - batch)) steps (with every request admitted at once:
    engine_loop gives each slot its whole context in pages)."""
    if budget <= batch:
        raise ValueError(
            f"the token budget ({budget}) must exceed the largest batch ({batch}): its decode rows would"
            " leave no room for the prompts"
        )
    return batch * -(-context // (budget - batch)) + 2 * steps + 64


def kernel_differences(engine: dict[str, float], offline: dict[str, float], n: int = 10) -> str:
    """The n kernel names whose time per step differs most between the engine's step and the offline one (engine
    minus offline, ms; a name only one side runs counts fully), then the sums of both sides."""
    diff = {k: engine.get(k, 0.0) - offline.get(k, 0.0) for k in engine.keys() | offline.keys()}
    top = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:n]
    sums = f"all kernels {sum(engine.values()) * 1e3:.2f} against {sum(offline.values()) * 1e3:.2f}"
    return ", ".join(f"{k[:40]} {v * 1e3:+.3f}" for k, v in top) + f"; {sums}"


def loop_case(
    engine, timings: Timings, batch: int, context: int, steps: int, profile: bool, rng, records: str | None = None
) -> dict:
    """One batch through the engine's loop: seconds per iteration (wall, GPU kernels, and the host's parts). The
    engine compiles what the batch's prefill needs on first use (no warm-up: only the shapes used) and is empty
    again after."""
    vocab = engine.model.cfg.vocab_size
    new_tokens = output_room(batch, context, steps, engine.config.token_budget)
    reqs = [
        engine.submit(rng.integers(2, vocab, context).tolist(), max_new_tokens=new_tokens, stop_token_ids=[])
        for _ in range(batch)
    ]
    while not decoding(engine):
        engine.step()
    for _ in range(8):  # the decode rows' inputs settle; every request has a token in flight
        engine.step()
    jax.block_until_ready(engine.runner.state.tok)
    timings.reset()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    jax.block_until_ready(engine.runner.state.tok)
    wall = (time.perf_counter() - t0) / steps
    host = {k: v / steps for k, v in timings.seconds.items()}
    kernels, gaps, counts, host_records = None, None, None, None
    if profile:  # the same steps under the profiler: the kernels' seconds per step, where the GPU idled, the host
        settled = lambda _: jax.block_until_ready(engine.runner.state.tok)  # noqa: E731
        planes = traced_planes(engine.step, reps=steps, wait=settled)
        kernels, gaps, counts = kernel_seconds(planes, steps), gpu_gaps(planes, steps), record_counts(planes, steps)
        host_records = host_seconds(planes, steps)
        if records:
            write_records(records.format(batch=batch), planes)
    if len(engine.scheduler.running) != batch:  # (the steps timed would have decoded a smaller batch)
        left = batch - len(engine.scheduler.running)
        raise RuntimeError(f"{left} of {batch} requests stopped decoding (finished or preempted) while being timed")
    for req in reqs:
        engine.abort(req.id)
    while engine.has_work():
        engine.step()
    return {
        "batch": batch,
        "wall": wall,
        "kernels": kernels,
        "gaps": gaps,
        "counts": counts,
        "host_records": host_records,
        **host,
    }


def main(argv=None) -> None:
    from hcfjax.bench.generate import decode_profile, decode_rate
    from hcfjax.engine import Engine, EngineConfig
    from hcfjax.engine.config import lookahead_tokens
    from hcfjax.options import Options
    from hcfjax.serving.config import SCHEMES, load_model

    ap = argparse.ArgumentParser(prog="python -m hcfjax.bench.engine_loop", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="v2-lite", help="the random model's shape (hcfjax.random_model.PRESETS)")
    ap.add_argument("--scheme", choices=SCHEMES, help="quantise the random model first")
    ap.add_argument("--batches", required=True, type=lambda s: [int(b) for b in s.split(",")])
    ap.add_argument("--context", type=int, default=2048, help="prompt tokens of each request")
    ap.add_argument("--steps", type=int, default=64, help="iterations timed (and as many profiled)")
    ap.add_argument("--max-slots", type=int, help="default: the largest batch")
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--token-budget", type=int, default=512, help="of the prompts' prefill (small: quick to compile)")
    ap.add_argument("--profile", action="store_true", help="also the GPU kernels' time per iteration")
    ap.add_argument("--offline", action="store_true", help="also generate's offline decode at each batch")
    ap.add_argument(
        "--records",
        help="with --profile: write the profiled steps' GPU records to this file ('{batch}' in it: one file per batch; "
        "`python -m hcfjax.bench.records FILE --steps N` sums them per kernel)",
    )
    args = ap.parse_args(argv)

    model = load_model(None, args.preset, args.scheme)
    slots = args.max_slots or max(args.batches)
    try:
        context = args.context + output_room(max(args.batches), args.context, args.steps, args.token_budget)
    except ValueError as e:
        ap.error(f"--token-budget: {e}")
    config = EngineConfig(
        max_slots=slots,
        num_pages=slots * -(-(context + lookahead_tokens(0)) // args.page_size),  # every slot its context: no wait
        page_size=args.page_size,
        max_model_len=context,
        token_budget=args.token_budget,
        min_prefill_bucket=64,
        options=Options.from_env(os.environ),  # HCFJAX_MLA etc. (hcfjax.options)
    )
    rng = np.random.default_rng(0)
    engine = Engine(model, config)
    t0 = time.perf_counter()
    compiled = engine.runner.warmup(prefill=False)  # every decode row count at once (prefill shapes: on first use)
    print(f"[{compiled} decode programs compiled in {time.perf_counter() - t0:.0f} s]", flush=True)
    gc.collect()
    gc.freeze()  # as the server's loop runs (hcfjax.serving.server.until_signal)
    timings = Timings(engine)
    print(f"## `python -m hcfjax.bench.engine_loop` (preset {args.preset}, random weights, {args.scheme or 'bf16'})")
    print(
        f"\n{header()}; context {args.context}; {config.max_slots} slots; {args.steps} iterations timed; "
        f"XLA's products (Options.xla_gemm) in decode: {config.options.xla_gemm_mode()}; "
        f"decode layers a loop iteration: {layers_per_iteration(config.options)}\n"
    )
    print(
        "| batch | engine loop (ms / step) | GPU kernels / wall | plan | dispatch | wait for tokens | process | "
        "offline decode (ms / step) | offline / engine |"
    )
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    for batch in args.batches:
        row = loop_case(engine, timings, batch, args.context, args.steps, args.profile, rng, args.records)
        covered = f"{sum(row['kernels'].values()) / row['wall']:.0%}" if row["kernels"] else "n/a"
        offline, off = "n/a | n/a", None
        if args.offline:  # (beside the engine's cache: both fit at these sizes)
            stats, gen = decode_rate(
                model, batch, args.context, 2 * args.steps, config.options, rng, max_prefill_tokens=args.context
            )
            step = 1 / stats["decode_tokens_per_s"] * batch
            offline = f"{step * 1e3:.2f} | {step / row['wall']:.0%}"
            if args.profile:
                where = args.records.format(batch=f"{batch}-offline") if args.records else None
                off = decode_profile(gen, 2 * args.steps, where)
        ms = lambda k, row=row: f"{row[k] * 1e3:.2f}"  # noqa: E731
        print(
            f"| {row['batch']} | {ms('wall')} | {covered} | {ms('plan')} | {ms('dispatch')} | {ms('wait')} | "
            f"{ms('process')} | {offline} |",
            flush=True,
        )
        if row["kernels"]:  # (under the row, so a run cut short keeps it)
            print(f"  longest kernels per step at batch {row['batch']}, ms: {longest(row['kernels'])}", flush=True)
            idle, pairs = row["gaps"]
            print(  # (the profiler's Python tracer slows the host: these steps idle more than the timed ones)
                f"  GPU idle per profiled step: {idle * 1e3:.2f} ms; longest gaps per step, ms: {widest(pairs)}",
                flush=True,
            )
            n = row["counts"]
            print(
                f"  per step: {n['kernels']:.0f} kernels, {n['copies']:.0f} copies and memsets "
                f"({n['copy_s'] * 1e3:.2f} ms)",
                flush=True,
            )
            print(f"  host records per step (count x ms, nested): {busiest_host(row['host_records'])}", flush=True)
        if row["kernels"] and off:
            n = off["counts"]
            print(
                f"  offline per step: GPU idle {off['idle'] * 1e3:.2f} ms; {n['kernels']:.0f} kernels, "
                f"{n['copies']:.0f} copies and memsets ({n['copy_s'] * 1e3:.2f} ms)",
                flush=True,
            )
            print(f"  engine against offline, ms per step: {kernel_differences(row['kernels'], off['kernels'])}")


if __name__ == "__main__":
    main()
