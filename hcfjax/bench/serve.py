"""Serving benchmark: Poisson arrivals over gRPC against a server on loopback.

    python -m hcfjax.bench.serve [--model PATH | --preset v2-lite] [--requests 64] [--rate 2.0] [--scale 0.125]
        [--max-slots 32] [--page-size 64] [--token-budget 2048] [--max-model-len 4096] [--speculative K]
        [--out FILE]

Lengths follow the reference's workload (input mean 3.5k tokens, max 16k; output mean 1.2k, max 32k), each drawn
from a log-normal with that mean (sigma 0.8), clipped at the max, and multiplied by --scale for small models.
Prompts are random token ids and outputs ignore eos, so every request produces its drawn length. Reports QPM,
output tokens/s, TTFT and TPOT percentiles, goodput under the SLO (TTFT < 2 s and TPOT < 50 ms), and the requests
that got no terminal response (must be 0). Engine.warmup() compiles every step shape first, so compiles stay out.
"""

from __future__ import annotations

import argparse
import math
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from hcfjax.bench.common import header

REFERENCE = {"input_mean": 3500, "input_max": 16384, "output_mean": 1200, "output_max": 32768}
SLO_TTFT_S, SLO_TPOT_S = 2.0, 0.050


def draw_lengths(rng, n: int, mean: float, cap: int, scale: float, lo: int = 1) -> np.ndarray:
    sigma = 0.8
    mu = math.log(mean) - sigma**2 / 2  # the log-normal's mean is exp(mu + sigma^2 / 2)
    x = np.minimum(rng.lognormal(mu, sigma, n), cap) * scale
    return np.maximum(np.round(x), lo).astype(int)


def workload(seed: int, n: int, rate: float, scale: float, limit: int, vocab: int | None):
    """The benchmark's requests for a seed: (input lengths, output lengths, prompts, arrival times in s).

    Lengths follow REFERENCE scaled by `scale`, inputs clipped at limit // 2 and outputs to fit the context. With
    vocab None the prompts are not drawn (None), which changes the arrival times; the simulator passes the model's
    vocabulary to get exactly this benchmark's workload."""
    rng = np.random.default_rng(seed)
    ins = draw_lengths(rng, n, REFERENCE["input_mean"], REFERENCE["input_max"], scale)
    outs = draw_lengths(rng, n, REFERENCE["output_mean"], REFERENCE["output_max"], scale)
    ins = np.minimum(ins, limit // 2)
    outs = np.minimum(outs, limit - ins)
    prompts = None if vocab is None else [rng.integers(1, vocab, size=k) for k in ins]  # numpy arrays
    arrivals = np.cumsum(rng.exponential(1 / rate, n))
    return ins, outs, prompts, arrivals


def run_one(stub, prompt, max_new, t_arrival, record):
    from hcfjax.serving import hcfjax_pb2 as pb
    from hcfjax.serving.client import generate_stream

    t_first = t_last = None
    n, finish = 0, None
    try:
        for chunk in generate_stream(stub, prompt, max_new_tokens=int(max_new), ignore_eos=True, timeout=600):
            now = time.perf_counter()
            if chunk.token_ids:
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


def shown_args(argv) -> str:
    """The command line without --out (the heading names the command that made the table)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--out" in args:
        i = args.index("--out")
        del args[i : i + 2]
    return " ".join(a for a in args if not a.startswith("--out="))


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
    ap.add_argument("--out")
    args = ap.parse_args(argv)

    import jax.numpy as jnp

    import hcfjax
    from hcfjax.engine import Engine, EngineConfig
    from hcfjax.random_model import preset_config, random_model
    from hcfjax.serving.client import connect, generate
    from hcfjax.serving.server import Server

    model = random_model(preset_config(args.preset), seed=0, dtype=jnp.bfloat16) if args.preset else None
    model = model or hcfjax.load(args.model)
    spec = hcfjax.SpeculativeConfig(args.speculative) if args.speculative else None
    config = EngineConfig(
        max_slots=args.max_slots,
        page_size=args.page_size,
        token_budget=args.token_budget,
        max_model_len=args.max_model_len,
        max_prefill_rows=args.prefill_rows,
        min_prefill_bucket=args.min_bucket,
        max_queue=args.requests + 8,
        speculative=spec,
    )
    engine = Engine(model, config)
    warm = engine.warmup()
    server = Server(engine).start()
    channel, stub = connect("127.0.0.1", server.port, ready_timeout=30)

    n = args.requests
    ins, outs, prompts, arrivals = workload(
        args.seed, n, args.rate, args.scale, engine.max_model_len, model.cfg.vocab_size
    )

    generate(stub, [1, 2, 3], max_new_tokens=4, ignore_eos=True)  # the server answers
    compiles_warm = engine.snapshot()["compiles"]

    record: list[dict] = []
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=n) as pool:
        for i in range(n):
            delay = start + arrivals[i] - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            pool.submit(run_one, stub, prompts[i].tolist(), outs[i], start + arrivals[i], record)
    wall = max(r["end"] for r in record) - start
    snap = engine.snapshot()
    server.shutdown()
    channel.close()

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
        + (f", speculative k={args.speculative}" if spec else "")
        + f". Warm-up {warm:.0f} s ({compiles_warm} compiles); compiles during the run: "
        f"{snap['compiles'] - compiles_warm}; preemptions {snap['preemptions']}.",
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
