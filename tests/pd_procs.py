"""PD roles as `hcfjax serve` processes on loopback, for the tests that run them (test_pd, test_pd_faults, test_http),
and what their workers say of the requests they hold."""

import re
import signal
import subprocess
import sys
import threading
import time

import grpc

from hcfjax.serving import pd_pb2 as pdpb
from hcfjax.serving import pd_pb2_grpc as pd_grpc


def start(args: list[str], name: str, env, until: str = "listening on") -> tuple[subprocess.Popen, str, str]:
    """Starts `hcfjax serve` with args; returns it, its address and what it printed once a line holds `until` (the
    router's "ready" line comes after its "listening on" line)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "hcfjax.cli", "serve", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    lines, address = [], None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"listening on (\S+)", line)
        address = m.group(1) if m else address
        if address and until in line:
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()  # keep the pipe drained
            return proc, address, "".join(lines)
    proc.kill()
    raise RuntimeError(f"{name} did not start:\n{''.join(lines)}")


def stop(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to every process, then a wait of up to 15 s each (SIGKILL past it)."""
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.kill()


def info(addr: str) -> pdpb.WorkerInfo:
    with grpc.insecure_channel(addr) as ch:
        return pd_grpc.WorkerStub(ch).Info(pdpb.InfoRequest(), timeout=10)


def idle(worker: pdpb.WorkerInfo) -> bool:
    """No request held: a prefill worker's scratch pages and queue empty, a decode worker's pages all free."""
    if worker.role == "prefill":
        return worker.pages_held == 0 and worker.queued == 0
    return worker.free_pages == worker.total_pages and worker.running == 0 and worker.queued == 0
