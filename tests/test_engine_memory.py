"""The KV page pool sized to the device's memory, and the check that the compiled steps' temporaries fit beside it.
The CPU reports no allocator limit, so the engine tests hand the engine a device that does (a stand-in for
`memory.device_memory`); the sizes themselves are checked against the arrays the engine allocates."""

import dataclasses
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import hcfjax
from hcfjax.cache import init_cache
from hcfjax.engine import Engine, EngineConfig, memory
from hcfjax.engine.memory import DeviceMemory, GiB, check_steps_fit, fit_pages, page_bytes
from hcfjax.kernels import engine_summary


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.int8])
def test_page_bytes_are_what_the_cache_allocates(dtype):
    cfg = hcfjax.load(dtype=jnp.float32).cfg
    cache = init_cache(cfg, 7, 16, dtype, num_layers=3)
    held = cache.kv.nbytes + (0 if cache.scale is None else cache.scale.nbytes)
    assert page_bytes(cfg.kv_dim, 3, 16, dtype) * 7 == held


def test_pages_fit_the_limit_after_weights_and_the_steps_share():
    mem = DeviceMemory("gpu:0", limit=100 * GiB, in_use=20 * GiB)
    per_page = GiB // 4
    # free: 100 - 20 in use - 10 (STEP_RESERVE) = 70 GiB, 280 pages
    assert fit_pages(1000, False, per_page, mem, 0, 10) == 280
    assert fit_pages(1000, False, per_page, mem, 5 * GiB, 10) == 280  # loading weights, already in use in part
    assert fit_pages(1000, False, per_page, mem, 30 * GiB, 10) == 240  # loading more than is in use: 60 GiB free
    assert fit_pages(200, False, per_page, mem, 0, 10) == 200
    assert fit_pages(200, True, per_page, mem, 0, 10) == 200
    assert fit_pages(10**6, False, per_page, None, 0, 10) == 10**6  # no limit reported (CPU): as configured
    with pytest.raises(
        ValueError, match=r"1000 pages of KV cache \(250.0 GiB\) do not fit.*room for 280 pages.*--num-pages"
    ):
        fit_pages(1000, True, per_page, mem, 0, 10)
    with pytest.raises(ValueError, match=r"not even one request at the longest length.*--max-model-len"):
        fit_pages(1000, False, per_page, mem, 0, 281)
    # the pool is one array: where what is in use split the free memory, its largest free block bounds it
    split = dataclasses.replace(mem, largest_free=50 * GiB)
    assert fit_pages(1000, False, per_page, split, 0, 10) == 200
    assert fit_pages(200, True, per_page, split, 0, 10) == 200
    with pytest.raises(ValueError, match=r"its largest free block 50.0 GiB \(room for 200 pages\)"):
        fit_pages(201, True, per_page, split, 0, 10)
    assert fit_pages(1000, False, per_page, dataclasses.replace(mem, largest_free=90 * GiB), 0, 10) == 280


def test_the_largest_free_block_counts_only_where_the_allocator_reserved_its_limit():
    class Device:
        def __init__(self, stats):
            self.stats = stats

        def memory_stats(self):
            return self.stats

        def __str__(self):
            return "gpu:0"

    stats = {"bytes_limit": 100, "bytes_in_use": 20, "largest_free_block_bytes": 30}
    assert memory.device_memory(Device({**stats, "pool_bytes": 100})) == DeviceMemory("gpu:0", 100, 20, 30)
    assert memory.device_memory(Device({**stats, "pool_bytes": 40})) == DeviceMemory("gpu:0", 100, 20, None)
    assert memory.device_memory(Device({"bytes_limit": 100, "bytes_in_use": 20})) == DeviceMemory("gpu:0", 100, 20)
    assert memory.device_memory(Device(None)) is None


