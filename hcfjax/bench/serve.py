"""Serving benchmark: Poisson arrivals over gRPC against a server on loopback, at one rate, a sweep of rates, or a
search for the highest rate within the SLO.

    python -m hcfjax.bench.serve [--model PATH | --preset v2-lite] [--scheme w4a8c8|w4a8|w4a16|w8a8]
        [--requests 64] [--rate 2.0 | --sweep R1,R2,...] [--search [--search-range 0.25,16] [--search-iters 6]]
        [--input-scale 1] [--output-scale 0.125] [--max-slots 32] [--page-size 64] [--token-budget 2048]
        [--max-model-len N] [--speculative K] [--front process|thread] [--efficiency]
        [--pd socket|jax [--pd-gpus P,D]] [--out FILE.json] [--md FILE.md]

Lengths follow the reference's workload (hcfjax.sim.workload, which the simulator serves too: input mean 3.5k
tokens, max 16k; output mean 1.2k, max 32k), each drawn from a log-normal with that mean (sigma 0.8), clipped at the
max; inputs are multiplied by --input-scale (default 1: production lengths) and outputs by --output-scale (default
1/8: a 32k-token tail would otherwise decode alone for minutes). The context (--max-model-len) defaults to the
longest input plus the longest output, so nothing is clipped. Prompts are random token ids and outputs ignore eos,
so every request produces its drawn length.

The gRPC server runs in a process of its own over the engine in this one (hcfjax.serving.front_process, as `hcfjax
serve` runs it; --front thread: on threads of this process). Every rate is a fresh batch of --requests requests (the
same lengths for every rate: one seed), sent by a client process of their own (a thread per request) once the
previous batch has drained, to one server compiled once
(Engine.warmup() compiles every step shape first, so compiles stay out). --sweep runs its rates in order; --search
bisects (geometrically) for the highest rate at which 90% of the requests meet the SLO (TTFT < 2 s and TPOT < 50 ms;
hcfjax.sim.workload.SLO) within --search-range, and says when a bound of the range was hit. Reported per rate, as a
table (and as JSON with --out): QPM, output and total tokens/s, TTFT and TPOT p50/p90/p99, goodput (requests per
second meeting the SLO), preemptions, requests finished / ended in an error / lost (no terminal response: must be 0,
else the benchmark exits with an error), and the engine's mean decode batch and context. At the rate of the highest
output tokens/s (saturation) --efficiency also decodes offline at that batch and context in the same process
(hcfjax.bench.generate.decode_rate) and gives the ratio of the two output tokens/s, with the engine's time split by
kind of step (decode only, prefill and decode, prefill only). --profile traces a window of the last rate's run and
reports the GPU's kernels per step.

--pd runs the same workload against prefill/decode disaggregation (hcfjax/pd/): a prefill worker, a decode worker
and the router as three processes (on one GPU they share it, each worker with 45% of its memory; --pd-gpus 0,1 gives
each worker a GPU of its own), the KV cache moved over the given transport. The two workers load and compile side
by side; once the router's health says SERVING (it has heard both), a few warm-up prompts of each length bucket go
through first.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import threading
from pathlib import Path

import numpy as np

from hcfjax import trace
from hcfjax.bench.common import header
from hcfjax.bench.serve_clients import ClientProcess, warm_pd
from hcfjax.bench.serve_pd import pd_gpus, start_pd, stop_pd
from hcfjax.engine.config import context_length
from hcfjax.serving.config import SCHEMES
from hcfjax.sim.workload import REFERENCE, workload

FRONTS = {"process": "in a process of its own", "thread": "on threads of the engine's process"}


def shown_args(argv) -> str:
    """The command line without --out (the heading names the command that made the table)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--out" in args:
        i = args.index("--out")
        del args[i : i + 2]
    return " ".join(a for a in args if not a.startswith("--out="))


def engine_config(args, speculative=None):
    """The engine the benchmark serves with (also what hcfjax.bench.sim_validate measures and simulates)."""
    from hcfjax.engine import EngineConfig
    from hcfjax.serving.config import run_options

    return EngineConfig(
        max_slots=args.max_slots,
        page_size=args.page_size,
        token_budget=args.token_budget,
        mixed_token_budget=args.mixed_token_budget,
        max_model_len=args.max_model_len,
        max_prefill_rows=args.prefill_rows,
        min_prefill_bucket=args.min_bucket,
        max_queue=args.requests + 8,
        speculative=speculative,
        options=run_options(),
    )


