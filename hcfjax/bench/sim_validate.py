"""Validate the simulator against the real engine on this device: calibrate, serve, simulate, compare; colocated,
and with --pd also prefill/decode disaggregated.

    python -m hcfjax.bench.sim_validate             # colocated, the serve.md V2-Lite run's settings, a GPU (~3 min)
    python -m hcfjax.bench.sim_validate --rates 1,4,16  # the same at three rates, served in turn, one calibration
    python -m hcfjax.bench.sim_validate --pd jax --pd-gpus 0,1 --out FILE   # and PD: 2 GPUs, ~6-7 min (cold cache)
    python -m hcfjax.bench.sim_validate --model hcfjax/assets/stdlib-v3 --requests 8 --rate 4 --scale 0.02 \\
        --max-slots 4 --page-size 16 --token-budget 64 --prefill-rows 1 --min-bucket 64 --max-model-len 512 \\
        --calib-slots 2 [--pd jax]                   # the same on a CPU, both PD roles on it (about a minute)

1. Calibrate: time every step shape the engine compiles (ModelRunner, the warm-up's inputs) plus decode-only steps
   at other slot counts (--calib-slots), and fit the efficiency profile's factors (GEMM, routed experts, attention
   compute and memory, per-layer and per-step overhead) to them: least squares on log time.
2. Serve the benchmark's workload (hcfjax.sim.workload, same seed; at each of --rates in turn, the same requests
   with their arrivals scaled) through the engine in-process, with hcfjax/bench/serve.py's engine settings, timing
   tokens as a client receives them; the host's planning and read-back time per step are measured on the way.
3. Simulate the same workload with the calibrated profile (engine_shapes: the runner's padded shapes).
4. With --pd KIND (sim_validate_pd.py): the PD workers of `hcfjax.bench.serve --pd KIND`, the prefill worker
   started first (it compiles while steps 1-2 run). After step 2 the prefill worker's batch shapes are timed in this
   process and fitted to a prefill profile, the decode-only steps of step 1 to a decode profile, and the KV link is
   timed; then the decode worker and the router start, a few lone requests time the handoff beyond prefill and
   link (gRPC hops, threads), the workload goes through the router as the benchmark's client sends it, and a 1P1D
   deployment with those profiles (the simulator's PD path) simulates it.
5. Print measured against predicted throughput, TTFT p50 and TPOT p50 (the issue's bar: within 15%), the table last;
   --out appends it to a file.

On a GPU, --pd needs --pd-gpus P,D: the simulator's PD model has prefill and decode on separate devices. This
process then sees only GPU D (with half its memory; the decode worker gets 40%). Every process shares one persistent
compilation cache (--compile-cache), so a shape compiled by one is loaded by the others, and by the next run.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from hcfjax import trace
from hcfjax.bench.sim_profile import fit, fitted, metrics, predicted, write_profile
from hcfjax.sim.cost import CostModel
from hcfjax.sim.gpus import Efficiency, gpu
from hcfjax.sim.work import EngineShapes


def _time_shape(runner, shape: tuple[int, int] | None, reps: int, rows: int | None = None) -> float:
    """Median seconds of one runner step of this prefill shape (None: decode alone) and `rows` decode rows per rank
    (default: every slot), on inputs that write nothing; the decode part as the workload's requests run it (greedy:
    without the sampling filters, where the runner has such a step)."""
    import jax

    pre = None if shape is None else runner.idle_prefill(shape)
    dec = runner.idle_decode(rows, filters=min(runner.decode_filters))
    times = []
    for i in range(reps + 1):
        t0 = time.perf_counter()
        jax.block_until_ready((runner._call(pre, dec), runner.state))
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def calibrate(engine, model, args, shapes: EngineShapes) -> list[tuple]:
    """Step times (shapes, prefill rows, chunk, decode rows per rank, seconds) of every shape the engine serves
    with: decode alone at each of its decode row counts, prefill with every slot decoding, and decode at other slot
    counts."""
    from hcfjax.engine.runner import ModelRunner
    from hcfjax.quantize import default_cache_dtype

    c, r = engine.config, engine.runner
    points = [(shapes, 0, 0, n, _time_shape(r, None, args.reps, n)) for n in r.decode_sizes]
    for b, t in shapes.step_shapes.all():
        points.append((shapes, b, t, r.slots_per_rank, _time_shape(r, (b, t), args.reps)))
    for slots in args.calib_slots:
        pages = max(r.max_pages, slots * r.max_pages // 2)
        runner = ModelRunner(model, slots, pages, c.page_size, r.max_pages, default_cache_dtype(model, None))
        other = dataclasses.replace(shapes, slots=slots)
        points.append((other, 0, 0, slots, _time_shape(runner, None, args.reps)))
        del runner
    return points


def serve(engine, batches) -> tuple[list[dict], dict]:
    """Each workload of `batches` ((ins, outs, prompts, arrivals), one per rate) through the engine (started here,
    shut down after), one after another once the previous has drained, timed as bench/serve.py's client times it;
    -> each batch's metrics, and the host's per-step planning/launch and read-back seconds over all of them."""
    import jax

    host = {"dispatch": [], "process": []}
    sched_fn, dispatch_fn, process_fn = engine.scheduler.schedule, engine.runner.dispatch, engine._process
    plan_t = [0.0]

    def schedule(now):
        t0 = time.perf_counter()
        out = sched_fn(now)
        plan_t[0] = time.perf_counter() - t0
        return out

    def dispatch(*a):
        t0 = time.perf_counter()
        out = dispatch_fn(*a)
        host["dispatch"].append(plan_t[0] + time.perf_counter() - t0)
        return out

    def process(d):
        jax.block_until_ready((d.first, d.nxt))  # the wait, apart from the host work that follows it
        t0 = time.perf_counter()
        process_fn(d)
        host["process"].append(time.perf_counter() - t0)

    engine.scheduler.schedule, engine.runner.dispatch, engine._process = schedule, dispatch, process
    engine.start()
    try:
        measured = [_serve_batch(engine, *batch) for batch in batches]
    finally:
        engine.shutdown()
    return measured, {k: statistics.median(v) if v else 0.0 for k, v in host.items()}


def _serve_batch(engine, ins, outs, prompts, arrivals) -> dict:
    """One workload through the running engine, a client thread per request; -> its metrics."""
    record: list[dict] = []

    def consume(req, t_arrival):
        t_first = t_last = None
        n = 0
        for out in engine.stream(req, timeout=600):
            now = time.perf_counter()
            if out.token_ids:
                t_first = t_first or now
                t_last, n = now, n + len(out.token_ids)
        record.append(
            {
                "ttft": t_first - t_arrival,
                "tpot": (t_last - t_first) / (n - 1) if n > 1 else None,
                "out": n,
                "end": time.perf_counter(),
            }
        )

    threads = []
    start = time.perf_counter()
    for i in range(len(ins)):
        delay = start + arrivals[i] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        req = engine.submit(prompts[i].tolist(), max_new_tokens=int(outs[i]), stop_token_ids=[], seed=i)
        th = threading.Thread(target=consume, args=(req, start + arrivals[i]))
        th.start()
        threads.append(th)
    for th in threads:
        th.join()
    return metrics(record, max(r["end"] for r in record) - start)


def add_settings(ap: argparse.ArgumentParser) -> None:
    """The workload's and the engine's settings, which sim_resimulate takes too to rebuild a run's simulation."""
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--scale", type=float, default=0.125)
    ap.add_argument("--max-slots", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--token-budget", type=int, default=256)
    ap.add_argument("--mixed-token-budget", type=int, help="tokens in a step that also decodes (default: the budget)")
    ap.add_argument("--prefill-rows", type=int, default=2)
    ap.add_argument("--min-bucket", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpu", default="H200", help="datasheet the efficiencies are relative to")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m hcfjax.bench.sim_validate", description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="checkpoint directory (default: --preset)")
    ap.add_argument("--preset", default="v2-lite", help="a random model of this preset when --model is not given")
    add_settings(ap)
    ap.set_defaults(scheme=None)  # the unquantised model, as the simulator's deployment has it (quant=None)
    ap.add_argument(
        "--rates",
        type=lambda s: [float(x) for x in s.split(",") if x],
        help="colocated: serve and simulate at each of these Poisson rates in turn, one calibration (default: --rate)",
    )
    ap.add_argument(
        "--calib-slots",
        type=lambda s: [int(x) for x in s.split(",") if x],
        default=[8],
        help="also time decode-only steps of engines with these slot counts (their rows idle: they read no cache, "
        "while the cost model charges each row its page table, so slot counts far beyond the served engine's skew "
        "the fitted attention factors)",
    )
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--pd", choices=["socket", "jax"], help="also validate PD over this KV transport")
    ap.add_argument("--pd-gpus", metavar="P,D", help="with --pd: the prefill worker on GPU P, the decode worker on D")
    ap.add_argument(
        "--profile",
        default="sim-profile.json",
        help="where to write the fitted colocated profile (PD: also NAME-prefill.json and NAME-decode.json)",
    )
    ap.add_argument("--out", help="append the report (the tables) to this file")
    ap.add_argument(
        "--compile-cache",
        default=os.path.join(tempfile.gettempdir(), "hcfjax-jax-cache"),
        help="persistent compilation cache shared with the PD workers ('' for none)",
    )
    return ap


def _compile_cache(path: str) -> dict:
    """Points this process at the persistent compilation cache; -> the same settings for the workers' environment.
    A size limit turns on jax's file lock around reads and writes (else one process may read an entry another is
    still writing); only compiles of a second or more are kept (jax's default)."""
    if not path:
        return {}
    import jax

    settings = {"jax_compilation_cache_dir": path, "jax_compilation_cache_max_size": 32 << 30}
    for name, value in settings.items():
        jax.config.update(name, value)
    return {name.upper(): str(value) for name, value in settings.items()}


def main(argv=None) -> None:
    from hcfjax.bench.serve import shown_args
    from hcfjax.bench.serve_pd import pd_configs, pd_gpus

    args = _parser().parse_args(argv)
    if args.rates and args.pd:
        raise SystemExit("--rates is for the colocated validation; with --pd give one --rate")
    args.rates = args.rates or [args.rate]
    if args.model:
        args.preset = None  # the PD workers load what this process does
    gpus = pd_gpus(args.pd_gpus) if args.pd else None
    if gpus:  # before jax starts: this process on the decode worker's GPU only
        if gpus[0] == gpus[1]:
            raise SystemExit("--pd-gpus: the prefill and decode workers need a GPU each (the simulator's 1P1D model)")
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus[1]
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.5")
    worker_env = _compile_cache(args.compile_cache)
    import jax

    if args.pd and not gpus and jax.default_backend() != "cpu":
        raise SystemExit("on a GPU, --pd needs --pd-gpus P,D (the simulator models prefill and decode on GPUs apart)")
    t_start = time.perf_counter()
    stage = lambda msg: print(f"[validate {time.perf_counter() - t_start:5.0f} s] {msg}", flush=True)
    workers = None
    if args.pd:
        from hcfjax.bench.sim_validate_pd import Workers

        # every process marks where each request's time goes (hcfjax.trace): the PD breakdown table
        # (this process's client marks too; the workers' CLI reads the directory from their environment)
        os.environ.setdefault(trace.DIR_VARIABLE, tempfile.mkdtemp(prefix="hcfjax-trace-"))
        trace.enable(os.environ[trace.DIR_VARIABLE])
        stage(f"starting the PD prefill worker{f' on GPU {gpus[0]}' if gpus else ''} (it compiles its batch shapes)")
        workers = Workers(args, pd_configs(args), gpus, worker_env)
    try:
        lines = run(args, stage, workers, gpus)
    finally:
        if workers is not None:
            workers.stop()
    heading = f"## `python -m hcfjax.bench.sim_validate {shown_args(argv)}`"
    stage("done")
    text = "\n".join([heading, "", lines[0] + f" Total {time.perf_counter() - t_start:.0f} s.", *lines[1:]])
    print("\n" + text, flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            f.write(text + "\n\n")


def _rates(rates: list[float]) -> str:
    return ", ".join(f"{r:g}" for r in rates)


def run(args, stage, workers, gpus) -> list[str]:
    """Steps 1-4; -> the report's lines (its first: the run's description, without the total time)."""
    import jax
    import jax.numpy as jnp

    import hcfjax
    from hcfjax.bench.common import header
    from hcfjax.bench.serve import engine_config
    from hcfjax.engine import Engine
    from hcfjax.random_model import preset_config, random_model
    from hcfjax.sim.deployment import Deployment, Pool
    from hcfjax.sim.simulator import simulate
    from hcfjax.sim.workload import Workload, workload

    stage(f"building the model ({args.model or 'random ' + args.preset}) on {jax.devices()[0].device_kind}")
    if args.model:
        model, model_name = hcfjax.load(args.model), args.model
    else:
        model, model_name = random_model(preset_config(args.preset), seed=0, dtype=jnp.bfloat16), args.preset
    cfg = model.cfg
    config = engine_config(args)
    engine = Engine(model, config)
    stage("compiling the colocated engine's step shapes")
    warm = engine.warmup()
    pool = Pool(
        dp=1,
        max_slots=args.max_slots,
        page_size=args.page_size,
        token_budget=args.token_budget,
        mixed_token_budget=args.mixed_token_budget,
        max_prefill_rows=args.prefill_rows,
        min_bucket=args.min_bucket,
        balance=config.balance,
        spf_window_s=config.spf_window_s,
        max_wait_s=config.max_wait_s,
        min_decode_rows=config.min_decode_rows,
    )
    dep = Deployment(
        model=model_name,
        gpu=args.gpu,
        quant=None,
        mode="colocated",
        colocated=pool,
        engine_shapes=True,
        max_model_len=args.max_model_len,
    )
    shapes = dep.engine_shapes_for(pool, cfg)
    sim_cfg = dep.scheduler_config(pool, "colocated", dep.engine_limits(pool, cfg)[2], shapes.step_shapes)
    if sim_cfg != engine.scheduler.cfg:
        raise SystemExit(
            f"the simulator's SchedulerConfig differs from the engine's:\n{sim_cfg}\n{engine.scheduler.cfg}"
        )
    limit = engine.max_model_len
    batches = [workload(args.seed, args.requests, rate, args.scale, limit, cfg.vocab_size) for rate in args.rates]
    loads = [Workload(args.requests, rate, args.seed, args.scale, limit, cfg.vocab_size) for rate in args.rates]
    if workers is not None:
        stage("waiting for the prefill worker to listen")
        workers.prefill_ready()

    stage("calibrating: timing the colocated engine's step shapes")
    t0 = time.perf_counter()
    points = calibrate(engine, model, args, shapes)
    t_cal = time.perf_counter() - t0
    stage(f"serving {args.requests} requests colocated (in process) at {_rates(args.rates)} req/s")
    measured, host = serve(engine, batches)
    del engine
    gc.collect()
    stage("fitting and simulating colocated")
    base = Efficiency(gemm_memory=0.86, moe_memory=0.86)
    eff = fit(cfg, args.gpu, [(shp.shape_works(b, t, d), s) for shp, b, t, d, s in points], base)
    eff = eff.replace(host_dispatch_s=host["dispatch"], host_process_s=host["process"])
    write_profile(args.profile, eff)
    cm = CostModel(cfg, gpu(args.gpu), eff)
    sim_dep = dep.replace(efficiency=args.profile)
    rows = [
        ("colocated", rate, m, predicted(simulate(sim_dep, wl)))
        for rate, m, wl in zip(args.rates, measured, loads, strict=True)
    ]
    what = f"{args.max_slots} slots, page {args.page_size}, budget {args.token_budget}"
    what += f", {args.prefill_rows} prefill rows"
    desc = (
        f"{header()}; {model_name}; {args.requests} requests, Poisson {_rates(args.rates)}/s, lengths x {args.scale}; "
        f"engine: {what}. Colocated: in process, warm-up {warm:.0f} s, calibration {t_cal:.0f} s "
        f"({len(points)} step shapes)."
    )
    tables = [
        "Colocated calibration (step shapes: prefill rows x chunk, decode rows per rank; measured vs the fitted model):"
    ]
    tables += ["", "| rows x chunk | decode rows | measured ms | model ms |", "|---|---|---|---|"]
    for shp, b, t, d, s in points:
        m = cm.step(shp.shape_works(b, t, d)).seconds
        tables.append(f"| {f'{b} x {t}' if b else '-'} | {d or '-'} | {s * 1e3:.2f} | {m * 1e3:.2f} |")
    tables += ["", f"Fitted colocated profile ({args.profile}): {fitted(eff)}."]

    if workers is not None:
        from hcfjax.bench.sim_validate_pd import run_pd

        row, more, pd_tables = run_pd(args, stage, workers, gpus, model, model_name, batches[0], loads[0], points, host)
        rows.append((row[0], args.rates[0], *row[1:]))  # (--pd takes one rate)
        desc += more
        tables += pd_tables

    table = ["| deployment | rate (req/s) | metric | measured | predicted | error |", "|---|---|---|---|---|---|"]
    fmt = lambda k, v: f"{v:.3f}" if "TTFT" in k else f"{v:.1f}"
    for mode, rate, meas, pred in rows:
        for k in meas:
            err = (pred[k] - meas[k]) / meas[k] * 100 if meas[k] else float("nan")
            table.append(f"| {mode} | {rate:g} | {k} | {fmt(k, meas[k])} | {fmt(k, pred[k])} | {err:+.1f}% |")
    return [desc, "", *tables, "", *table]


if __name__ == "__main__":
    main()
