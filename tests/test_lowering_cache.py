"""A kernel launch is lowered once per process: two programs that call the same int4 grouped GEMM (lowered for
CUDA here, on the CPU, without running) lower the Mosaic GPU kernel once and both hold its custom call."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.mosaic.gpu import core as mgpu_core

from pallas_kernels import lowering_cache
from pallas_kernels.moe_int4 import int4_ragged_dot


def test_each_kernel_launch_is_lowered_once(monkeypatch):
    lowerings = []
    real = mgpu_core.lower_mgpu_module
    monkeypatch.setattr(mgpu_core, "lower_mgpu_module", lambda *a, **k: lowerings.append(1) or real(*a, **k))
    e, m, k, n = 4, 64, 256, 128
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    q = jax.ShapeDtypeStruct((e, n, k // 2), jnp.uint8)
    scale = jax.ShapeDtypeStruct((e, k // 128, n), jnp.float32)
    sizes = jax.ShapeDtypeStruct((e,), jnp.int32)
    first = lambda x, q, s, g: int4_ragged_dot(x, q, s, g, act="int8")
    second = lambda x, q, s, g: int4_ragged_dot(x, q, s, g, act="int8") * 2  # another program, the same launch
    before = lowering_cache.lowered_kernels()
    lower = lambda f, x: jax.jit(f).trace(x, q, scale, sizes).lower(lowering_platforms=("cuda",)).as_text()
    texts = [lower(f, x) for f in (first, second)]
    assert lowering_cache.lowered_kernels() == before + 1 and len(lowerings) == 1
    assert all(t.count("mosaic_gpu_v2") == 1 for t in texts)
    wider = lambda x, q, s, g: int4_ragged_dot(x, q, s, g, act="int8")  # new operand shapes: a new launch
    x2 = jax.ShapeDtypeStruct((2 * m, k), jnp.bfloat16)
    lower(wider, x2)
    assert lowering_cache.lowered_kernels() == before + 2 and len(lowerings) == 2


def test_a_failed_lowering_is_not_cached():
    calls = []

    def broken():
        calls.append(1)
        raise ValueError("no kernel")

    x = jnp.zeros((2,), jnp.float32)
    for _ in range(2):
        with pytest.raises(ValueError, match="no kernel"):
            lowering_cache.launch(("broken",), broken, x)
    assert len(calls) == 2


def test_kernels_lower_in_worker_processes(monkeypatch):
    """Within lowering_processes a kernel is lowered in a spawned process, not here, into the same program (source
    locations aside: they name each process's call stack, so both sides leave them out)."""
    lowerings = []
    real = mgpu_core.lower_mgpu_module
    monkeypatch.setattr(mgpu_core, "lower_mgpu_module", lambda *a, **k: lowerings.append(1) or real(*a, **k))
    monkeypatch.setenv("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "0")  # the worker's
    e, m, k, n = 4, 40, 256, 128  # a launch no other test lowers
    args = (
        jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((e, n, k // 2), jnp.uint8),
        jax.ShapeDtypeStruct((e, k // 128, n), jnp.float32),
        jax.ShapeDtypeStruct((e,), jnp.int32),
    )
    lower = lambda f: jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    saved = jax.config.jax_traceback_in_locations_limit
    jax.config.update("jax_traceback_in_locations_limit", 0)
    jax.clear_caches()  # lowerings cached with the locations of earlier tests
    try:
        with lowering_cache.lowering_processes(1):
            apart = lower(lambda x, q, s, g: int4_ragged_dot(x, q, s, g, act="int8"))
        assert lowerings == [] and apart.count("mosaic_gpu_v2") == 1
        monkeypatch.setattr(lowering_cache, "_exported", {})
        jax.clear_caches()  # (the kernel wrapper's own jit would reuse its trace)
        here = lower(lambda x, q, s, g: int4_ragged_dot(x, q, s, g, act="int8"))
    finally:
        jax.config.update("jax_traceback_in_locations_limit", saved)
    assert lowerings == [1]
    # the kernels' modules may differ in the names Mosaic numbers per process (a fresh worker starts from zero)
    blob = re.compile(r'kernel_hash = "(?:[^"\\]|\\.)*", module = "((?:[^"\\]|\\.)*)"')
    assert len(blob.findall(apart)) == 1 and blob.sub("", here) == blob.sub("", apart)
