"""Each distinct kernel launch lowered once per process.

Lowering a Mosaic GPU kernel (layout inference over its whole body) takes seconds, and jax lowers a kernel anew in
every jitted program that calls it: a server compiling one program per step shape would lower the same decode
kernels for every shape. `launch` lowers a kernel once per (static description, operand shapes), as a
`jax.export.Exported`, and calls that in every program that needs it: the program inlines the stored module instead
of lowering the kernel again. Interpret mode (CPU tests) runs the kernel as before.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Hashable

import jax

_lock = threading.Lock()
_exported: dict[Hashable, concurrent.futures.Future] = {}
_CHECKS = (jax.export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2"),)


def launch(key: Hashable, build: Callable[[], Callable], *args):
    """build() -> the kernel (a function of `args`, e.g. a plgpu.kernel); `key` must say everything about it that
    is not in the operands' shapes and dtypes. -> the kernel's outputs. Programs traced on several threads at once
    (a server's warm-up) wait for the one thread that lowers a kernel."""
    avals = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args)
    full = (key, avals)
    with _lock:
        pending = _exported.get(full)
        mine = pending is None
        if mine:
            pending = _exported[full] = concurrent.futures.Future()
    if mine:
        try:
            pending.set_result(
                jax.export.export(jax.jit(build()), platforms=("cuda",), disabled_checks=_CHECKS)(*avals)
            )
        except BaseException as e:
            with _lock:
                del _exported[full]  # a later call tries again
            pending.set_exception(e)
            raise
    return pending.result().call(*args)


def lowered_kernels() -> int:
    """How many distinct kernel launches this process has lowered."""
    return len(_exported)
