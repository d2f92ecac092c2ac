"""Helpers shared by the front-end tests (gRPC and HTTP) that drive a live engine."""

import time

from hcfjax.engine import Engine


def assert_idle(engine: Engine, timeout: float) -> None:
    """Waits for the engine to hold no request and every page to be free (aborts land within a step or two)."""
    deadline = time.monotonic() + timeout
    while True:
        s = engine.snapshot()
        if s["queued"] == s["running"] == 0 and s["free_pages"] == s["total_pages"]:
            return
        assert time.monotonic() < deadline, f"engine not idle: {s}"
        time.sleep(0.02)
