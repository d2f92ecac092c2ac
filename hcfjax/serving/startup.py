"""A server's start-up: the persistent compilation cache, the warm-up's progress bar, and the ready line.

XLA compiles each step shape once per process; with the cache on (the default, under the user's cache directory)
a restart reads the compiled programs back instead. Before the server says it is ready, the warm-up compiles the
shapes that hold every other one the engine can run (see hcfjax.engine.shapes), so no request waits for a compile;
the smaller ones compile in the background, and until each is ready its steps run padded to a larger one.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def default_compile_cache() -> Path:
    """$XDG_CACHE_HOME/hcfjax/xla (~/.cache/hcfjax/xla when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hcfjax" / "xla"


def use_compile_cache(directory: str | os.PathLike | None) -> Path | None:
    """Points jax's persistent compilation cache at `directory` (made if missing; None or "off": no cache), for
    every compile from here on. Call before the first compile. -> the directory in use."""
    import jax

    if directory is None or str(directory) == "off":
        return None
    path = Path(directory).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # every step shape, however quick
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


class CompileProgress:
    """progress(done, total) for Engine.warmup: a bar with an ETA on a terminal, else a line every ~10%."""

    def __init__(self, label: str = "hcfjax serve: compiling step shapes", stream=None):
        self.label, self.stream = label, stream or sys.stderr
        self._bar = None
        self._shown = -1
        self._t0 = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        if total == 0:
            return
        if self.stream.isatty():
            self._tty(done, total)
        elif done == 0 or done == total or done * 10 // total > self._shown:
            self._shown = done * 10 // total
            left = (time.monotonic() - self._t0) / done * (total - done) if done else float("nan")
            eta = f", about {left:.0f} s left" if done and done < total else ""
            print(f"{self.label}: {done}/{total}{eta}", file=self.stream, flush=True)

    def _tty(self, done: int, total: int) -> None:
        from tqdm import tqdm

        if self._bar is None:
            self._bar = tqdm(total=total, desc=self.label, unit="shape", file=self.stream, leave=False)
        self._bar.update(done - self._bar.n)
        if done == total:
            self._bar.close()


def warm_up(engine, announce, check=lambda: None) -> float:
    """Compiles the step shapes of `engine` that hold all the others, with a progress display, and starts the
    others compiling in the background (steps pad to a compiled shape meanwhile); -> seconds. check() runs as each
    shape's compile ends: an error it raises (the servers' process could not bind its ports) ends the warm-up."""
    bar = CompileProgress()

    def progress(done: int, total: int) -> None:
        check()
        bar(done, total)

    seconds = engine.warmup(progress=progress, rest_later=True)
    disk = engine.runner.disk
    loaded = f" ({disk.hits} loaded from the step cache)" if disk is not None and disk.hits else ""
    later = " (the other step shapes go on compiling in the background)" if engine.runner.compiling() else ""
    announce(f"hcfjax serve: {len(engine.runner.executables)} step shapes compiled in {seconds:.1f} s{loaded}{later}")
    return seconds


def ready_line(started: float | None, addresses: list[str]) -> str:
    """The one line that says the server accepts requests: since when the command started, and where."""
    took = "" if started is None else f" in {time.monotonic() - started:.1f} s"
    return f"hcfjax serve: ready{took} ({', '.join(addresses)})"
