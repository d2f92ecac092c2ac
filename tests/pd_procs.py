"""PD roles as `hcfjax serve` processes on loopback, for the tests that run them (test_pd, test_pd_faults)."""

import re
import signal
import subprocess
import sys
import threading
import time


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
