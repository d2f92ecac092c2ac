import atexit
import gc
import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The suite's time is mostly XLA:CPU compiling tiny programs (a speculative test: 27 of 41 s in 60 compiles), not
# running them; LLVM at -O0 compiles them 10-20% faster in CPU time (same numerics: no fast-math either way).
# Subprocesses the tests start inherit it.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

# Servers the tests start keep their compiled steps under $XDG_CACHE_HOME (hcfjax serve --compile-cache): a
# directory of this run's own, not the user's cache, removed when the process exits.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="hcfjax-tests-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)

import jax  # noqa: E402

# Eight fake CPU devices for the sharding plans; everything else runs on the first one.
jax.config.update("jax_num_cpu_devices", 8)

# Orbax saves an array replicated over the 8 devices from one replica, as it does by default on GPUs: on CPUs it
# splits each array across its replicas, and slicing each leaf compiles a small program (a training test's
# checkpoint: ~110 compiles, 7 of its 32 s).
import orbax.checkpoint as ocp  # noqa: E402

ocp.type_handlers.register_type_handler(
    jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False), override=True
)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import hcfjax  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
PARITY = ["tiny_v3", "tiny_v2_lite", "tiny_v2_grouped"]


@pytest.fixture(autouse=True, scope="module")
def compiled_code_freed_after_each_file():
    """Every compiled program keeps its machine code mapped: a test worker that runs half the suite passes the
    kernel's limit on memory mappings (vm.max_map_count, 65530) and XLA then crashes compiling (a segfault). jax's
    caches dropped after each file free them (22,000 mappings to 600 after two test files)."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture(autouse=True)
def persistent_cache_stays_off():
    """A test that runs `hcfjax serve` in this process (cli.main) turns jax's persistent compilation cache on for the
    whole process; the tests after it would write every executable there (and XLA:CPU crashes serializing some).
    Off again after each test."""
    yield
    if jax.config.jax_compilation_cache_dir is not None:
        from jax._src import compilation_cache

        jax.config.update("jax_compilation_cache_dir", None)
        compilation_cache.reset_cache()


@pytest.fixture(scope="session", params=PARITY)
def parity_case(request):
    """(model in float32, transformers reference arrays) for each fixture checkpoint."""
    name = request.param
    model = hcfjax.load(FIXTURES / name, dtype=jnp.float32)
    return model, dict(np.load(FIXTURES / name / "reference.npz"))


@pytest.fixture(scope="session")
def v3_model():
    return hcfjax.load(FIXTURES / "tiny_v3", dtype=jnp.float32)


def jaxpr_eqns(jaxpr, within: tuple = ()):
    """(equation, the primitives of the equations it is nested in, outermost first) for every equation of a jaxpr
    and of its sub-jaxprs (loop bodies, branches, nested calls)."""
    for eqn in jaxpr.eqns:
        yield eqn, within
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from jaxpr_eqns(inner, (*within, eqn.primitive.name))


def jit_as_eager(fn, **jit_kwargs):
    """fn jitted into one program (one compile, not one per operation) that rounds every intermediate to its dtype
    as running it op by op does: XLA otherwise may keep a bf16 intermediate in float32 (xla_allow_excess_precision),
    which changes the bits an exact comparison checks."""
    return jax.jit(fn, compiler_options={"xla_allow_excess_precision": False}, **jit_kwargs)


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def chunk_over_paged_cache(cfg, start, n, t, page_size, max_pages, cache_dtype, dtype=jnp.float32, seed=0):
    """A prefill chunk's attention inputs over a paged cache, as mla's expanded prefill sees them: rows of chunks of
    t positions (n[i] real, the rest padding) after start[i] cached tokens, pages in a random order. The prefix is
    in the cache as earlier steps wrote it, then the chunk's own latents. -> (q_nope, q_pe, ckv, kpe, ctx,
    positions, valid)."""
    from hcfjax import cache as kvcache
    from hcfjax.attention import CacheContext

    b = len(start)
    table = jnp.asarray(np.random.default_rng(seed).permutation(b * max_pages).reshape(b, max_pages), jnp.int32)
    cache = kvcache.init_cache(cfg, b * max_pages, page_size, cache_dtype)
    key = jax.random.split(jax.random.key(seed), 4)
    all_pos = jnp.broadcast_to(jnp.arange(max_pages * page_size), (b, max_pages * page_size))
    ckv_all = jax.random.normal(key[0], (*all_pos.shape, cfg.kv_lora_rank), dtype)
    kpe_all = jax.random.normal(key[1], (*all_pos.shape, cfg.qk_rope_head_dim), dtype)
    positions = jnp.asarray(start[:, None] + np.arange(t), jnp.int32)
    valid = jnp.asarray(np.arange(t)[None] < n[:, None])
    cache = kvcache.write(cache, 0, ckv_all, kpe_all, all_pos, all_pos < start[:, None], table)
    rows = np.arange(b)[:, None]
    ckv, kpe = ckv_all[rows, positions], kpe_all[rows, positions]
    cache = kvcache.write(cache, 0, ckv, kpe, positions, valid, table)
    h = cfg.num_attention_heads
    q_nope = jax.random.normal(key[2], (b, t, h, cfg.qk_nope_head_dim), dtype)
    q_pe = jax.random.normal(key[3], (b, t, h, cfg.qk_rope_head_dim), dtype)
    ctx = CacheContext(cache, table, jnp.asarray(start + n, jnp.int32), valid)
    return q_nope, q_pe, ckv, kpe, ctx, positions, valid


def make_tiling(spec):
    """A test case's int4 MoE tiling: None (the default) or Tiling's fields (bm, bn, stages[, extra keywords])."""
    from pallas_kernels.moe_int4_tiling import Tiling

    return spec if spec is None else Tiling(*spec[:3], **spec[3] if len(spec) > 3 else {})


@pytest.fixture
def reset_interpreter():
    """Clears Mosaic GPU's interpreter state after a test: a failed interpreted kernel leaves state behind."""
    yield
    from jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call import reset_gpu_interpret_mode_state

    reset_gpu_interpret_mode_state()


