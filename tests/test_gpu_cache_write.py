"""On a GPU: a decode step's cache write from kv_a's split-K partials (quant.linear_partials into the latent-write
kernel) leaves the int8 cache bit for bit as the write from the summed product does, at DeepSeek-V2-Lite's and V3's
kv_a (4 and 14 splits at batch 64): XLA's sum of the partials and the kernel's add in the same order. Skipped
elsewhere (the CPU suite checks the same in interpret mode, tests/test_latent_write.py); run on the GPU machine with
`JAX_PLATFORMS=cuda python -m pytest tests/test_gpu_cache_write.py`."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hcfjax import attention, quant
from hcfjax import cache as kvcache
from hcfjax.attention import CacheContext
from hcfjax.options import Options
from hcfjax.random_model import preset_config
from pallas_kernels.moe_fp8 import int8_tiling

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="the Mosaic GPU kernels need a GPU")


@pytest.mark.parametrize("d", [2048, 7168])
@pytest.mark.parametrize("b", [64, 2])
def test_partials_write_the_summed_products_entries(d, b, monkeypatch):
    cfg = dataclasses.replace(preset_config("v2-lite"), hidden_size=d)
    c, r, page = cfg.kv_lora_rank, cfg.qk_rope_head_dim, 64
    keys = jax.random.split(jax.random.key(d + b), 3)
    p = {
        "kv_a": quant.quantize(jax.random.normal(keys[0], (d, c + r)) / 32, bits=8, act="int8"),
        "kv_a_norm": (1 + jax.random.normal(keys[1], (c,)) / 10).astype(jnp.bfloat16),
    }
    pages = b
    cache = kvcache.KVCache(jnp.zeros((2, pages, page, c + r), jnp.int8), jnp.zeros((2, pages, 2, page), jnp.float32))
    table = jnp.arange(pages, dtype=jnp.int32).reshape(b, 1)
    positions = (jnp.arange(b, dtype=jnp.int32) % page).reshape(b, 1)
    ctx = CacheContext(cache, table, positions[:, 0] + 1, jnp.ones((b, 1), bool))
    x = jax.random.normal(keys[2], (b, 1, d)).astype(jnp.bfloat16)
    opts = Options(mla="kernel", moe="kernel", fused_cache_write=True)
    assert int8_tiling(b, 1, c + r, d).splits > 1
    write = jax.jit(lambda p, x, ctx: attention.write_new_latents(p, cfg, x, positions, ctx, 1, opts))
    got = write(p, x, ctx)
    monkeypatch.setattr(attention, "linear_partials", lambda *a, **k: None)
    want = jax.jit(lambda p, x, ctx: attention.write_new_latents(p, cfg, x, positions, ctx, 1, opts))(p, x, ctx)
    assert (np.asarray(want.kv) != 0).any(-1).sum() == b
    np.testing.assert_array_equal(np.asarray(got.kv), np.asarray(want.kv))
    np.testing.assert_array_equal(np.asarray(got.scale), np.asarray(want.scale))
