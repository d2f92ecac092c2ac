"""Serving benchmark: Poisson arrivals over gRPC against a server on loopback.

    python -m hcfjax.bench.serve [--model PATH | --preset v2-lite] [--requests 64] [--rate 2.0] [--scale 0.125]
        [--max-slots 32] [--page-size 64] [--token-budget 2048] [--max-model-len 4096] [--speculative K]
        [--pd socket|jax [--pd-gpus P,D]] [--out FILE]

Lengths follow the reference's workload (hcfjax.sim.workload, which the simulator serves too: input mean 3.5k
tokens, max 16k; output mean 1.2k, max 32k), each drawn from a log-normal with that mean (sigma 0.8), clipped at the
max, and multiplied by --scale for small models.
Prompts are random token ids and outputs ignore eos, so every request produces its drawn length. Reports QPM,
output tokens/s, TTFT and TPOT percentiles, goodput under the SLO (TTFT < 2 s and TPOT < 50 ms), and the requests
that got no terminal response (must be 0). Engine.warmup() compiles every step shape first, so compiles stay out.

--pd runs the same workload against prefill/decode disaggregation (hcfjax/pd/): a prefill worker, a decode worker
and the router as three processes (on one GPU they share it, each worker with 45% of its memory; --pd-gpus 0,1 gives
each worker a GPU of its own), the KV cache moved over the given transport; a few warm-up prompts of each length
bucket go through first.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from hcfjax import trace
from hcfjax.bench.common import header
from hcfjax.sim.workload import SLO_TPOT_S, SLO_TTFT_S, workload


def run_one(stub, prompt, max_new, t_arrival, record, request_id: str = ""):
    from hcfjax.serving import hcfjax_pb2 as pb
    from hcfjax.serving.client import generate_stream

    t_first = t_last = None
    n, finish = 0, None
    trace.mark("send", request_id)
    try:
        stream = generate_stream(
            stub, prompt, max_new_tokens=int(max_new), ignore_eos=True, timeout=600, request_id=request_id
        )
        for chunk in stream:
            now = time.perf_counter()
            if chunk.token_ids:
                if t_first is None:
                    trace.mark("client_first", request_id)
                t_first = t_first or now
                t_last, n = now, n + len(chunk.token_ids)
            if chunk.finish_reason:
                finish = pb.FinishReason.Name(chunk.finish_reason).removeprefix("FINISH_REASON_").lower()
    except Exception as e:  # noqa: BLE001 - counted, reported
        finish = f"error: {e.code().name if hasattr(e, 'code') else type(e).__name__}"
    record.append(
        {
            "ttft": None if t_first is None else t_first - t_arrival,
            "tpot": (t_last - t_first) / (n - 1) if n > 1 else None,
            "out": n,
            "finish": finish,
            "end": time.perf_counter(),
        }
    )


def warm_pd(stub, ins, limit: int, rows: int) -> float:
    """A PD deployment's first requests of each prompt-length bucket, `rows` at a time, before timing (the prefill
    worker compiled its shapes at start; this warms the rest of the path). -> seconds."""
    from hcfjax.serving.client import generate

    t0 = time.perf_counter()
    for k in sorted({min(1 << i, limit // 2) for i in range(4, int(ins.max()).bit_length() + 1)}):
        with ThreadPoolExecutor(rows) as pool:  # batches of every row count, too
            list(pool.map(lambda _, k=k: generate(stub, [1] * k, max_new_tokens=2, ignore_eos=True), range(2)))
    return time.perf_counter() - t0


def run_clients(stub, prompts, outs, arrivals, tag: str = "bench-") -> tuple[list[dict], float]:
    """The workload's requests at their arrival times, one client thread each, with request ids tag0, tag1, ...;
    -> (a record per request, seconds from the first arrival to the last response)."""
    n = len(prompts)
    record: list[dict] = []
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=n) as pool:
        for i in range(n):
            delay = start + arrivals[i] - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            pool.submit(run_one, stub, prompts[i].tolist(), outs[i], start + arrivals[i], record, f"{tag}{i}")
    return record, max(r["end"] for r in record) - start


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

    return EngineConfig(
        max_slots=args.max_slots,
        page_size=args.page_size,
        token_budget=args.token_budget,
        max_model_len=args.max_model_len,
        max_prefill_rows=args.prefill_rows,
        min_prefill_bucket=args.min_bucket,
        max_queue=args.requests + 8,
        speculative=speculative,
    )


def pd_configs(args):
    """(the prefill worker's PrefillConfig, the decode worker's EngineConfig) for the benchmark's settings: the
    prefill worker takes prompts whole, up to 4096 tokens a batch; the decode worker is the colocated engine but for
    the prefill chunk settings, which it does not use."""
    from hcfjax.engine import EngineConfig
    from hcfjax.pd.prefill import PrefillConfig

    prefill = PrefillConfig(
        page_size=args.page_size,
        max_rows=args.prefill_rows,
        token_budget=max(args.token_budget, 4096),
        min_bucket=args.min_bucket,
        transfer_timeout_s=60.0,  # the decode worker's (hcfjax serve's default --transfer-timeout)
    )
    decode = EngineConfig(
        max_slots=args.max_slots,
        page_size=args.page_size,
        token_budget=args.token_budget,
        max_model_len=args.max_model_len,
        max_queue=args.requests + 8,
    )
    return prefill, decode


def pd_role_args(args, prefill, decode) -> tuple[list[str], list[str]]:
    """The `hcfjax serve` arguments of the prefill and decode workers that run with these configs (pd_configs)."""
    import hcfjax
    from hcfjax.serving.config import engine_flags, prefill_flags

    model = f"preset:{args.preset}" if args.preset else (args.model or str(hcfjax.DEFAULT_MODEL))
    common = ["--model", model, "--transport", args.pd, "--port", "0"]
    # the prefill worker compiles its shapes up to the decode worker's context length
    pre = ["--role", "prefill", *common, "--max-model-len", str(decode.max_model_len), *prefill_flags(prefill)]
    return pre, ["--role", "decode", *common, *engine_flags(decode)]


def pd_gpus(spec: str | None) -> tuple[str, str] | None:
    """--pd-gpus 'P,D': the GPU of the prefill worker and of the decode worker."""
    if not spec:
        return None
    gpus = [g.strip() for g in spec.split(",")]
    if len(gpus) != 2 or not all(g.isdigit() for g in gpus):
        raise SystemExit(f"--pd-gpus takes two GPU indices, prefill's and decode's (e.g. 0,1), got {spec!r}")
    return gpus[0], gpus[1]


def role_env(gpu: str | None = None, mem_fraction: float | None = None, **extra) -> dict:
    """A worker process's environment: on `gpu` only (CUDA_VISIBLE_DEVICES) with `mem_fraction` of its memory."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **extra}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    if mem_fraction is not None:
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(mem_fraction)
    return env


