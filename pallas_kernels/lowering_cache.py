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

A trace waits for each kernel where the program calls it, so the kernels of one program (an expert layer's gate/up
kernel, then its down kernel) would still lower one after another. A trace within `discovering` first finds them
all: there `launch` only hands each new kernel to the processes and gives zeros of its outputs' shapes, and the
program's real trace then waits for kernels that lowered side by side. Such a trace is kept apart from jax's caches
(a config state in the trace context), so no program keeps its zeros.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import threading
from collections.abc import Callable, Hashable

import jax
import jax.numpy as jnp
from jax._src import config as jax_config

from pallas_kernels.cross_lower import target_arch, trace_only

_lock = threading.Lock()
_exported: dict[Hashable, concurrent.futures.Future] = {}
_CHECKS = (jax.export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2"),)
_pool: tuple[concurrent.futures.ProcessPoolExecutor, tuple[int, int]] | None = None
_users = 0  # lowering_processes contexts open
_discovering = jax_config.bool_state(
    "hcfjax_kernel_discovery",
    False,
    "pallas_kernels.lowering_cache.discovering: launches hand their kernels to the lowering processes and give zeros",
    include_in_trace_context=True,  # the traces made within have caches of their own
)


def launch(key: Hashable, build: Callable[[], Callable], *args, out=None):
    """build() -> the kernel (a function of `args`, e.g. a plgpu.kernel); `key` must say everything about it that
    is not in the operands' shapes and dtypes, and build must pickle (a functools.partial of a module-level function
    of static arguments) to be lowered in another process. -> the kernel's outputs. Programs traced on several
    threads at once (a server's warm-up) wait for the one thread that lowers a kernel. `out`: the outputs' shapes
    (jax.ShapeDtypeStructs, as the kernel returns them), for `discovering` (else found by tracing the kernel)."""
    if trace_only():  # cross_lower.trace_for_hopper: the kernel's body traced, nothing lowered
        return build()(*args)
    avals = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args)
    full = (key, avals)
    discovery = _discovering.value
    with _lock:
        pending = _exported.get(full)
        pool = _pool
        mine = pending is None and (pool is not None or not discovery)
        if mine:
            pending = _exported[full] = concurrent.futures.Future()
    if discovery:
        if mine:
            _submit(pool, full, build, pending)
        return _zeros(out if out is not None else jax.eval_shape(build(), *avals), args)
    if mine:
        if pool is None:
            _settle(full, pending, lambda: _export(build, avals))
        else:
            _submit(pool, full, build, pending)
    return pending.result().call(*args)


@contextlib.contextmanager
def discovering():
    """Within (this thread): `launch` hands each kernel not yet lowered to the lowering processes (when
    `lowering_processes` has them; else it lowers nothing) and returns zeros of its outputs' shapes at once. A trace
    of a program within finds all its kernels; nothing traced within is a program to run."""
    with _discovering(True):
        yield


def discover(fn, *args, **kwargs) -> None:
    """Within `lowering_processes`: hands the kernels that the jitted `fn` launches for `args` (arrays or
    ShapeDtypeStructs) and `kwargs` to the processes, all of them, before fn is lowered for real. A trace that
    fails here (nothing it needs is checked yet) is left to the real one, which reports its error."""
    if _pool is None:
        return
    try:
        with discovering():
            fn.trace(*args, **kwargs)
    except Exception:  # noqa: BLE001 - the real trace raises it again, where it is reported
        pass


def _submit(pool, full, build, pending: concurrent.futures.Future) -> None:
    """Lowers (key, avals) in the pool; `pending` gets the Exported (or the error) when that ends."""
    _, avals = full
    try:
        job = pool[0].submit(_export_serialized, build, avals, pool[1])
    except BaseException as e:  # (a pool shut down meanwhile)
        _fail(full, pending, e)
        return
    job.add_done_callback(lambda job: _settle(full, pending, lambda: jax.export.deserialize(job.result())))


def _settle(full, pending: concurrent.futures.Future, make: Callable[[], jax.export.Exported]) -> None:
    try:
        pending.set_result(make())
    except BaseException as e:
        _fail(full, pending, e)


def _fail(full, pending: concurrent.futures.Future, e: BaseException) -> None:
    """The lowering failed: its waiters get the error, and a later call tries again."""
    with _lock:
        if _exported.get(full) is pending:
            del _exported[full]
    pending.set_exception(e)


def _zeros(out, args):
    """Zeros of `out`'s shapes (a tree of ShapeDtypeStructs), made from the arguments so that inside a shard_map
    they vary over the mesh axes the arguments vary over, as the kernel's outputs would."""
    seed = sum((a.reshape(-1)[:1].astype(jnp.float32).sum() * 0 for a in args if a.size), jnp.zeros((), jnp.float32))
    return jax.tree.map(lambda s: jnp.broadcast_to(seed.astype(s.dtype), s.shape), out)


def lowered_kernels() -> int:
    """How many distinct kernel launches this process has lowered."""
    return len(_exported)


@contextlib.contextmanager
def lowering_processes(workers: int):
    """Within: kernels not yet lowered are lowered in `workers` spawned processes, for this process's GPU
    architecture. The processes ignore SIGINT (the caller's Ctrl-C ends them). Contexts on any thread share one
    pool, which ends when the last of them is left."""
    global _pool, _users
    from jax.experimental.mosaic.gpu import utils

    with _lock:
        if _pool is None:
            arch = utils._infer_arch()  # the device's, asked here: the workers have no GPU to ask
            pool = concurrent.futures.ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init
            )
            _pool = (pool, arch)
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            last, pool = _users == 0, _pool[0]
            if last:
                _pool = None
        if last:
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