def test_steps_must_fit_beside_the_cache():
    mem = DeviceMemory("gpu:0", limit=100 * GiB, in_use=90 * GiB)
    check_steps_fit([GiB, 10 * GiB], mem, 0, 100, GiB // 4)
    check_steps_fit([], mem, 0, 100, GiB // 4)
    check_steps_fit([10**15], None, 0, 100, GiB // 4)
    with pytest.raises(ValueError, match=r"need 11.0 GiB of temporaries.*10.0 GiB left.*100 pages, 25.0 GiB"):
        check_steps_fit([GiB, 11 * GiB], mem, 0, 100, GiB // 4)
    loading = DeviceMemory("gpu:0", limit=100 * GiB, in_use=40 * GiB)  # the cache and part of the weights
    check_steps_fit([5 * GiB], loading, 70 * GiB, 20, GiB // 4)  # 70 + 5 GiB of cache: 25 left
    with pytest.raises(ValueError, match=r"need 26.0 GiB.*25.0 GiB left"):
        check_steps_fit([26 * GiB], loading, 70 * GiB, 20, GiB // 4)


def test_engine_pool_and_warm_up_on_a_device_with_a_limit(monkeypatch):
    """A device whose allocator holds the weights and 40 pages beyond its reserve: a derived pool that fits keeps
    its size, a larger one shrinks to 40 pages, an explicit one that does not fit is refused; warm-up refuses to
    finish when the steps' temporaries exceed what is left beside the weights and the cache."""
    model = hcfjax.load(dtype=jnp.float32)
    weights = memory.tree_bytes(model.params)
    config = EngineConfig(max_slots=4, token_budget=16, max_prefill_rows=1, page_size=16, max_model_len=256)
    per_page = page_bytes(model.cfg.kv_dim, model.cfg.num_hidden_layers, 16, model.dtype)
    limit = int((weights + 40.5 * per_page) / (1 - memory.STEP_RESERVE))
    in_use = [weights]
    monkeypatch.setattr(memory, "device_memory", lambda device: DeviceMemory(str(device), limit, in_use[0]))

    # 17 pages a request at max_model_len: 4 slots derive 34 pages, 16 slots 136
    engine = Engine(model, config)
    assert engine.total_pages == 34 and engine.runner.state.cache.kv.shape[1] == 34
    assert "float32 KV cache of 34 pages of 16 (544 tokens, " in engine_summary(engine)  # what `serve` prints
    assert Engine(model, dataclasses.replace(config, max_slots=16)).total_pages == 40
    assert Engine(model, dataclasses.replace(config, num_pages=40)).total_pages == 40
    assert Engine(model, dataclasses.replace(config, dp=2)).total_pages == 40  # two ranks on one device: 20 each
    with pytest.raises(ValueError, match="41 pages of KV cache.*room for 40 pages.*--num-pages"):
        Engine(model, dataclasses.replace(config, num_pages=41))

    in_use[0] = weights + 34 * per_page  # the engine's cache is allocated
    left = limit - in_use[0]
    temps = [left]
    monkeypatch.setattr(engine.runner, "temp_bytes", lambda: temps)
    engine.warmup()  # exactly what is left: fits
    temps[:] = [left + 1]
    with pytest.raises(ValueError, match="temporaries"):
        engine.warmup()
    # what the check reads: XLA's memory analysis of every compiled step
    measured = type(engine.runner).temp_bytes(engine.runner)
    assert len(measured) == len(engine.runner.executables) >= 2 and all(t > 0 for t in measured)


def test_a_derived_int8_pool_steps_past_the_cache_writes_window(monkeypatch):
    """An int8 cache array of 2-4 GiB is one the cache-write kernel cannot address (its offsets would wrap): a
    derived pool there grows just past 4 GiB where decode steps would write on the kernel (then fit_pages trims it
    to the memory as ever). Not outside the window, nor where the kernel would not write: the write off, MLA on
    XLA, float32 activations. The engine asks for every derived int8 pool, never for a size the user gave or a
    float cache."""
    from hcfjax.options import Options
    from hcfjax.random_model import preset_config

    v2 = preset_config("v2-lite")
    on = Options(fused_cache_write=True, mla="interpret")  # (on a GPU: the defaults)
    grow = lambda pages, ranks=1, dtype=jnp.bfloat16, opts=on: memory.past_write_window(  # noqa: E731
        pages, v2, 27, 64, ranks, dtype, opts
    )
    entry = 27 * 64 * 576  # a page's int8 entries over V2-Lite's layers: 64 slots at 8k derive 4,128 pages
    assert grow(4128) == 4316 and 4315 * entry <= 2**32 < 4316 * entry
    assert grow(2064, ranks=2) == 2158 and 2 * 2157 * entry <= 2**32 < 2 * 2158 * entry  # two ranks, one array
    assert grow(2000) == 2000 and grow(5000) == 5000  # 32-bit offsets reach it; past 4 GiB, 64-bit ones
    assert grow(4128, opts=Options(fused_cache_write=False, mla="interpret")) == 4128
    assert grow(4128, opts=Options(fused_cache_write=True, mla="reference")) == 4128
    assert grow(4128, dtype=jnp.float32) == 4128

    asked = []

    def spy(pages, cfg, layers, page_size, ranks, dtype, opts):
        asked.append((pages, layers, page_size, ranks, dtype, opts))
        return pages + 3

    monkeypatch.setattr(memory, "past_write_window", spy)
    model = hcfjax.load(dtype=jnp.float32)
    layers = model.cfg.num_hidden_layers
    config = EngineConfig(max_slots=4, token_budget=16, max_prefill_rows=1, page_size=16, max_model_len=256)
    int8 = dataclasses.replace(config, cache_dtype="int8", options=on)
    assert Engine(model, int8).total_pages == 34 + 3  # 17 pages a request at max_model_len, 4 slots
    assert asked == [(34, layers, 16, 1, model.dtype, on)]
    assert Engine(model, dataclasses.replace(int8, dp=2)).total_pages == 2 * (34 + 3)  # two ranks in one array
    assert asked[-1][:4] == (34, layers, 16, 2)
    for other in (dataclasses.replace(int8, num_pages=34), dataclasses.replace(int8, cache_dtype="float"), config):
        assert Engine(model, other).total_pages == 34
    assert len(asked) == 2


def test_serve_refuses_a_pool_or_steps_that_do_not_fit():
    """`hcfjax serve` on a device stand-in (its own process, as a user runs it): an explicit --num-pages past what
    fits, and steps whose temporaries do not fit after warm-up, end the command with exit 2 and the sizes before it
    listens."""
    model = hcfjax.load(dtype=jnp.bfloat16)  # what `serve` loads by default
    weights = memory.tree_bytes(model.params)
    per_page = page_bytes(model.cfg.kv_dim, model.cfg.num_hidden_layers, 16, jnp.bfloat16)
    limit = int((weights + 40.5 * per_page) / (1 - memory.STEP_RESERVE))
    args = ["serve", "--port", "0", "--page-size", "16", "--max-model-len", "256", "--compile-cache", "off"]
    args += ["--max-slots", "1", "--token-budget", "16", "--max-prefill-rows", "1"]  # few shapes to warm up

    def serve(num_pages: int, temps: str = "") -> subprocess.CompletedProcess:
        script = (
            "import sys\nfrom hcfjax import cli\nfrom hcfjax.engine import memory, runner\n"
            f"memory.device_memory = lambda device: memory.DeviceMemory('gpu:0', {limit}, 0)\n{temps}"
            f"sys.exit(cli.main({[*args, '--num-pages', str(num_pages)]!r}))\n"
        )
        return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)

    refused = serve(41)
    assert refused.returncode == 2, refused.stderr
    assert "error: 41 pages of KV cache" in refused.stderr and "room for 40 pages" in refused.stderr
    assert "--num-pages" in refused.stderr

    too_big = serve(40, f"runner.ModelRunner.temp_bytes = lambda self: [{limit}]\n")
    assert too_big.returncode == 2, too_big.stderr
    assert "temporaries" in too_big.stderr and "listening" not in too_big.stdout


def test_a_pool_the_device_cannot_allocate_fails_the_engine_not_its_first_step(monkeypatch):
    """A device allocates asynchronously: a pool it cannot hold comes back as a placeholder whose error surfaces at
    the first step. The engine waits for its pool and says what did not fit; other errors pass through."""
    model = hcfjax.load(dtype=jnp.float32)
    config = EngineConfig(max_slots=2, token_budget=16, max_prefill_rows=1, page_size=16, max_model_len=64)
    failure = [jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 30.49GiB")]

    def block_until_ready(tree):
        raise failure[0]

    monkeypatch.setattr(memory.jax, "block_until_ready", block_until_ready)
    with pytest.raises(ValueError, match=r"the KV cache \(5 pages, .*\) does not fit.*30.49GiB.*--num-pages"):
        Engine(model, config)
    failure[0] = jax.errors.JaxRuntimeError("INTERNAL: something else")
    with pytest.raises(jax.errors.JaxRuntimeError, match="something else"):
        Engine(model, config)
    monkeypatch.undo()
    assert Engine(model, config).runner.state.cache.kv.shape[1] == 5


def test_the_prefill_workers_scratch_pages_must_fit_its_device(monkeypatch):
    """A PD prefill worker's scratch pages (--prefill-pages) are checked against its device like the engine's pool:
    what fits is kept, what does not is refused with the sizes and the flag."""
    from hcfjax.pd.prefill import PrefillConfig, PrefillWorker
    from hcfjax.pd.transport import make_transport

    model = hcfjax.load(dtype=jnp.float32)
    weights = memory.tree_bytes(model.params)
    per_page = page_bytes(model.cfg.kv_dim, model.cfg.num_hidden_layers, 16, model.dtype)
    limit = int((weights + 40.5 * per_page) / (1 - memory.STEP_RESERVE))
    monkeypatch.setattr(memory, "device_memory", lambda device: DeviceMemory(str(device), limit, weights))
    sender = make_transport("socket").sender()
    worker = PrefillWorker(model, sender, PrefillConfig(num_pages=40, page_size=16))
    assert worker.cache.kv.shape[1] == 41  # its pages and the padding page
    with pytest.raises(ValueError, match="41 pages of KV cache.*room for 40 pages.*--prefill-pages"):
        PrefillWorker(model, sender, PrefillConfig(num_pages=41, page_size=16))
