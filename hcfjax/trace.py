"""Request timestamps across processes, for finding where latency goes (hcfjax.bench.sim_validate's PD breakdown).

After `enable(DIR)`, each process appends one JSON line per `mark(event, key, ...)` to DIR/trace-PID.jsonl:
{"ev": event, "key": key, "t": time.monotonic(), ...}. time.monotonic is one clock for every process of a host, so
the marks of the client, the router and the workers line up. Until then (or after `enable(None)`), `mark` returns at
once and nothing is written.

The entry points turn it on: the CLI (`hcfjax ...`, which every serving worker runs) and the serving benchmarks
read the directory from the HCFJAX_TRACE_DIR environment variable (DIR_VARIABLE), which the processes they start
inherit. Nothing else reads it.

Keys: a request's id (the router's, which the decode worker keeps) for the serving path, and its transfer key
(id#epoch, hcfjax.pd.decode.transfer_key) for the remote prefill.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

DIR_VARIABLE = "HCFJAX_TRACE_DIR"  # the environment variable the entry points read the directory from

_lock = threading.Lock()
_dir: Path | None = None
_file = None


def enable(directory: str | Path | None) -> None:
    """Marks from now on go to DIRECTORY/trace-PID.jsonl (created on the first mark); None: marks are dropped."""
    global _dir, _file
    with _lock:
        if _file is not None:
            _file.close()
            _file = None
        _dir = None if directory is None else Path(directory)


def directory() -> Path | None:
    """Where this process's marks go, or None when tracing is off."""
    return _dir


def enabled() -> bool:
    return _dir is not None


def mark(event: str, key: str, **fields) -> None:
    global _file
    if _dir is None:
        return
    line = json.dumps({"ev": event, "key": key, "t": time.monotonic(), **fields})
    with _lock:
        if _dir is None:  # turned off meanwhile
            return
        if _file is None:
            _dir.mkdir(parents=True, exist_ok=True)
            _file = open(_dir / f"trace-{os.getpid()}.jsonl", "a", buffering=1)  # noqa: SIM115 - kept open
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
