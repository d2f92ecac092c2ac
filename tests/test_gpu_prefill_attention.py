"""On a GPU: the fused prefill attention on cuDNN's flash attention equals the blocked jnp form at DeepSeek-V2-Lite's
attention shapes, and a model's prefill gives the same logits either way. Skipped elsewhere (the CPU suite checks
the fused form's algorithm through XLA's implementation, tests/test_cache.py); run on the GPU machine with
`JAX_PLATFORMS=cuda python -m pytest tests/test_gpu_prefill_attention.py`."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hcfjax import cache as kvcache
from hcfjax.attention import CacheContext, attend_expanded_fused, attend_expanded_paged
from hcfjax.options import Options
from tests.conftest import chunk_over_paged_cache, rel_err

pytestmark = pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN flash attention needs a GPU")


@pytest.mark.parametrize("cache_dtype", [jnp.bfloat16, jnp.int8])
def test_cudnn_fused_equals_blocked(cache_dtype):
    from hcfjax.random_model import preset_config, random_model

    cfg = preset_config("v2-lite", num_hidden_layers=1)
    model = random_model(cfg, seed=0, dtype=jnp.bfloat16)
    p = jax.tree.map(lambda a: a[0], model.params["segments"][0]["attn"])
    start = np.array([0, 1000, 4500, 0])  # a prefix of 3 blocks of 2048 keys, one not page aligned, none
    n = np.array([512, 300, 512, 0])  # a short chunk and a padding row
    q_nope, q_pe, ckv, kpe, ctx, positions, valid = chunk_over_paged_cache(
        cfg, start, n, 512, 64, 96, cache_dtype, jnp.bfloat16
    )
    fused = jax.jit(lambda *a: attend_expanded_fused(p, cfg, *a, ctx, 0, positions, "cudnn"))(q_nope, q_pe, ckv, kpe)
    blocked = jax.jit(lambda *a: attend_expanded_paged(p, cfg, *a, ctx, 0, positions))(q_nope, q_pe)
    real = np.asarray(valid)
    assert rel_err(np.asarray(fused)[real], np.asarray(blocked)[real]) < 2e-2  # bf16 probabilities either way
    assert np.all(np.asarray(fused)[~real] == 0)


def test_chunked_prefill_logits_fused_equal_blocked():
    """A 3-layer V2-Lite-shaped model prefills 3072 tokens in two chunks (the second attends over the first from
    the cache): the second chunk's logits agree between the two forms."""
    import functools

    from hcfjax.model import hidden_states, logits
    from hcfjax.random_model import preset_config, random_model

    model = random_model(preset_config("v2-lite", num_hidden_layers=3), seed=0, dtype=jnp.bfloat16)
    cfg, params = model.cfg, model.params
    ids = jnp.asarray(np.random.default_rng(1).integers(2, cfg.vocab_size, (1, 3072)), jnp.int32)
    table = jnp.arange(48, dtype=jnp.int32)[None]
    out = {}
    for mode in ("fused", "blocked"):
        fwd = jax.jit(functools.partial(hidden_states, opts=Options(prefill_attention=mode)), static_argnames=("cfg",))
        cache = kvcache.init_cache(cfg, 48, 64, jnp.bfloat16)
        for lo in (0, 1536):
            pos = jnp.arange(lo, lo + 1536)[None]
            ctx = CacheContext(cache, table, jnp.array([lo + 1536]), jnp.ones((1, 1536), bool))
            h, ctx = fwd(params, cfg, ids[:, lo : lo + 1536], pos, ctx)
            cache = ctx.cache
        out[mode] = np.asarray(logits(params, h), np.float32)
    assert rel_err(out["fused"], out["blocked"]) < 2e-2
