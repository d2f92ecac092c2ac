"""Helpers shared by the tests that drive a live engine."""

import contextlib
import time

import jax

from hcfjax.engine import Engine


@contextlib.contextmanager
def xla_compiles():
    """Yields a list that collects the program's name (`jit(f)`) of each XLA compile inside the block."""
    compiles: list[str] = []
    listener = lambda event, secs, **kw: (
        compiles.append(kw.get("fun_name", event)) if event.endswith("backend_compile_duration") else None
    )
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def linked(engine: Engine, timeout_s: float = 60.0):
    """(a LinkedEngine, its EngineHost) over `engine` (started) through a pipe in this process, as the front-end
    process holds one."""
    import multiprocessing

    from hcfjax.serving.engine_link import EngineHost, LinkedEngine

    ours, theirs = multiprocessing.Pipe()
    host = EngineHost(engine, theirs).start()
    return LinkedEngine(ours, *host.front(), timeout_s), host


def assert_idle(engine: Engine, timeout: float) -> None:
    """Waits for the engine to hold no request and every page to be free (aborts land within a step or two)."""
    deadline = time.monotonic() + timeout
    while True:
        s = engine.snapshot()
        if s["queued"] == s["running"] == 0 and s["free_pages"] == s["total_pages"]:
            return
        assert time.monotonic() < deadline, f"engine not idle: {s}"
        time.sleep(0.02)


def stop_across_tokens(tokenizer, tokens: list[int]) -> tuple[str, int, str]:
    """A stop string that spans a boundary between two of `tokens` (two characters of each side), the number of
    tokens up to and including the one whose text completes it, and the text before it."""
    chars = 2
    texts = [tokenizer.decode(tokens[:i]) for i in range(len(tokens) + 1)]
    for i in range(2, len(tokens)):
        before, this, after = texts[i - 1], texts[i], texts[i + 1]
        if len(this) - len(before) >= chars and len(after) - len(this) >= chars and "\ufffd" not in after:
            stop = after[len(this) - chars : len(this) + chars]
            n = next(j for j, t in enumerate(texts) if stop in t)
            return stop, n, texts[-1][: texts[-1].find(stop)]
    raise ValueError(f"no two neighbouring tokens of {chars} or more characters")


class CountingTokenizer:
    """A tokenizer that counts its encode calls (to check that a request was refused without tokenizing)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.encoded = tokenizer, 0

    def encode(self, text):
        self.encoded += 1
        return self.tokenizer.encode(text)

    def encode_batch_fast(self, texts):
        self.encoded += len(texts)
        return self.tokenizer.encode_batch_fast(texts)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)
