"""`hcfjax sim --config deployment.yaml`: simulate a deployment at the config's rate, or search the highest rate
within the SLO (--search), or sweep layouts and batch limits (--sweep: the config's grid, then finer steps around
its best where the config names them under `refine`); --plot draws throughput against TPOT."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from hcfjax.argtypes import within


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", required=True, help="a YAML file (see hcfjax/sim/configs/)")
    ap.add_argument("--requests", type=within(int, 1), help="override the workload's request count")
    ap.add_argument("--rate", type=within(float, above=0), help="override the workload's arrival rate (per second)")
    ap.add_argument(
        "--attainment", type=within(float, hi=1, above=0), help="override the share of requests that must meet the SLO"
    )
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--search", action="store_true", help="find the highest rate that meets the SLO")
    mode.add_argument("--sweep", action="store_true", help="search every layout of the config's sweep grid")
    ap.add_argument("--plot", help="write output tokens/s vs TPOT to this PNG (with --search or --sweep)")
    ap.add_argument("--out", help="append the printed tables to this file")


def _parts(res) -> list[str]:
    lines = []
    for pool, parts in res.parts.items():
        total = sum(parts.values()) or 1.0
        top = sorted(parts.items(), key=lambda kv: -kv[1])[:5]
        lines.append(f"- {pool} step time: " + ", ".join(f"{k} {v / total:.0%}" for k, v in top))
    util = ", ".join(f"{k} {v:.0%}" for k, v in res.utilisation.items())
    lines.append(f"- device busy: {util}; preemptions {res.preemptions}; finished {res.finished}/{res.requests}")
    return lines


def bound_note(hi: float) -> str:
    """What a best rate at the search's top means: the search stopped there, not at the SLO."""
    return (
        f"The search's upper bound ({hi:.2f} requests/s, the config's search.hi) met the SLO: the deployment may "
        "sustain more; raise search.hi to find its limit."
    )


def run(args) -> int:
    from hcfjax.sim.config import load_config
    from hcfjax.sim.simulator import Result, simulate
    from hcfjax.sim.sweep import Candidate, max_rate, plot, sweep

    try:
        cfg = load_config(args.config)
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    wl = cfg.workload
    if args.requests:
        wl = wl.replace(requests=args.requests)
    if args.rate:
        wl = wl.replace(rate=args.rate)
    if args.attainment is not None:
        cfg = dataclasses.replace(cfg, slo=dataclasses.replace(cfg.slo, attainment=args.attainment))
    dep = cfg.deployment
    head = (
        f"## `hcfjax sim --config {args.config}`{' --search' if args.search else ''}{' --sweep' if args.sweep else ''}"
        f"\n\n{cfg.name}: {dep.model} {dep.quant or 'bf16'} on {dep.gpus} x {dep.gpu} ({dep.mode}), efficiency "
        f"{dep.efficiency}, MTP acceptance {list(dep.acceptance) or 'off'}; {wl.requests} requests; SLO TTFT < "
        f"{cfg.slo.ttft_s} s and TPOT < {cfg.slo.tpot_s * 1e3:.0f} ms for {cfg.slo.attainment:.0%} of requests."
    )
    lines = [head, ""]
    curves: list = []
    try:
        if args.sweep:
            if not cfg.grid:
                print("error: the config has no sweep grid", file=sys.stderr)
                return 2
            log = lambda s: print(s, file=sys.stderr)
            curves = sweep(dep, wl, cfg.slo, cfg.grid, cfg.total_gpus, cfg.search, log, cfg.refine)
            lines += [
                "| layout | GPUs | rate (/s) | output tok/s | per GPU | TTFT p50 (s) | TPOT p50 (ms) |",
                "|---|---|---|---|---|---|---|",
            ]
            at_bound = [c for c in curves if c.best and c.best.rate >= cfg.search.hi]
            for c in curves:
                r = c.best.result if c.best else None
                mark = " *" if c in at_bound else ""
                lines.append(
                    f"| {c.label} | {c.dep.gpus} | {c.best.rate if c.best else 0:.2f}{mark} | {c.tok_s:,.0f} | "
                    f"{c.tok_s / c.dep.gpus:,.0f} | {r.ttft[50] if r else float('nan'):.2f} | "
                    f"{r.tpot[50] * 1e3 if r else float('nan'):.1f} |"
                )
            if at_bound:
                lines += ["", f"* {bound_note(cfg.search.hi)}"]
        elif args.search:
            best, points = max_rate(dep, wl, cfg.slo, cfg.search)
            curves = [Candidate(cfg.name, dep, best, points)]
            cols = Result.HEADER.split("\n")[0].strip("|")
            lines.append(f"| rate (/s) | meets SLO |{cols}|\n|---|---|---|---|---|---|---|---|---|")
            for p in sorted(points, key=lambda p: p.rate):
                lines.append(f"| {p.rate:.2f} | {'yes' if p.result.meets_slo else 'no'} " + p.result.row())
            if best is None:
                lines += ["", "No evaluated rate meets the SLO."]
            else:
                lines += ["", f"Best within the SLO: {best.rate:.2f} requests/s:", ""]
                if best.rate >= cfg.search.hi:
                    lines += [bound_note(cfg.search.hi), ""]
                lines += _parts(best.result)
        else:
            res = simulate(dep, wl, cfg.slo)
            lines += [Result.HEADER, res.row(), ""] + _parts(res)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n\n")
    if args.plot and curves:
        plot(curves, args.plot, f"{cfg.name}: {dep.gpus} x {dep.gpu}")
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="hcfjax sim", description=__doc__.split("\n")[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
