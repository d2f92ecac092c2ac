"""Helpers shared by the tests that drive a live engine."""

import contextlib
import time

import jax

from hcfjax.engine import Engine


@contextlib.contextmanager
def xla_compiles():
    """Yields a list that collects one entry per XLA compile inside the block."""
    compiles: list[str] = []
    listener = lambda event, secs, **kw: compiles.append(event) if event.endswith("backend_compile_duration") else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def assert_idle(engine: Engine, timeout: float) -> None:
    """Waits for the engine to hold no request and every page to be free (aborts land within a step or two)."""
    deadline = time.monotonic() + timeout
    while True:
        s = engine.snapshot()
        if s["queued"] == s["running"] == 0 and s["free_pages"] == s["total_pages"]:
            return
        assert time.monotonic() < deadline, f"engine not idle: {s}"
        time.sleep(0.02)
