"""Compiling programs ahead of time, several at once (`compile_all`), and compiled engine steps kept on disk, so a
restarted server loads them instead of tracing and lowering again.

jax's persistent compilation cache (hcfjax.serving.startup) saves XLA's compile, but its key is the lowered
program: a restart still traces every step shape and lowers it (the Mosaic GPU kernels' lowering alone takes
seconds). This cache keys a step by what determines it before tracing (the code of the packages it runs, jax's
version, the device, the model config, every operand's shape, dtype and sharding, and the static arguments) and
stores the compiled executable. The files are pickles: point it only at a directory you own.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import logging
import os
import pickle
import tempfile
from collections.abc import Callable, Hashable
from pathlib import Path

import jax
import numpy as np

from pallas_kernels import lowering_cache

log = logging.getLogger("hcfjax.engine")
_PACKAGES = ("hcfjax", "pallas_kernels", "sharding")


@functools.cache
def source_digest() -> str:
    """A hash of every Python file of the packages a step runs: any code change makes new keys."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for package in _PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def step_key(static: tuple, operands) -> str:
    """The key of a step compiled for `operands` (a pytree of arrays or Python scalars) and `static` (hashable,
    with reprs that say what they are: configs, options)."""
    dev = jax.devices()[0]
    leaf = lambda x: (np.shape(x), str(getattr(x, "dtype", type(x).__name__)), str(getattr(x, "sharding", None)))
    leaves = [leaf(x) for x in jax.tree.leaves(operands)]
    parts = (
        source_digest(),
        jax.__version__,
        dev.platform,
        dev.device_kind,
        repr(static),
        str(jax.tree.structure(operands)),
        repr(leaves),
    )
    return hashlib.sha256(repr(parts).encode()).hexdigest()


class ExecutableCache:
    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.hits = self.misses = 0

    def get_or_compile(self, key: str, compile_fn: Callable[[], jax.stages.Compiled], devices) -> jax.stages.Compiled:
        """The executable stored under `key`, else compile_fn()'s, stored for next time; `devices`: those it runs
        on. A file that does not load (another jax, a torn write) is compiled anew and replaced."""
        from jax.experimental.serialize_executable import deserialize_and_load, serialize

        path = self.directory / f"{key}.step"
        if path.is_file():
            _mosaic_gpu_runtime(devices)
            try:
                payload, in_tree, out_tree = pickle.loads(path.read_bytes())
                compiled = deserialize_and_load(payload, in_tree, out_tree, execution_devices=list(devices))
                self.hits += 1
                return compiled
            except Exception as e:  # noqa: BLE001 - a bad entry costs a compile, never a failure
                log.warning("ignoring the cached step %s: %s", path.name, e)
        compiled = compile_fn()
        self.misses += 1
        try:
            blob = pickle.dumps(serialize(compiled))
            with tempfile.NamedTemporaryFile(dir=self.directory, delete=False, suffix=".tmp") as f:
                f.write(blob)
            os.replace(f.name, path)
        except Exception as e:  # noqa: BLE001 - an executable that cannot be stored is still used
            log.warning("could not store the compiled step: %s", e)
        return compiled


def _mosaic_gpu_runtime(devices) -> None:
    """Makes Mosaic GPU's runtime library findable before a step holding its kernels is loaded: importing Mosaic GPU
    says where the library is, and a step loaded before that fails to resolve the kernels' host symbols (and is
    compiled again)."""
    if any(d.platform == "gpu" for d in devices):
        import jax.experimental.mosaic.gpu  # noqa: F401


def compile_ahead(fn, *args, **static) -> jax.stages.Compiled:
    """fn (jitted) lowered and compiled for args (arrays or ShapeDtypeStructs) and its static arguments; call the
    result without the static ones. During a warm-up (`compile_all`) its kernels first lower side by side
    (lowering_cache.discover), where they would otherwise lower one after another as the trace meets them."""
    lowering_cache.discover(fn, *args, **static)
    return fn.lower(*args, **static).compile()


def lowering_workers() -> int:
    """Processes to lower kernels in: one a core, up to 8 (a warm-up's kernels are dozens, each seconds of Python;
    more take the cores that the compiles' own threads need)."""
    return max(1, min(os.cpu_count() or 1, 8))


def compile_all(
    jobs: dict[Hashable, Callable[[], jax.stages.Compiled]],
    store: Callable[[Hashable, jax.stages.Compiled], None],
    on_gpu: bool,
    progress: Callable[[int, int], None] | None = None,
    check: Callable[[], None] | None = None,
    pool_made: Callable[[concurrent.futures.ThreadPoolExecutor], None] | None = None,
) -> None:
    """Runs the jobs (each compiles one program) several at once, on a GPU with the kernels they launch lowered in
    processes of their own (as many as the host allows: one program can launch many distinct kernels), and
    store(key, compiled) as each ends. progress(done, total) is told as each ends; check() may raise to stop
    (what they compile for cannot run); pool_made(pool) lets a caller stop the compiles not yet started. A Ctrl-C
    or a failed compile drops the compiles not started and waits for none."""
    if not jobs:
        return
    workers = max(1, min(len(jobs), os.cpu_count() or 1, 8))
    pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="hcfjax-compile")
    if pool_made is not None:
        pool_made(pool)
    lowering = lowering_cache.lowering_processes(lowering_workers()) if on_gpu else contextlib.nullcontext()
    with lowering:
        try:
            futures = {pool.submit(job): key for key, job in jobs.items()}
            if progress is not None:
                progress(0, len(jobs))
            pending, finished = set(futures), 0
            while pending:
                # a wait with a timeout: a Ctrl-C that the OS hands to another thread is raised here within the
                # timeout, not when the next compile ends
                done, pending = concurrent.futures.wait(pending, 0.25, concurrent.futures.FIRST_COMPLETED)
                if check is not None:
                    check()
                for f in done:
                    store(futures[f], f.result())
                    finished += 1
                    if progress is not None:
                        progress(finished, len(jobs))
        except BaseException:
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
