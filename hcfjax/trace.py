"""Request timestamps across processes, for finding where latency goes (hcfjax.bench.sim_validate's PD breakdown).

With HCFJAX_TRACE_DIR=DIR in its environment, each process appends one JSON line per `mark(event, key, ...)` to
DIR/trace-PID.jsonl: {"ev": event, "key": key, "t": time.monotonic(), ...}. time.monotonic is one clock for every
process of a host, so the marks of the client, the router and the workers line up. Without the variable, `mark`
returns at once and nothing is written.

Keys: a request's id (the router's, which the decode worker keeps) for the serving path, and its transfer key
(id#epoch, hcfjax.pd.decode.transfer_key) for the remote prefill.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

_lock = threading.Lock()
_file = None
_opened_for: str | None = None


def enabled() -> bool:
    return bool(os.environ.get("HCFJAX_TRACE_DIR"))


def mark(event: str, key: str, **fields) -> None:
    global _file, _opened_for
    where = os.environ.get("HCFJAX_TRACE_DIR")
    if not where:
        return
    line = json.dumps({"ev": event, "key": key, "t": time.monotonic(), **fields})
    with _lock:
        if _opened_for != where:  # first mark here, or the variable changed (tests)
            if _file is not None:
                _file.close()
            Path(where).mkdir(parents=True, exist_ok=True)
            _file = open(Path(where) / f"trace-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115 - kept open
            _opened_for = where
        _file.write(line + "\n")


def read(where: str | Path) -> list[dict]:
    """Every mark in DIR, in time order."""
    events = []
    for f in sorted(Path(where).glob("trace-*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                events.append(json.loads(line))
    return sorted(events, key=lambda e: e["t"])


def by_key(events: list[dict]) -> dict[str, dict[str, float]]:
    """{key: {event: time of its first mark}}."""
    out: dict[str, dict[str, float]] = {}
    for e in events:
        out.setdefault(e["key"], {}).setdefault(e["ev"], e["t"])
    return out
