"""Each distinct kernel launch lowered once per process, and, during a warm-up, in processes of its own.

Lowering a Mosaic GPU kernel (layout inference over its whole body) takes seconds, and jax lowers a kernel anew in
every jitted program that calls it: a server compiling one program per step shape would lower the same decode
kernels for every shape. `launch` lowers a kernel once per (static description, operand shapes), as a
`jax.export.Exported`, and calls that in every program that needs it: the program inlines the stored module instead
of lowering the kernel again. Interpret mode (CPU tests) runs the kernel as before.

Mosaic GPU's lowering is Python, so kernels lowered on several threads take turns on the GIL: a server warming up
its step shapes (each with its own MoE kernels, a large one taking tens of seconds) would lower them one after
another. Within `lowering_processes`, a kernel not yet lowered is lowered in a pool of spawned, CPU-only processes
(`cross_lower` shows that Mosaic GPU lowers without a GPU given the target architecture) and comes back serialized.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import threading
from collections.abc import Callable, Hashable

import jax

from pallas_kernels.cross_lower import target_arch

_lock = threading.Lock()
_exported: dict[Hashable, concurrent.futures.Future] = {}
_CHECKS = (jax.export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2"),)
_pool: tuple[concurrent.futures.ProcessPoolExecutor, tuple[int, int]] | None = None


def launch(key: Hashable, build: Callable[[], Callable], *args):
    """build() -> the kernel (a function of `args`, e.g. a plgpu.kernel); `key` must say everything about it that
    is not in the operands' shapes and dtypes, and build must pickle (a functools.partial of a module-level function
    of static arguments) to be lowered in another process. -> the kernel's outputs. Programs traced on several
    threads at once (a server's warm-up) wait for the one thread that lowers a kernel."""
    avals = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args)
    full = (key, avals)
    with _lock:
        pending = _exported.get(full)
        mine = pending is None
        if mine:
            pending = _exported[full] = concurrent.futures.Future()
        pool = _pool
    if mine:
        try:
            if pool is None:
                exported = _export(build, avals)
            else:
                exported = jax.export.deserialize(pool[0].submit(_export_serialized, build, avals, pool[1]).result())
            pending.set_result(exported)
        except BaseException as e:
            with _lock:
                del _exported[full]  # a later call tries again
            pending.set_exception(e)
            raise
    return pending.result().call(*args)


def lowered_kernels() -> int:
    """How many distinct kernel launches this process has lowered."""
    return len(_exported)


@contextlib.contextmanager
def lowering_processes(workers: int):
    """Within: kernels not yet lowered are lowered in `workers` spawned processes, for this process's GPU
    architecture. The processes ignore SIGINT (the caller's Ctrl-C ends them) and end on leaving."""
    global _pool
    from jax.experimental.mosaic.gpu import utils

    arch = utils._infer_arch()  # the device's, asked here: the workers have no GPU to ask
    pool = concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init
    )
    with _lock:
        _pool = (pool, arch)
    try:
        yield
    finally:
        with _lock:
            _pool = None
        pool.shutdown(wait=False, cancel_futures=True)


def _export(build, avals) -> jax.export.Exported:
    return jax.export.export(jax.jit(build()), platforms=("cuda",), disabled_checks=_CHECKS)(*avals)


def _worker_init() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    jax.config.update("jax_platforms", "cpu")  # lowering needs no device, and the GPU stays the server's


def _export_serialized(build, avals, arch: tuple[int, int]) -> bytearray:  # (serializing needs flatbuffers)
    with target_arch(arch):
        return _export(build, avals).serialize()