def launch_role(role_args: list[str], env: dict, procs: list) -> str:
    """Starts `hcfjax serve ROLE_ARGS` (appended to procs), echoes its output, and returns the address it
    listens on once it says so."""
    import re
    import subprocess

    cmd = [sys.executable, "-m", "hcfjax.cli", "serve", *role_args]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    procs.append(p)
    for line in p.stdout:
        print("  |", line.rstrip(), flush=True)
        m = re.search(r"listening on (\S+)", line)
        if m:
            threading.Thread(target=lambda: [print("  |", x.rstrip()) for x in p.stdout], daemon=True).start()
            return m.group(1)
    stop_pd(procs)
    raise SystemExit(f"{role_args[:2]} exited before listening")


def launch_router(prefill: str, decode: str, procs: list) -> int:
    router = launch_role(
        ["--role", "router", "--prefill", prefill, "--decode", decode, "--port", "0"],
        role_env(JAX_PLATFORMS="cpu"),
        procs,
    )
    return int(router.rsplit(":", 1)[1])


def start_pd(args) -> tuple[list, int, float]:
    """The three PD processes (`hcfjax serve --role ...`), the workers warmed up; -> (processes, the router's port,
    seconds to start). With --pd-gpus each worker sees only its GPU; without, both share the default device,
    each with 45% of its memory."""
    t0 = time.perf_counter()
    gpus = pd_gpus(args.pd_gpus)
    shared = gpus is None or gpus[0] == gpus[1]
    fraction = 0.45 if shared else None
    pre_args, dec_args = pd_role_args(args, *pd_configs(args))
    procs: list = []
    pre = launch_role(pre_args, role_env(gpus and gpus[0], fraction), procs)
    dec = launch_role(dec_args, role_env(gpus and gpus[1], fraction), procs)
    return procs, launch_router(pre, dec, procs), time.perf_counter() - t0


def stop_pd(procs) -> None:
    import signal

    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(20)
        except Exception:  # noqa: BLE001 - a stuck worker is killed
            p.kill()


