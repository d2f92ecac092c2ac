"""Int4 MoE grouped GEMM (pallas_kernels.moe_int4) on the GPU: correctness, then time against bf16 `ragged_dot` and
the int4 jnp reference, with the ceilings measured in the same run. One table at the end.

    python -m pallas_kernels.bench.moe [--cases default|all|ExMxKxN,...] [--time-limit 200] [--hard-limit SECONDS]
                                       [--stall 45] [--sweep [CASES]] [--sweep-only TEXT] [--rounds N] [--jnp-refs]
                                       [--no-ceilings] [--interpret] [--lower] [--out FILE]

Cases: DeepSeek-V3 expert shapes, gate/up (K = hidden 7168, N = expert width 2048) and down (K = 2048, N = 7168), for
E local experts in {16, 32} and M routed token copies in {128, 1024, 4096, 16384} (decode to prefill), spread
uniformly at random over the experts. "default": decode (E=16 M=128), prefill (E=32 M=4096), E=16 M=1024 and
E=32 M=16384 gate/up, in that order; "all": every combination, those four first.
Each case first checks every kernel row (w4a16, w4a8) against the exactly-quantised function computed in f32 (the
max error over the max of the reference, and the norm-wise relative error), then times every implementation. Kernel
rows: the default tiling (moe_int4_tiling.default_tiling) and with --sweep a few alternatives
(`moe_cases.sweep_tilings`).
`--lower` lowers every one of them for sm_90 on any host (Mosaic's checks without a GPU): run it before a GPU run.

Peers, when torch with CUDA is installed (pallas_kernels.bench.moe_peers): torch's `_grouped_mm` (bf16) and
`_scaled_grouped_mm` (fp8, row-wise scales) on the same tokens, weights and group sizes, checked and timed the same
way.

DeepSeek's fp8 layout runs too (pallas_kernels.moe_fp8: e4m3 weights with 128 x 128 block scales, tokens quantised
by the caller in 1 x 128 groups), checked against its exactly-quantised product; its bytes count e4m3 values and f32
block scales, its rate is against the int8 ceiling (Hopper's fp8 and int8 MMAs run at one rate).

Gate/up shapes also time the fused gate + up + SiLU kernel (int4_gated_ragged_dot; its bytes and FLOPs count both
weights) against two kernel calls and XLA's SiLU-and-multiply.

Per row: time (pipelined: `reps` calls back to back, then one wait, so dispatch overlaps execution; the kernel rows
include the wrapper's XLA work: the per-block table from group_sizes and, for w4a8, the activation quantisation; the
"wrapper's XLA passes only" rows time that work alone), weight bandwidth
(bytes of the weights of the experts with rows as stored, int4 + f32 scales or bf16, over the time: every expert's
unless M is small) and TFLOP/s (2 M K N over the time; TOP/s
for w4a8). Ceilings: torch `copy_` over 2 GiB counting read + write (XLA's own copy if torch is missing), XLA bf16
and int8 8192^3 matmuls. --rounds N times every row of a case N times, interleaved (all rows, then all again), and
keeps each row's best: the H200's times of one configuration varied by up to 1.5x between runs, and a slow spell then
hits every row of a round alike instead of whichever row it fell on.

Robustness: the cases run in a worker process that prints one JSON line per row; a row that raises reports its error
and the next runs; a CUDA error (which poisons the process's CUDA context) ends the worker, and a kernel row that hangs
(a deadlocked kernel) is killed after --stall seconds without progress (the worker dumps its Python stack first);
either way a fresh worker resumes the case without that row (at most twice per case; rows already reported are not
rerun) and later cases skip that kernel (a CUDA error: at that token block), and the gate/up rows that share its code.
No case starts after --time-limit seconds and nothing runs past --hard-limit (defaults: 200 s, and 35 s more than
the time limit: the whole run within 4 minutes).
Everything printed also goes to moe_bench.log (and the table to moe_bench.md) under $OUT when it is set.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import subprocess
import sys
import time

from pallas_kernels.bench.moe_cases import CHECK_TOL, HEADLINE, all_cases, lower_all

# The driver imports no jax: it only starts workers (moe_worker.py), enforces the time limits and prints the table.


class Log:
    def __init__(self):
        out = os.environ.get("OUT")
        self.dir = out if out and os.path.isdir(out) else None
        self.fh = open(os.path.join(self.dir, "moe_bench.log"), "a") if self.dir else None

    def __call__(self, *lines: str) -> None:
        for line in lines:
            print(line, flush=True)
            if self.fh:
                self.fh.write(line + "\n")
                self.fh.flush()


def _lines(fd: int, timeout: float, buf: bytearray) -> list[str] | None:
    """Complete lines from fd within timeout ([] if none yet), None at EOF. Reads the raw fd so that select() sees
    every byte (a buffered readline could hold a finished line back)."""
    ready, _, _ = select.select([fd], [], [], max(0.0, timeout))
    if ready:
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return None
        buf.extend(chunk)
    *done, rest = bytes(buf).split(b"\n")
    buf[:] = rest
    return [d.decode(errors="replace") for d in done]


def run_workers(specs: list[str], args, log: Log) -> dict[str, dict]:
    """Runs the specs in order in worker processes: {spec: {rows, ceilings, error, note}}. A worker that exits early
    or stays silent for --stall seconds (a hung kernel) is killed, as is one whose CUDA context a kernel broke; the
    row it was on is reported, and a new worker resumes the case without it (once or twice per case: the rows already
    reported are not rerun) or goes on with the next case. A kernel that hung or broke the context is skipped in the
    later cases too (each hang costs the stall time)."""
    results: dict[str, dict] = {s: dict(rows=[]) for s in specs}
    t_start = time.time()
    hard_stop = t_start + (args.hard_limit or args.time_limit + 35)
    pending, skip, done, retries = list(specs), {}, {}, {}

    def resume(spec: str) -> bool:  # whether a fresh worker should take this case up again
        if spec == "ceilings" or retries.get(spec, 0) >= 2 or time.time() >= hard_stop:
            return False
        retries[spec] = retries.get(spec, 0) + 1
        return True

    env = dict(os.environ, MOE_BENCH_STALL=str(args.stall))
    while pending:
        if time.time() - t_start > args.time_limit:
            for s in pending:
                results[s]["error"] = f"skipped: the run's time limit ({args.time_limit:.0f} s) was reached"
            break
        cmd = [
            sys.executable,
            "-m",
            "pallas_kernels.bench.moe",
            "--worker",
            ",".join(pending),
            "--skip",
            json.dumps(dict(skip, __done__=done)),
        ]
        cmd += ["--sweep", args.sweep] * bool(args.sweep) + ["--interpret"] * args.interpret
        cmd += ["--jnp-refs"] * args.jnp_refs
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        fd, buf, last, begun, why = proc.stdout.fileno(), bytearray(), time.time(), None, None
        log(f"[{time.time() - t_start:6.1f} s] worker {proc.pid} starts at {pending[0]}")
        while why is None:
            deadline = min(last + args.stall, hard_stop)
            lines = _lines(fd, min(1.0, deadline - time.time()), buf)
            if lines is None:
                why = "exit"
                break
            for line in lines:
                kind, _, payload = line.partition(" ")
                if kind not in ("BEGIN", "ROW", "CEIL", "DONE", "LOST"):
                    log("  | " + line)
                    continue
                ev, last = json.loads(payload), time.time()
                spec = ev["spec"]
                if kind == "BEGIN":
                    begun = (spec, ev["what"])
                elif kind == "ROW":  # a later round's report of a row replaces its earlier one
                    rows, row = results[spec]["rows"], ev["row"]
                    again = [i for i, r in enumerate(rows) if r["name"] == row["name"]]
                    if again:
                        rows[again[0]] = row
                    else:
                        rows.append(row)
                        done.setdefault(spec, []).append(row["name"])
                    log(f"  {spec}: {_row_summary(row)}" + (f" (round {row.get('rounds')})" if again else ""))
                elif kind == "CEIL":
                    results[spec]["ceilings"] = ev["ceilings"]
                elif kind == "LOST":  # a CUDA error: the worker exits
                    if ev.get("skip"):
                        skip[ev["skip"]] = f"a CUDA error in case {spec}"
                    if resume(spec):
                        note = f"CUDA error in {ev['what']}: worker exited, a fresh one resumes the case without it"
                    else:
                        pending.remove(spec)
                        note = f"CUDA error in {ev['what']}: worker exited, a fresh one runs the next case"
                        results[spec]["rows"].append(dict(name="(rest of the case)", error=f"not run: {note}"))
                    log(f"[{time.time() - t_start:6.1f} s] {spec}: {note}")
                    why = "lost"
                    break
                else:
                    if "error" in ev:
                        results[spec]["error"] = ev["error"]
                    pending.remove(spec)
                    err = f": {ev['error']}" if "error" in ev else ""
                    log(f"[{time.time() - t_start:6.1f} s] done {spec}{err}")
                    if not pending:
                        why = "done"
                    elif time.time() - t_start > args.time_limit:
                        why = "limit"  # start no new case
            if why is None and time.time() >= deadline:
                why = "stall"
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if why in ("done", "limit", "lost") or not pending:
            continue
        # The worker died or hung inside pending[0]: report the item it was on; resume the case without a kernel row
        # that hung, else move past the case.
        spec = pending[0]
        what = begun[1] if begun and begun[0] == spec else "case"
        hard = time.time() >= hard_stop
        kernel_row = what.split()[0] in ("w4a16", "w4a8")
        if not (kernel_row and resume(spec)):
            pending.pop(0)
        msg = f"no progress for {time.time() - last:.0f} s"
        if why == "exit":  # it dumps its stack ('Timeout') and exits itself shortly before a stall would be seen here
            stalled = f"a 'Timeout' stack dump above means no progress for {args.stall - 3:.0f} s"
            msg = f"worker exited ({proc.returncode}; {stalled})"
        msg += " at the run's hard limit" if hard else ""
        log(f"  {spec}: {what}: {msg}; worker killed" if why == "stall" else f"  {spec}: {what}: {msg}")
        if what == "case":
            results[spec]["error"] = msg
        else:
            later = "the case resumes without it" if spec in pending else "the case's later rows are lost"
            results[spec]["rows"].append(dict(name=what, error=f"hung or crashed: {msg}; {later}"))
            done.setdefault(spec, []).append(what)
            if kernel_row and not hard:
                skip[what] = f"it hung or crashed in case {spec}"
        if hard:
            for s in pending:
                results[s]["error"] = "skipped: the run's hard limit was reached"
            break
    return results


def _row_summary(r: dict) -> str:
    parts = [r["name"]]
    if "check" in r:
        c = r["check"]
        parts.append(f"check {'ok' if c.get('ok') else 'FAIL'} max rel {c.get('max_rel', float('nan')):.2e}")
    if "t" in r:
        parts.append(f"{r['t'] * 1e6:.1f} us")
    if "error" in r:
        parts.append(r["error"][:300])
    return ", ".join(parts)


def table(results: dict[str, dict], cases, ceil: dict) -> list[str]:
    copy = ceil.get("torch_copy") or ceil.get("xla_copy")
    i8, bf = ceil.get("int8"), ceil.get("bf16")
    device = any("td" in r for res in results.values() for r in res.get("rows", []))
    lines = [
        "| E | M | K x N | implementation | time (us) |"
        + (" device (us) |" if device else "")
        + " weights TB/s | % copy | TFLOP/s | % MMA ceiling | vs bf16 | check (max rel) |",
        "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if device else ""),
    ]
    when = lambda r: r.get("td") or r["t"]  # the rates: from the device time when measured
    for e, m, k, n in cases:
        res = results.get(f"{e}x{m}x{k}x{n}", {})
        head = f"| {e} | {m} | {k} x {n} |"
        rows = res.get("rows", [])
        t_bf16 = next((when(r) for r in rows if r["name"].startswith("bf16") and "t" in r), None)
        for r in rows:
            c = r.get("check", {})
            chk = f"{'ok' if c.get('ok') else 'FAIL'} {c.get('max_rel', float('nan')):.1e}" if c else ""
            if "t" not in r:
                lines.append(
                    f"{head} {r['name']} | error |{' |' if device else ''} | | | | | {chk} {r.get('error', '')[:160]} |"
                )
                continue
            t = when(r)
            times = f"{r['t'] * 1e6:.1f} |" + (f" {r['td'] * 1e6:.1f} |" if "td" in r else " |" if device else "")
            if not r.get("mult", 1):  # not a matmul: its time only
                lines.append(f"{head} {r['name']} | {times} | | | | | |")
                continue
            tbs, flops = r["nbytes"] / t / 1e12, r.get("mult", 1) * 2 * m * k * n / t / 1e12
            ceiling = i8 if r.get("int8") else bf
            pc = f"{100 * r['nbytes'] / t / copy:.0f}%" if copy else ""
            pm = f"{100 * flops * 1e12 / ceiling:.0f}%" if ceiling else ""
            vs = f"{r.get('mult', 1) * t_bf16 / t:.2f}x" if t_bf16 else ""  # fused rows: against two bf16 calls
            lines.append(f"{head} {r['name']} | {times} {tbs:.2f} | {pc} | {flops:.0f} | {pm} | {vs} | {chk} |")
        if "error" in res:
            lines.append(f"{head} (case) | error | | | | | | | {res['error'][:160]} |")
    return lines


def check_lines(results: dict, cases) -> list[str]:
    """One line per checked row: the int4 kernels with their tiling and shared memory, the others without."""
    lines = []
    for c in cases:
        for r in results["x".join(map(str, c))]["rows"]:
            if "check" in r:
                k = r["check"]
                cfg = f" ({k['tiling']}, smem {k['smem']} B)" if "tiling" in k else ""
                lines.append(
                    f"- {c} {r['name']}: {'ok' if k['ok'] else 'FAIL'}, max rel {k['max_rel']:.2e}, "
                    f"norm rel {k['rel']:.2e}{'' if k.get('repeats', True) else ', outputs differ between runs'}"
                    f"{cfg}"
                )
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default="default", help="'default', 'all' or ExMxKxN,... (e.g. 16x1024x7168x2048)")
    ap.add_argument("--time-limit", type=float, default=200.0, help="start no new case after this many seconds")
    ap.add_argument(
        "--hard-limit", type=float, help="kill whatever still runs after this many seconds (default: time limit + 35)"
    )
    ap.add_argument("--stall", type=float, default=45.0, help="kill a worker silent this long (e.g. a hung kernel)")
    sweep = "also time other tilings (sweep_tilings): in all cases, or in these (ExMxKxN,...)"
    ap.add_argument("--sweep", nargs="?", const="all", default="", help=sweep)
    only = "sweep only the tilings whose row label has one of these texts (A|B)"
    ap.add_argument("--sweep-only", default="", help=only)
    ap.add_argument("--jnp-refs", action="store_true", help="also time the jnp references (slow: ~0.1-10 ms)")
    ap.add_argument("--out", help="append the table to this markdown file")
    ap.add_argument("--no-ceilings", action="store_true", help="skip the ceiling measurements")
    ap.add_argument(
        "--device-time",
        action="store_true",
        help="also time each row on the device alone (hcfjax.bench.common.device_time); the rates then use it",
    )
    ap.add_argument(
        "--kernel-time",
        action="store_true",
        help="as --device-time, but the device column is the GPU's kernel time from a profiler trace "
        "(hcfjax.bench.common.kernel_times: no launch gaps or timing loop)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="time every row of a case this many times, interleaved (row 1..n, then again), and keep each row's best",
    )
    ap.add_argument("--interpret", action="store_true", help="Mosaic GPU's interpreter (a CPU smoke test)")
    ap.add_argument("--lower", action="store_true", help="only lower every kernel for sm_90 here (no GPU needed)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--skip", default="{}", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        from pallas_kernels.bench.moe_worker import worker

        worker(args.worker.split(","), args.sweep, args.interpret, json.loads(args.skip), args.jnp_refs)
        return
    if args.cases in ("default", "all"):
        cases = HEADLINE if args.cases == "default" else all_cases()
    else:
        cases = [tuple(map(int, c.split("x"))) for c in args.cases.split(",")]
    if args.lower:
        sys.exit(0 if lower_all(cases, args.sweep) else 1)
    if args.device_time or args.kernel_time:  # the workers (child processes) read it
        os.environ["HCFJAX_BENCH_DEVICE_TIME"] = "kernels" if args.kernel_time else "1"
    os.environ["MOE_BENCH_ROUNDS"] = str(args.rounds)
    os.environ["MOE_BENCH_SWEEP_ONLY"] = args.sweep_only
    log = Log()
    t0 = time.time()
    specs = ["ceilings"] * (not args.no_ceilings) + ["x".join(map(str, c)) for c in cases]
    results = run_workers(specs, args, log)
    ceil = results.get("ceilings", {}).get("ceilings", {})
    if ceil.get("torch_copy"):
        copy_s = (
            f"torch copy_ {ceil['torch_copy'] / 1e12:.2f} TB/s (read + write), XLA copy {ceil['xla_copy'] / 1e12:.2f}"
        )
    elif ceil.get("xla_copy"):
        copy_s = f"XLA copy {ceil['xla_copy'] / 1e12:.2f} TB/s (read + write; torch with CUDA not available)"
    else:
        copy_s = "not measured " + results.get("ceilings", {}).get("error", "(--no-ceilings)")
    mma_s = (
        f"XLA bf16 matmul {ceil['bf16'] / 1e12:.0f} TFLOP/s, XLA int8 matmul {ceil['int8'] / 1e12:.0f} TOP/s (8192^3)"
        if ceil.get("int8")
        else "matmul ceilings not measured"
    )
    checks = check_lines(results, cases)
    text = [
        "",
        f"{ceil.get('header', 'device: see the log')}; whole run {time.time() - t0:.0f} s",
        f"Ceilings (this run): copy {copy_s}; {mma_s}.",
        "Kernel times include the wrapper's XLA work. % MMA ceiling: of the bf16 rate (bf16, w4a16 rows) or the int8",
        "rate (w4a8 rows)." + (f" Times: each row's best of {args.rounds} interleaved rounds." * (args.rounds > 1)),
        *(
            [
                "Device column: the GPU's kernel time (kernel records of a profiler trace summed per call: the",
                "wrapper's XLA kernels included, launch gaps and the timing loop not); the rates use it.",
            ]
            if args.kernel_time
            else []
        ),
        "",
        "Checks on this device (kernel vs the exactly-quantised function in f32; max |err| / max |ref| "
        f"< {CHECK_TOL}):",
        *checks,
        "",
        *table(results, cases, ceil),
        "",
    ]
    log(*text)
    if log.dir:
        with open(os.path.join(log.dir, "moe_bench.md"), "w") as fh:
            fh.write("\n".join(text))
    if args.out:
        with open(args.out, "a") as fh:
            fh.write("\n".join(text))


if __name__ == "__main__":
    main()