def pct(xs, q):
    xs = [x for x in xs if x is not None]
    return float(np.percentile(xs, q)) if xs else float("nan")


def rates(spec: str) -> list[float]:
    """--sweep 'R1,R2,...' -> [R1, R2, ...] (requests per second, each > 0)."""
    try:
        out = [float(r) for r in spec.split(",") if r.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"rates are numbers separated by commas, got {spec!r}") from None
    if not out or min(out) <= 0:
        raise argparse.ArgumentTypeError(f"rates must be > 0, got {spec!r}")
    return out


def production_context(input_scale: float, output_scale: float) -> int:
    """A context that holds the longest input and the longest output of the scaled reference workload."""
    return math.ceil(REFERENCE["input_max"] * input_scale) + math.ceil(REFERENCE["output_max"] * output_scale)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m hcfjax.bench.serve", description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--preset", help="a random model of this preset (hcfjax.random_model.PRESETS) instead of --model")
    ap.add_argument("--scheme", choices=SCHEMES, help="quantise the model in memory first (as `hcfjax quantize`)")
    ap.add_argument("--requests", type=int, default=64, help="requests per rate")
    ap.add_argument("--rate", type=float, default=2.0, help="mean arrivals per second (Poisson), without --sweep")
    ap.add_argument("--sweep", type=rates, metavar="R1,R2,...", help="run these rates in turn, one batch each")
    ap.add_argument("--search", action="store_true", help="bisect for the highest rate within the SLO")
    ap.add_argument("--search-range", type=rates, default=[0.25, 16.0], metavar="LO,HI", help="req/s")
    ap.add_argument("--search-iters", type=int, default=6, help="bisection steps after the range's two ends")
    ap.add_argument("--input-scale", type=float, default=1.0, help="multiplies the reference's input lengths")
    ap.add_argument("--output-scale", type=float, default=0.125, help="multiplies the reference's output lengths")
    ap.add_argument("--max-slots", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--token-budget", type=int, default=2048)
    ap.add_argument("--mixed-token-budget", type=int, help="tokens in a step that also decodes (default: the budget)")
    ap.add_argument("--max-model-len", type=int, help="default: the longest input plus the longest output")
    ap.add_argument("--prefill-rows", type=int, default=4)
    ap.add_argument("--min-bucket", type=int, default=16, help="smallest prefill chunk shape (fewer compiles)")
    ap.add_argument("--speculative", type=int, default=0)
    ap.add_argument(
        "--front",
        choices=["process", "thread"],
        default="process",
        help="the gRPC server in a process of its own over the engine, as `hcfjax serve` runs it (default), or on "
        "threads of the engine's process (its streams then share the engine loop's interpreter)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--efficiency",
        action="store_true",
        help="after the runs, decode offline at the saturated rate's decode batch and context (bench.generate) and "
        "give the engine's output tokens/s over the offline ones",
    )
    ap.add_argument(
        "--profile",
        type=float,
        nargs=2,
        metavar=("DELAY", "SECONDS"),
        help="trace the server's process for SECONDS from DELAY seconds into the last rate's run (jax.profiler) and "
        "report the GPU's kernels per engine step and how much of the window they cover",
    )
    ap.add_argument(
        "--pd",
        choices=["socket", "jax"],
        help="prefill/decode disaggregated instead of colocated: a prefill worker, a decode worker and the router as "
        "three processes on this machine (sharing one GPU, memory split, unless --pd-gpus), the KV cache over this "
        "transport",
    )
    ap.add_argument("--pd-gpus", metavar="P,D", help="with --pd: the prefill worker on GPU P, the decode worker on D")
    ap.add_argument("--out", help="write the results (settings and every rate) to this JSON file")
    ap.add_argument("--md", help="append the markdown table to this file")
    return ap


@dataclasses.dataclass
class Served:
    """The server under test: a colocated engine behind gRPC in this process, or the three PD processes."""

    port: int
    cfg: object  # the model's ModelConfig
    limit: int  # the context a request may fill
    warm: float  # seconds of warm-up
    summary: str  # how it serves, for the heading
    model: object = None
    engine: object = None
    server: object = None
    procs: list | None = None


def start(args) -> Served:
    import hcfjax
    from hcfjax.engine import Engine
    from hcfjax.kernels import engine_summary
    from hcfjax.serving.config import load_model
    from hcfjax.serving.front_process import FrontProcess, Listen, Servers

    if args.pd:
        from hcfjax.config import ModelConfig
        from hcfjax.random_model import preset_config

        path = Path(args.model or hcfjax.DEFAULT_MODEL)
        cfg = preset_config(args.preset) if args.preset else ModelConfig.from_json(path / "config.json")
        procs, port, warm = start_pd(args)
        summary = f"PD: prefill, decode and router processes, KV over {args.pd}" + (
            " (prefill on GPU {}, decode on GPU {})".format(*pd_gpus(args.pd_gpus)) if args.pd_gpus else ""
        )
        return Served(
            port, cfg, context_length(cfg.max_position_embeddings, args.max_model_len), warm, summary, procs=procs
        )
    model = load_model(args.model, args.preset, args.scheme)
    spec = hcfjax.SpeculativeConfig(args.speculative) if args.speculative else None
    args.max_model_len = context_length(model.cfg.max_position_embeddings, args.max_model_len)  # as the PD roles
    engine = Engine(model, engine_config(args, spec))
    warm = engine.warmup()
    engine.start()
    listen = Listen(grpc_port=0)
    server = Servers(engine, listen) if args.front == "thread" else FrontProcess(engine, listen)
    port = server.start().ports["grpc"]
    summary = f"colocated, the gRPC server {FRONTS[args.front]}; {engine_summary(engine)}"
    return Served(port, model.cfg, engine.max_model_len, warm, summary, model, engine, server)


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    if trace_dir := os.environ.get(trace.DIR_VARIABLE):  # the client's marks (hcfjax.trace); PD workers inherit it
        trace.enable(trace_dir)
    if args.pd and (args.efficiency or args.profile):
        raise SystemExit("--efficiency and --profile need the engine in this process (colocated, not --pd)")
    if len(args.search_range) != 2 or args.search_range[0] >= args.search_range[1]:
        raise SystemExit(f"--search-range takes LO,HI with LO < HI, got {args.search_range}")
    args.max_model_len = args.max_model_len or production_context(args.input_scale, args.output_scale)

    from hcfjax.bench.serve_load import (
        GpuWindow,
        StepStats,
        measure,
        offline_efficiency,
        saturation,
        search,
        table,
        time_split,
        wait_idle,
    )
    from hcfjax.serving.client import connect, generate
    from hcfjax.sim.sweep import Search
    from hcfjax.sim.workload import SLO

    served = start(args)
    engine, limit, slo = served.engine, served.limit, SLO()
    channel, stub = connect("127.0.0.1", served.port, ready_timeout=30)
    clients = ClientProcess(served.port)

    def requests(rate: float):
        """The workload at this rate: the same lengths (and prompts) for every rate, arrivals scaled."""
        return workload(
            args.seed,
            args.requests,
            rate,
            args.input_scale,
            limit,
            served.cfg.vocab_size,
            output_scale=args.output_scale,
            max_input=limit - 1,
        )

    ins, outs, _, _ = requests(1.0)
    generate(stub, [1, 2, 3], max_new_tokens=4, ignore_eos=True)  # the server answers
    if args.pd:
        served.warm += warm_pd(stub, ins, limit, args.prefill_rows)
    compiles_warm = engine.snapshot()["compiles"] if engine else 0
    steps = StepStats(engine) if engine else None
    batches = iter(range(1 << 30))

    rates = args.sweep or ([] if args.search else [args.rate])
    window = None

    def run(rate: float, kind: str):
        """One fresh batch at `rate`, after the previous one drained."""
        nonlocal window
        _, _, prompts, arrivals = requests(rate)
        before = engine.snapshot()["preemptions"] if engine else None
        if steps:
            steps.reset()
        if args.profile and kind == "sweep" and rate == rates[-1]:
            window = GpuWindow(engine, *args.profile)
            window.start()
        record, wall = clients.run(prompts, outs, arrivals, tag=f"bench{next(batches)}-")
        if engine:
            wait_idle(engine)
        preempted = engine.snapshot()["preemptions"] - before if engine else None
        done = measure(rate, kind, record, ins, wall, slo, preempted, steps)
        print(done.row(), flush=True)
        return done

    print(table([]), flush=True)  # the header; each rate's row follows as it finishes
    runs = [run(rate, "sweep") for rate in rates]
    found = None
    if args.search:
        _, probes, found = search(run, Search(*args.search_range, iters=args.search_iters))
        runs += probes
    channel.close()
    clients.close()
    compiles_run = engine.snapshot()["compiles"] - compiles_warm if engine else "n/a"
    if engine is not None:
        options = engine.config.options  # the offline decode runs as the engine did
        served.server.shutdown()
        engine.shutdown()
        served.engine = served.server = engine = None  # the cache's memory goes back before an offline decode
    else:
        stop_pd(served.procs)

    sat = saturation(runs)
    notes = []
    if sat is not None and sat.decode_batch is not None:
        notes.append(
            f"Saturation (the rate of the highest output tokens/s, {sat.rate:g} req/s): "
            f"{sat.result.output_tok_s:,.0f} output tok/s at a mean decode batch of {sat.decode_batch:.1f} "
            f"and a mean context of {sat.mean_context:,.0f} tokens."
        )
        notes.append(time_split(sat.split, sat.result.wall_s))
    efficiency = None
    if args.efficiency and sat is not None and sat.decode_batch:
        # prefilled in groups of the server's budget: the MoE kernels its steps lowered
        efficiency = offline_efficiency(served.model, sat, options, args.seed, max_prefill_tokens=args.token_budget)
        notes.append(efficiency["said"])
    if window is not None:
        notes.append(f"At {rates[-1]:g} req/s: " + window.said())
    if found:
        notes.append(f"Search over {args.search_range[0]:g}-{args.search_range[1]:g} req/s: {found}.")
    heading = describe(args, served, ins, outs, slo, f"{compiles_warm} compiles", compiles_run)
    command = f"python -m hcfjax.bench.serve {shown_args(argv)}"
    report = "\n".join([f"## `{command}`", "", heading, "", table(runs), "", *notes])
    print("\n" + report)
    if args.md:
        Path(args.md).parent.mkdir(parents=True, exist_ok=True)
        with open(args.md, "a") as f:
            f.write(report + "\n\n")
    if args.out:
        out = {
            "command": command,
            "heading": heading,
            "slo": dataclasses.asdict(slo),
            "rates": [r.json() for r in runs],
            "search": None if found is None else {"range": args.search_range, "found": found},
            "saturation": None if sat is None else sat.json(),
            "efficiency": efficiency,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    lost = sum(r.lost for r in runs)
    if lost:
        raise SystemExit(f"{lost} requests got no terminal response")


def describe(args, served: Served, ins, outs, slo, compiled: str, compiles_run) -> str:
    """The results' heading: where, what model, the workload's lengths, the engine, warm-up, the SLO."""
    import hcfjax
    from hcfjax.serving.config import random_label

    label = random_label(args.preset, args.scheme)
    what = f"preset {args.preset} ({label})" if label else f"model {Path(args.model or hcfjax.DEFAULT_MODEL).name}"
    if args.scheme and not label:
        what += f", quantised to {args.scheme}"
    return (
        f"{header()}; {what}; {args.requests} requests per rate; lengths = reference x {args.input_scale:g} "
        f"(input) and x {args.output_scale:g} (output): input mean {ins.mean():.0f}, max {ins.max()}; output mean "
        f"{outs.mean():.0f}, max {outs.max()}; engine: {args.max_slots} slots, page {args.page_size}, token budget "
        f"{args.token_budget}"
        + (f" ({args.mixed_token_budget} with decode rows)" if args.mixed_token_budget else "")
        + f", context {served.limit}"
        + (f", speculative k={args.speculative}" if args.speculative else "")
        + f"; {served.summary}. Warm-up {served.warm:.0f} s ({compiled}); compiles during the runs: {compiles_run}. "
        f"SLO: TTFT < {slo.ttft_s:g} s and TPOT < {slo.tpot_s * 1e3:g} ms for {slo.attainment:.0%} of the requests."
    )


if __name__ == "__main__":
    threading.excepthook = lambda a: print("thread error:", a.exc_value)
    main()