jax.config.update("jax_default_matmul_precision", "highest")


# `make test` runs the files on two workers (xdist --dist loadfile), which take files in collection order: the
# longest files go first so the short ones fill in at the end, instead of one long file running alone while the
# other worker idles. Seconds of each file's tests in a `make test` run (--durations=0, both workers keeping the two
# cores busy). Unlisted files are short and keep their order.
FILE_SECONDS = {
    "test_engine": 141,
    "test_pd": 96,
    "test_speculative": 75,
    "test_sharding": 72,
    "test_train_mtp": 66,
    "test_mla_kernel": 66,
    "test_quant_kernel": 61,
    "test_speculative_depths": 54,
    "test_cache": 44,
    "test_fp8_checkpoint": 42,
    "test_generate": 38,
    "test_serve_process": 37,
    "test_quant_tiling": 35,
    "test_pd_faults": 34,
    "test_http": 34,
    "test_speculative_sampling": 33,
    "test_moe_route": 29,
    "test_quant_model": 28,
    "test_soak": 25,
    "test_serve_load": 25,
    "test_multihost": 25,
    "test_checkpoint_stream": 25,
    "test_fp8_kernel": 24,
    "test_parity": 23,
    "test_int8_rows": 23,
    "test_ep": 23,
    "test_quant": 22,
    "test_forced_acceptance": 21,
    "test_bench_tools": 21,
    "test_serving": 20,
    "test_engine_link": 19,
    "test_mla_kernel_lowering": 18,
    "test_fuzz": 18,
    "test_latent_write": 16,
    "test_moe_gate": 14,
    "test_engine_memory": 14,
    "test_int8_kernel": 13,
    "test_mla_in_model": 12,
    "test_embedded": 12,
    "test_checkpoint": 11,
}


def pytest_configure(config):
    """xdist's loadfile queues the files by their number of tests unless told not to (loadscope-reorder, on by
    default), which would put a long file of few tests last; the order FILE_SECONDS gives is the one to keep."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.stem, 0))
