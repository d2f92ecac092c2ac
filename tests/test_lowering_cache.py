"""A kernel launch is lowered once per process: two programs that call the same int4 grouped GEMM (lowered for
CUDA here, on the CPU, without running) lower the Mosaic GPU kernel once and both hold its custom call."""

import concurrent.futures
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
    e, m, k, n = 3, 24, 128, 64  # (small: a lowering's time grows with the kernel's tiles)
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


def test_a_lowering_the_pool_cannot_take_fails_its_waiters(monkeypatch):
    """A kernel handed to a pool already shut down (a warm-up ending as another thread traces): whoever waits for it
    gets the error at once, and the kernel is not kept, so a later call lowers it."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    pool.shutdown()
    monkeypatch.setattr(lowering_cache, "_exported", {})
    full, pending = (("shut",), ()), concurrent.futures.Future()
    lowering_cache._exported[full] = pending
    lowering_cache._submit((pool, (9, 0)), full, None, pending)
    assert isinstance(pending.exception(timeout=1), RuntimeError) and full not in lowering_cache._exported


def test_kernels_lower_in_worker_processes_all_found_first(monkeypatch):
    """Within lowering_processes a kernel is lowered in a spawned process, not here, into the same program (source
    locations aside: they name each process's call stack, so both sides leave them out). `discover` hands both
    kernels of a program whose second kernel takes the first's output to the processes before the real trace (which
    would meet the second only once the first had lowered), and the real program holds both kernels, not the
    discovery's zeros."""
    lowerings, submitted = [], []
    real = mgpu_core.lower_mgpu_module
    monkeypatch.setattr(mgpu_core, "lower_mgpu_module", lambda *a, **k: lowerings.append(1) or real(*a, **k))
    submit = lowering_cache._submit
    monkeypatch.setattr(lowering_cache, "_submit", lambda pool, key, *a: submitted.append(key) or submit(pool, key, *a))
    monkeypatch.setenv("JAX_TRACEBACK_IN_LOCATIONS_LIMIT", "0")  # the worker's
    e, m, k, n = 3, 40, 128, 192  # launches no other test lowers
    sds = jax.ShapeDtypeStruct
    args = (
        sds((m, k), jnp.bfloat16),
        (sds((e, k, k // 2), jnp.uint8), sds((e, k // 128, k), jnp.float32)),  # [m, k] -> [m, k]
        (sds((e, n, k // 2), jnp.uint8), sds((e, k // 128, n), jnp.float32)),  # [m, k] -> [m, n]
        sds((e,), jnp.int32),
    )

    def two(x, w1, w2, g):
        return int4_ragged_dot(int4_ragged_dot(x, *w1, g, act="int8"), *w2, g, act="int8")

    lower = lambda: jax.jit(two).trace(*args).lower(lowering_platforms=("cuda",)).as_text()  # noqa: E731
    saved = jax.config.jax_traceback_in_locations_limit
    jax.config.update("jax_traceback_in_locations_limit", 0)
    jax.clear_caches()  # lowerings cached with the locations of earlier tests
    try:
        with lowering_cache.lowering_processes(2):
            lowering_cache.discover(jax.jit(two), *args)
            assert len(submitted) == 2  # both kernels, before the real trace
            apart = lower()
        assert lowerings == [] and apart.count("mosaic_gpu_v2") == 2 and len(submitted) == 2
        monkeypatch.setattr(lowering_cache, "_exported", {})
        jax.clear_caches()  # (the kernel wrapper's own jit would reuse its trace)
        here = lower()
    finally:
        jax.config.update("jax_traceback_in_locations_limit", saved)
    assert lowerings == [1, 1]
    # the kernels' modules may differ in the names Mosaic numbers per process (a fresh worker starts from zero)
    blob = re.compile(r'kernel_hash = "(?:[^"\\]|\\.)*", module = "((?:[^"\\]|\\.)*)"')
    assert len(blob.findall(apart)) == 2 and blob.sub("", here) == blob.sub("", apart)


def test_a_discovery_trace_without_processes_lowers_nothing():
    """Outside lowering_processes, discover is a no-op and a trace within `discovering` registers no kernel (it
    would otherwise stand for a lowering nobody runs)."""
    x = jax.ShapeDtypeStruct((24, 256), jnp.bfloat16)
    q = jax.ShapeDtypeStruct((4, 128, 128), jnp.uint8)
    scale = jax.ShapeDtypeStruct((4, 2, 128), jnp.float32)
    sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
    before = lowering_cache.lowered_kernels()
    f = jax.jit(lambda x, q, s, g: int4_ragged_dot(x, q, s, g, act="int8"))
    lowering_cache.discover(f, x, q, scale, sizes)
    with lowering_cache.discovering():
        out = f.trace(x, q, scale, sizes).out_info
    assert lowering_cache.lowered_kernels() == before and out.shape == (24, 128)


def test_a_trace_for_hopper_lowers_nothing(monkeypatch):
    """In cross_lower.trace_for_hopper's trace a launch traces the kernel into the program: nothing is lowered or
    registered, and a later trace outside lowers it as usual (that trace is not reused)."""
    from pallas_kernels.cross_lower import trace_for_hopper

    x = jax.ShapeDtypeStruct((24, 256), jnp.bfloat16)
    q = jax.ShapeDtypeStruct((4, 128, 128), jnp.uint8)
    scale = jax.ShapeDtypeStruct((4, 2, 128), jnp.float32)
    sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
    lowerings = []
    real = mgpu_core.lower_mgpu_module
    monkeypatch.setattr(mgpu_core, "lower_mgpu_module", lambda *a, **k: lowerings.append(1) or real(*a, **k))
    before = lowering_cache.lowered_kernels()
    f = jax.jit(lambda x, q, s, g: int4_ragged_dot(x, q, s, g, act="bf16"))
    trace_for_hopper(f, x, q, scale, sizes)
    assert lowering_cache.lowered_kernels() == before and lowerings == []
    f.trace(x, q, scale, sizes).lower(lowering_platforms=("cuda",))
    assert lowering_cache.lowered_kernels() == before + 1 and len(lowerings) == 1


def test_lowering_contexts_share_one_pool_until_the_last_is_left(monkeypatch):
    """lowering_processes entered again (a prefill worker's warm-up around compile_all, another thread's compiles)
    takes the pool already there; leaving the first context keeps it for the other, leaving the last ends it."""
    first, second = lowering_cache.lowering_processes(1), lowering_cache.lowering_processes(1)
    first.__enter__()
    pool, stopped = lowering_cache._pool, []
    monkeypatch.setattr(pool[0], "shutdown", lambda **kw: stopped.append(kw))
    second.__enter__()
    assert lowering_cache._pool is pool
    first.__exit__(None, None, None)
    assert lowering_cache._pool is pool and stopped == []
    second.__exit__(None, None, None)
    assert lowering_cache._pool is None and stopped == [{"wait": False, "cancel_futures": True}]
