"""How long `hcfjax serve` takes to be ready: a cold start (an empty compilation cache), then a restart that reads
the cache back. Each run starts the command, waits for its ready line, serves one request over gRPC, and stops it
with SIGINT. With --settle each run first waits for the step shapes the server compiles in the background after
ready, then times a second request: the restart then loads every program, as a server that ran a while would.

    python -m hcfjax.bench.startup [--out FILE] [--settle] -- --preset v2-lite --scheme w4a8c8 --max-slots 64 \\
        --token-budget 4096 --max-model-len 16384

Everything after `--` goes to `hcfjax serve` (its --port and --compile-cache are set here).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path


def _header() -> str:
    """Date, GPU and jax version, without starting jax here (it would take the GPU's memory from the server)."""
    import datetime
    import importlib.metadata
    import shutil

    gpu = "cpu"
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
        gpu = q.stdout.strip().splitlines()[0] if q.returncode == 0 and q.stdout.strip() else gpu
    return f"date {datetime.date.today().isoformat()}, device {gpu}, jax {importlib.metadata.version('jax')}"


BACKGROUND_DONE = re.compile(r"compiled \d+ more step shapes in the background in [\d.]+ s")
BACKGROUND_FAILED = "compiling step shapes in the background failed"


def start_once(serve_args: list[str], cache: str, timeout: float, settle: bool = False) -> dict:
    """One start: seconds to the ready line (as the server reports it and as seen from here), the shapes compiled,
    the first request's seconds, and how the command exited; settle: also the seconds until the background compiles
    ended (from the start) and a request's seconds after them."""
    cmd = [sys.executable, "-m", "hcfjax.cli", "serve", "--port", "0", "--compile-cache", cache, *serve_args]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ)
    echo = lambda line: print(f"  [{time.monotonic() - t0:6.1f} s] {line.rstrip()}", flush=True)  # noqa: E731
    row: dict = {}
    try:
        for line in proc.stdout:
            echo(line)
            if m := re.search(r"(\d+) step shapes compiled in ([\d.]+) s", line):
                row["shapes"], row["compile_s"] = int(m[1]), float(m[2])
                row["background"] = "compiling in the background" in line
            if m := re.search(r"listening on \S+:(\d+)", line):
                row["port"] = int(m[1])
            if m := re.search(r"ready in ([\d.]+) s", line):
                row["ready_s"], row["seen_s"] = float(m[1]), time.monotonic() - t0
                break
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"not ready after {timeout:.0f} s")
        if "ready_s" not in row:
            raise RuntimeError(f"hcfjax serve exited ({proc.wait()}) before it was ready")
        row["first_request_s"] = _one_request(row["port"])
        if settle and row.get("background"):
            # a server gone quiet (its background compiles failed, or hung) is stopped at the deadline
            watchdog = threading.Timer(max(timeout - (time.monotonic() - t0), 0), proc.send_signal, [signal.SIGINT])
            watchdog.start()
            try:
                for line in proc.stdout:
                    echo(line)
                    if BACKGROUND_DONE.search(line):
                        row["settled_s"] = time.monotonic() - t0
                        row["settled_request_s"] = _one_request(row["port"])
                        break
                    if BACKGROUND_FAILED in line:
                        raise RuntimeError("the server's background compiles failed")
            finally:
                watchdog.cancel()
            if "settled_s" not in row:
                raise TimeoutError(f"background compiles not done after {timeout:.0f} s")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            row["exit"] = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:  # a server that does not stop must not hold the GPU for the next one
            proc.kill()
            proc.wait()
            row["exit"] = "killed: still running 30 s after SIGINT"
    return row


def _one_request(port: int) -> float:
    from hcfjax.serving.client import connect, generate

    channel, stub = connect("127.0.0.1", port, ready_timeout=30)
    t0 = time.perf_counter()
    generate(stub, "def fibonacci(n):", max_new_tokens=8)
    channel.close()
    return time.perf_counter() - t0


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ours, serve_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache-dir", help="the compilation cache to use (default: a new temporary one)")
    ap.add_argument("--timeout", type=float, default=540.0, help="seconds a start may take")
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--settle", action="store_true", help="wait for the background compiles, then time a request")
    args = ap.parse_args(ours)
    print(_header(), flush=True)
    print(f"hcfjax serve {' '.join(serve_args)}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        cache = args.cache_dir or str(Path(tmp) / "xla")
        rows = []
        for name in ("cold (empty cache)", "restart (cached)"):
            print(f"{name}:", flush=True)
            rows.append({"start": name, **start_once(serve_args, cache, args.timeout, args.settle)})
    settled = " all compiled s | request then s |" if args.settle else ""
    print(f"\n| start | shapes | compile s | ready s | first request s |{settled} exit |")
    print("|---|---|---|---|---|" + "---|" * (2 * args.settle) + "---|")
    for r in rows:
        more = ""
        if args.settle:  # (nothing compiled in the background: settled at ready)
            more = f" {r.get('settled_s', r['seen_s']):.1f} | {r.get('settled_request_s', r['first_request_s']):.2f} |"
        print(
            f"| {r['start']} | {r.get('shapes', '-')} | {r.get('compile_s', 0):.1f} | {r['ready_s']:.1f} | "
            f"{r['first_request_s']:.2f} |{more} {r['exit']} |"
        )
    if args.out:
        Path(args.out).write_text(json.dumps({"serve_args": serve_args, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