def pct(xs, q):
    xs = [x for x in xs if x is not None]
    return float(np.percentile(xs, q)) if xs else float("nan")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m hcfjax.bench.serve", description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--preset", help="a random model of this preset (hcfjax.random_model.PRESETS) instead of --model")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rate", type=float, default=2.0, help="mean arrivals per second (Poisson)")
    ap.add_argument("--scale", type=float, default=0.125, help="multiplies the reference's lengths")
    ap.add_argument("--max-slots", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--token-budget", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--prefill-rows", type=int, default=4)
    ap.add_argument("--min-bucket", type=int, default=16, help="smallest prefill chunk shape (fewer compiles)")
    ap.add_argument("--speculative", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--pd",
        choices=["socket", "jax"],
        help="prefill/decode disaggregated instead of colocated: a prefill worker, a decode worker and the router as "
        "three processes on this machine (sharing one GPU, memory split, unless --pd-gpus), the KV cache over this "
        "transport",
    )
    ap.add_argument("--pd-gpus", metavar="P,D", help="with --pd: the prefill worker on GPU P, the decode worker on D")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if trace_dir := os.environ.get(trace.DIR_VARIABLE):  # the client's marks (hcfjax.trace); PD workers inherit it
        trace.enable(trace_dir)

    import jax.numpy as jnp

    import hcfjax
    from hcfjax.engine import Engine
    from hcfjax.random_model import preset_config, random_model
    from hcfjax.serving.client import connect, generate
    from hcfjax.serving.server import Server

    if args.pd:
        from hcfjax.config import ModelConfig

        path = Path(args.model or hcfjax.DEFAULT_MODEL)
        cfg = preset_config(args.preset) if args.preset else ModelConfig.from_json(path / "config.json")
        procs, port, warm = start_pd(args)
        engine = None
        limit = min(cfg.max_position_embeddings, args.max_model_len)
    else:
        model = random_model(preset_config(args.preset), seed=0, dtype=jnp.bfloat16) if args.preset else None
        model = model or hcfjax.load(args.model)
        cfg = model.cfg
        spec = hcfjax.SpeculativeConfig(args.speculative) if args.speculative else None
        engine = Engine(model, engine_config(args, spec))
        warm = engine.warmup()
        server = Server(engine).start()
        port = server.port
        limit = engine.max_model_len
    channel, stub = connect("127.0.0.1", port, ready_timeout=30)

    n = args.requests
    ins, outs, prompts, arrivals = workload(args.seed, n, args.rate, args.scale, limit, cfg.vocab_size)

    generate(stub, [1, 2, 3], max_new_tokens=4, ignore_eos=True)  # the server answers
    if args.pd:
        warm += warm_pd(stub, ins, limit, args.prefill_rows)
    compiles_warm = engine.snapshot()["compiles"] if engine else 0

    record, wall = run_clients(stub, prompts, outs, arrivals)
    channel.close()
    if engine is not None:
        snap = engine.snapshot()
        server.shutdown()
    else:
        snap = {"compiles": "n/a", "preemptions": "n/a"}
        stop_pd(procs)

    ok = [r for r in record if r["finish"] == "length"]
    lost = n - len(record) + sum(r["finish"] is None for r in record)
    good = [r for r in ok if r["ttft"] is not None and r["ttft"] < SLO_TTFT_S and (r["tpot"] or 0) < SLO_TPOT_S]
    out_tokens = sum(r["out"] for r in record)
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok]
    what = (
        f"preset {args.preset} (random weights)"
        if args.preset
        else f"model {Path(args.model or hcfjax.DEFAULT_MODEL).name}"
    )
    lines = [
        f"## `python -m hcfjax.bench.serve {shown_args(argv)}`",
        "",
        f"{header()}; {what}; {n} requests, Poisson {args.rate}/s; lengths = reference x {args.scale} "
        f"(input mean {ins.mean():.0f}, max {ins.max()}; output mean {outs.mean():.0f}, max {outs.max()}); "
        f"engine: {args.max_slots} slots, page {args.page_size}, token budget {args.token_budget}"
        + (f", speculative k={args.speculative}" if args.speculative else "")
        + (f"; PD: prefill, decode and router processes, KV over {args.pd}" if args.pd else "; colocated")
        + (" (prefill on GPU {}, decode on GPU {})".format(*pd_gpus(args.pd_gpus)) if args.pd and args.pd_gpus else "")
        + f". Warm-up {warm:.0f} s ({compiles_warm} compiles); compiles during the run: "
        + (f"{snap['compiles'] - compiles_warm}" if engine else "n/a")
        + f"; preemptions {snap['preemptions']}.",
        "",
        "| QPM | output tok/s | TTFT p50 / p90 / p99 (s) | TPOT p50 / p90 / p99 (ms) | goodput (TTFT<2s, TPOT<50ms) "
        "| finished / errors / lost |",
        "|---|---|---|---|---|---|",
        f"| {len(ok) / wall * 60:.1f} | {out_tokens / wall:,.0f} | "
        f"{pct(ttft, 50):.2f} / {pct(ttft, 90):.2f} / {pct(ttft, 99):.2f} | "
        f"{pct(tpot, 50) * 1e3:.1f} / {pct(tpot, 90) * 1e3:.1f} / {pct(tpot, 99) * 1e3:.1f} | "
        f"{len(good)}/{n} ({len(good) / wall * 60:.1f} per min) | "
        f"{len(ok)} / {len(record) - len(ok) - lost} / {lost} |",
    ]
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            f.write(table + "\n\n")
    if lost:
        raise SystemExit(f"{lost} requests got no terminal response")


if __name__ == "__main__":
    threading.excepthook = lambda a: print("thread error:", a.exc_value)
    main()
