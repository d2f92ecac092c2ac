"""What a decode step runs on this backend: the Pallas kernels or the jnp references, as the model selects them
(Options.mode, where each kernel applies to the shapes at hand). The serving command prints it at start-up and the
benchmarks put it in their headings, so that a run on the reference path is never mistaken for a kernel run."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hcfjax import cache as kvcache
from hcfjax import fp8, quant
from hcfjax.attention import decode_mode, latent_write_mode
from hcfjax.config import ModelConfig
from hcfjax.engine import memory
from hcfjax.moe import route_mode
from hcfjax.options import Options


def kernels_in_use(
    cfg: ModelConfig, params: dict, cache_dtype, page_size: int, opts: Options, cache_shape: tuple | None = None
) -> str:
    """E.g. "Pallas MLA decode, Pallas int4 grouped GEMM": decode attention over a paged cache of `cache_dtype` in
    pages of `page_size` tokens, and the routed experts of `params` (", Pallas routing" where a decode step routes
    on its kernels, Options.fused_routing; ", Pallas cache writes" where it writes its latents on theirs,
    Options.fused_cache_write, into a cache of `cache_shape` [L, P, page, C + R], one page where not given)."""
    cache = kvcache.init_cache(cfg, 1, page_size, cache_dtype, num_layers=1)
    one = jnp.zeros((1, 1), jnp.int32)
    mode = decode_mode(cfg, cache, one, one[0], (1, 1), opts)
    mla = {"kernel": "Pallas MLA decode", "reference": "jnp MLA reference"}.get(mode, f"MLA {mode}")
    w = next((seg["mlp"]["experts"]["gate"] for seg in params["segments"] if "experts" in seg["mlp"]), None)
    routing = ", Pallas routing" if w is not None and route_mode(1, w.shape[0], opts) != "reference" else ""
    if cache_shape is not None:
        cache = kvcache.KVCache(jax.ShapeDtypeStruct(cache_shape, cache.kv.dtype))
    x = jax.ShapeDtypeStruct((1, 1, cfg.hidden_size), params["embed"].dtype)
    writes = ", Pallas cache writes" if latent_write_mode(cfg, cache, x, opts) != "reference" else ""
    return f"{mla}, {_experts_in_use(w, opts)}{routing}{writes}"


def _experts_in_use(w, opts: Options) -> str:
    """What the routed experts whose gate weight is `w` run on."""
    if isinstance(w, fp8.Fp8Weight):
        on = fp8.kernel_mode(opts, w) != "reference"
        return "Pallas fp8 block-scaled GEMM" if on else "jnp fp8 block-scaled experts (XLA fp8 dots)"
    if not isinstance(w, quant.QWeight) or w.bits != 4:
        return "XLA ragged_dot experts"
    x = jax.ShapeDtypeStruct((1, w.k), jnp.bfloat16)
    return "Pallas int4 grouped GEMM" if quant._int4_mode(opts, x, w) != "reference" else "jnp int4 reference experts"


def engine_summary(engine) -> str:
    """One line on what a serving engine (hcfjax.engine.Engine) serves, its cache and what its steps run: e.g.
    "w4a8c8 weights, int8 KV cache of 1,024 pages of 64 (65,536 tokens, 1.0 GiB); decode runs Pallas MLA decode,
    Pallas int4 grouped GEMM; prefill attention fused (cuDNN flash attention)"."""
    m, c = engine.model, engine.config
    q = m.cfg.quantization
    cache = jnp.dtype(engine.runner.state.cache.kv.dtype).name
    kv = engine.runner.state.cache.kv
    kernels = kernels_in_use(m.cfg, m.params, cache, c.page_size, c.options, kv.shape)
    weights = f"{q.scheme} weights" if q is not None else f"{jnp.dtype(m.dtype).name} weights"
    if q is not None and q.fp8 is not None:
        block = "x".join(map(str, q.fp8.weight_block_size))
        weights = f"fp8 weights ({q.fp8.fmt}, {block} block scales, {q.fp8.activation_scheme} {q.fp8.fmt} activations)"
    prefill = prefill_attention(c.options)
    held = memory.size(memory.tree_bytes(engine.runner.state.cache))
    pages = engine.total_pages
    pool = f"{pages:,} pages of {c.page_size} ({pages * c.page_size:,} tokens, {held})"
    context = f"requests of up to {engine.max_model_len:,} tokens"
    context += " (what a rank's pages hold)" if engine.context_from_pages else ""
    return f"{weights}, {cache} KV cache of {pool}, {context}; decode runs {kernels}; prefill attention {prefill}"


def prefill_attention(opts: Options) -> str:
    """What a prefill chunk's attention runs (Options.prefill_attention on this backend)."""
    if opts.prefill_attention_mode() == "blocked":
        return "jnp blocked"
    return "fused (cuDNN flash attention)" if jax.default_backend() == "gpu" else "fused (XLA)"
