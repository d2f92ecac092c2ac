"""Multi-head latent attention (MLA) in its two equivalent forms.

expanded (prefill): K and V are up-projected from the latent per head and attention runs over H heads of
                    qk_head_dim / v_head_dim, as in the paper.
absorbed (decode):  W_UK is folded into the query and attention runs in the C-wide latent space directly over the
                    cached c_kv, with W_UV applied after; per step it reads only the latent cache.

Dimension letters: B batch, T query tokens, S key tokens, D hidden, H heads, N qk_nope, R rope, C kv_lora, V v_head.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hcfjax import cache as kvcache
from hcfjax.config import ModelConfig
from hcfjax.fp8 import Fp8Weight
from hcfjax.layers import StackRow, apply_rope, rms_norm, rope_table
from hcfjax.options import DEFAULT, Options, on_gpu
from hcfjax.quant import QWeight, linear, linear_partials
from pallas_kernels import latent_write
from pallas_kernels.mla_decode import (
    MlaPlan,
    converters_apply,
    kernel_applies,
    mla_decode,
    mla_decode_reference,
    mla_plan,
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class CacheContext:
    """What a cached forward needs besides the tokens: the cache and the batch's view of it."""

    cache: kvcache.KVCache
    page_table: jax.Array  # [B, max_pages] int32
    kv_len: jax.Array  # [B] tokens in the cache after this step (keys at positions >= kv_len are masked)
    valid: jax.Array  # [B, T] bool: which query tokens are real (others write nothing)
    plan: MlaPlan | None = None  # the MLA kernel's work list for this forward (with_decode_plan), read by every layer
    rope_table: tuple[jax.Array, jax.Array] | None = None  # layers.rope_table at this forward's positions


def decode_mode(cfg: ModelConfig, cache: kvcache.KVCache, page_table, kv_len, queries: tuple[int, int], opts) -> str:
    """'kernel', 'interpret' or 'reference': what the absorbed attention over the paged cache runs for B x T
    queries (opts.mode, where the MLA kernel applies to these shapes)."""
    b, t = queries
    h = cfg.num_attention_heads
    q_nope = jax.ShapeDtypeStruct((b, t, h, cfg.kv_lora_rank), jnp.bfloat16)
    q_pe = jax.ShapeDtypeStruct((b, t, h, cfg.qk_rope_head_dim), jnp.bfloat16)
    applies = kernel_applies(q_nope, q_pe, cache.kv, page_table, kv_len, cache.scale, cfg.kv_lora_rank, 0)
    return opts.mode("mla", applies)


def with_decode_plan(
    cfg: ModelConfig, ctx: CacheContext | None, positions: jax.Array, opts: Options = DEFAULT
) -> CacheContext | None:
    """ctx with the MLA decode kernel's plan for queries at positions [B, T] when the kernel will run: it depends
    only on the lengths, positions and shapes, so one plan serves every layer of the forward (its head count only
    sizes the splits). Unchanged otherwise."""
    if ctx is None or ctx.plan is not None:
        return ctx
    if decode_mode(cfg, ctx.cache, ctx.page_table, ctx.kv_len, positions.shape, opts) == "reference":
        return ctx
    b, t = positions.shape
    plan = mla_plan(
        ctx.kv_len, ctx.page_table.shape[1], ctx.cache.page_size, cfg.num_attention_heads, t, positions=positions
    )
    return dataclasses.replace(ctx, plan=plan)


def per_head(x: jax.Array, w, heads: int, opts: Options = DEFAULT, x_q=None) -> jax.Array:
    """x [B, T, I] through a per-head projection -> [B, T, H, K]: w [I, H, K], or a quantised weight (QWeight or
    Fp8Weight) of [I, H*K] (one linear, its output split into heads; x_q: x quantised, for `linear`)."""
    if isinstance(w, (QWeight, Fp8Weight)):
        return linear(x, w, opts, x_q).reshape(*x.shape[:-1], heads, -1)
    return jnp.einsum("BTI,IHK->BTHK", x, w)


def out_proj(out: jax.Array, w, cfg: ModelConfig, opts: Options = DEFAULT) -> jax.Array:
    """Attention output [B, T, H, V] through o [H*V, D] (an array, a QWeight or an Fp8Weight) -> [B, T, D]."""
    if isinstance(w, (QWeight, Fp8Weight)):
        return linear(out.reshape(*out.shape[:-2], -1), w, opts)
    return jnp.einsum("BTHV,HVD->BTD", out, w.reshape(cfg.num_attention_heads, cfg.v_head_dim, -1))


def project_q(
    p: dict,
    cfg: ModelConfig,
    x: jax.Array,
    positions: jax.Array,
    opts: Options = DEFAULT,
    rope_table=None,
    x_q=None,
) -> tuple[jax.Array, jax.Array]:
    """x [B, T, D] -> q_nope [B, T, H, N], q_pe [B, T, H, R] (roped; by rope_table, the positions', if given; x_q:
    x quantised, for `linear`)."""
    h = cfg.num_attention_heads
    if cfg.q_lora_rank:
        q = rms_norm(linear(x, p["q_a"], opts, x_q), p["q_a_norm"], cfg.rms_norm_eps)
        q = per_head(q, p["q_b"], h, opts)
    else:
        q = per_head(x, p["q"], h, opts, x_q)
    q_nope, q_pe = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim :]
    return q_nope, apply_rope(q_pe, positions, cfg.rope, rope_table)


def project_kv(
    p: dict,
    cfg: ModelConfig,
    x: jax.Array,
    positions: jax.Array,
    opts: Options = DEFAULT,
    rope_table=None,
    x_q=None,
) -> tuple[jax.Array, jax.Array]:
    """x [B, T, D] -> c_kv [B, T, C] (normed latent), k_pe [B, T, R] (roped, shared by all heads; as project_q)."""
    kv = linear(x, p["kv_a"], opts, x_q)
    ckv = rms_norm(kv[..., : cfg.kv_lora_rank], p["kv_a_norm"], cfg.rms_norm_eps)
    return ckv, apply_rope(kv[..., cfg.kv_lora_rank :], positions, cfg.rope, rope_table)


def latent_write_mode(cfg: ModelConfig, cache: kvcache.KVCache, x: jax.Array, opts: Options = DEFAULT) -> str:
    """Where a cached forward of tokens x [B, T, D] writes its new latents: on the latent-write kernel
    (pallas_kernels/latent_write.py: 'kernel' or 'interpret', as opts.mode("mla") says) for a decode step's bf16
    tokens into an int8 cache it addresses where opts.fused_cache_write is on, else 'reference' (project_kv, then
    cache.write: XLA)."""
    tokens, c, r = x.shape[0] * x.shape[1], cfg.kv_lora_rank, cfg.qk_rope_head_dim
    fits = cache.quantized and latent_write.applies(tokens, c, r, x.dtype, cache.kv.size)
    fits = fits and opts.on("fused_cache_write")
    return opts.mode("mla", fits) if fits else "reference"


def write_new_latents(
    p: dict, cfg: ModelConfig, x, positions, ctx: CacheContext, layer, opts: Options = DEFAULT, x_q=None
) -> kvcache.KVCache:
    """ctx's cache with the latents of tokens x [B, T, D] at positions [B, T] written in `layer` (kv_a, the norm of
    c_kv, the rope of k_pe): project_kv then cache.write, or one kernel for all of it (`latent_write_mode`)."""
    mode = latent_write_mode(cfg, ctx.cache, x, opts)
    if mode == "reference":
        ckv, kpe = project_kv(p, cfg, x, positions, opts, ctx.rope_table, x_q)
        return kvcache.write(ctx.cache, layer, ckv, kpe, positions, ctx.valid, ctx.page_table)
    kv = linear_partials(x, p["kv_a"], opts, x_q)  # the kernel adds a split-K product's partials itself
    kv = linear(x, p["kv_a"], opts, x_q) if kv is None else kv
    norm = p["kv_a_norm"]
    stack, row = (norm.stack, norm.index) if isinstance(norm, StackRow) else (norm, 0)
    table = ctx.rope_table or rope_table(positions, cfg.rope, cfg.qk_rope_head_dim)
    cache = ctx.cache
    kv_cache, scale = latent_write.write_latents(
        cache.kv, cache.scale, layer, kv, stack, row, table, positions, ctx.valid, ctx.page_table,
        eps=cfg.rms_norm_eps, interleave=cfg.rope.interleave, interpret=mode == "interpret",
    )  # fmt: skip
    return kvcache.KVCache(kv_cache, scale)


def _softmax(scores: jax.Array, mask: jax.Array) -> jax.Array:
    # A finite floor keeps rows with no visible key (mock requests) NaN-free; they are discarded anyway.
    scores = jnp.where(mask[:, None], scores, -1e30)  # mask [B, T, S] -> [B, 1, T, S]
    return jax.nn.softmax(scores, axis=-1)


def up_weights(p, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """kv_b [2, H, C, max(N, V)] (tensor_specs._kv_b), or a StackRow of it, -> W_UK [H, C, N], W_UV [H, C, V].
    From a StackRow each is one slice of the stack, which XLA's GPU backend reads in place inside the product
    where the row index comes from the layer loop's counter (model._scan_in_runs) and the half is whole (N = V);
    a slice of the row, then of its halves, makes XLA copy the row each iteration."""
    kv_b, n, v = p["kv_b"], cfg.qk_nope_head_dim, cfg.v_head_dim
    if isinstance(kv_b, StackRow):
        stack, row, (heads, c) = kv_b.stack, kv_b.index, kv_b.stack.shape[2:4]
        uk = jax.lax.dynamic_slice(stack, (row, 0, 0, 0, 0), (1, 1, heads, c, n))
        uv = jax.lax.dynamic_slice(stack, (row, 1, 0, 0, 0), (1, 1, heads, c, v))
        return uk[0, 0], uv[0, 0]
    return kv_b[0, ..., :n], kv_b[1, ..., :v]


def up_project(p, cfg: ModelConfig, ckv: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Latents [B, S, C] -> their keys' nope part [B, S, H, N] and values [B, S, H, V]."""
    w_uk, w_uv = up_weights(p, cfg)
    return jnp.einsum("BSC,HCN->BSHN", ckv, w_uk), jnp.einsum("BSC,HCV->BSHV", ckv, w_uv)


def attend_expanded(p, cfg: ModelConfig, q_nope, q_pe, ckv, kpe, mask) -> jax.Array:
    """Per-head attention with K/V up-projected from the latent.  -> [B, T, H, V]"""
    k_nope, v = up_project(p, cfg, ckv)
    scores = jnp.einsum("BTHN,BSHN->BHTS", q_nope, k_nope, preferred_element_type=jnp.float32)
    scores += jnp.einsum("BTHR,BSR->BHTS", q_pe, kpe, preferred_element_type=jnp.float32)
    probs = _softmax(scores * cfg.softmax_scale, mask).astype(v.dtype)
    return jnp.einsum("BHTS,BSHV->BTHV", probs, v)


def attend_absorbed(p, cfg: ModelConfig, q_nope, q_pe, ckv, kpe, mask) -> jax.Array:
    """Attention in the latent space: q_nope . W_UK against c_kv, then W_UV.  -> [B, T, H, V]"""
    w_uk, w_uv = up_weights(p, cfg)
    q_lat = jnp.einsum("BTHN,HCN->BTHC", q_nope, w_uk)
    scores = jnp.einsum("BTHC,BSC->BHTS", q_lat, ckv, preferred_element_type=jnp.float32)
    scores += jnp.einsum("BTHR,BSR->BHTS", q_pe, kpe, preferred_element_type=jnp.float32)
    probs = _softmax(scores * cfg.softmax_scale, mask).astype(ckv.dtype)
    o_lat = jnp.einsum("BHTS,BSC->BTHC", probs, ckv)
    return jnp.einsum("BTHC,HCV->BTHV", o_lat, w_uv)


KEY_BLOCK = 512  # keys per step of attend_expanded_paged (rounded to whole pages)


def attend_expanded_paged(
    p, cfg: ModelConfig, q_nope, q_pe, ctx: CacheContext, layer, positions, key_block: int = KEY_BLOCK
) -> jax.Array:
    """attend_expanded over the paged cache, a block of pages at a time with an online softmax (flash attention's
    recurrence), for as many blocks as the batch's longest kv_len needs: a prefill chunk reads, up-projects and
    scores only the context its rows have, never the whole page table, and never holds more than one block's
    scores. A query at positions [B, T] sees keys at positions <= its own and < kv_len. -> [B, T, H, V]"""
    cache = ctx.cache
    per_block = max(1, key_block // cache.page_size)
    keys = per_block * cache.page_size
    blocks = -(-ctx.page_table.shape[1] // per_block)
    table = jnp.pad(ctx.page_table, ((0, 0), (0, blocks * per_block - ctx.page_table.shape[1])))
    used = (jnp.max(ctx.kv_len) + keys - 1) // keys  # blocks any row needs (a dynamic trip count)
    scale = cfg.softmax_scale

    def block(i, top=None):
        """Block i's scores' row max (at least `top`), exp(scores - max) where visible (else 0), and its values."""
        pages = jax.lax.dynamic_slice_in_dim(table, i * per_block, per_block, axis=1)
        ckv, kpe = kvcache.read(cache, layer, pages, cfg.kv_lora_rank, q_nope.dtype)
        k_nope, v = up_project(p, cfg, ckv)
        scores = jnp.einsum("BTHN,BSHN->BHTS", q_nope, k_nope, preferred_element_type=jnp.float32)
        scores = (scores + jnp.einsum("BTHR,BSR->BHTS", q_pe, kpe, preferred_element_type=jnp.float32)) * scale
        key_pos = i * keys + jnp.arange(keys)[None, None, :]  # [1, 1, S]
        mask = ((key_pos <= positions[:, :, None]) & (key_pos < ctx.kv_len[:, None, None]))[:, None]  # [B,1,T,S]
        # a finite floor: a row with no visible key yet (padding, mock rows) keeps weights of exactly 0
        new_top = jnp.max(jnp.where(mask, scores, -1e30), axis=-1)
        new_top = new_top if top is None else jnp.maximum(top, new_top)
        return new_top, jnp.where(mask, jnp.exp(scores - new_top[..., None]), 0.0), v

    def weighted(probs, v):
        return jnp.einsum("BHTS,BSHV->BTHV", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)

    def step(i, carry):
        top, total, acc = carry  # running max and sum of exp [B, H, T], output [B, T, H, V] f32
        new_top, probs, v = block(i, top)
        fade = jnp.exp(top - new_top)  # the earlier blocks' weight under the new max
        return new_top, total * fade + probs.sum(-1), acc * fade.transpose(0, 2, 1)[..., None] + weighted(probs, v)

    # block 0 outside the loop: its results carry the inputs' sharding types (under shard_map), as the loop needs
    top, probs, v = block(0)
    _, total, acc = jax.lax.fori_loop(1, used, step, (top, probs.sum(-1), weighted(probs, v)))
    total = jnp.maximum(total, jnp.finfo(jnp.float32).tiny).transpose(0, 2, 1)[..., None]
    return (acc / total).astype(q_nope.dtype)


FUSED_KEY_BLOCK = 2048  # cached keys per fused attention call of attend_expanded_fused (rounded to whole pages)


def _fused_part(q, k, v, q_len, kv_len, causal: bool, scale: float, implementation: str):
    """One fused attention call (jax.nn.dot_product_attention) over q [B, T, H, K], k [B, S, H, K], v [B, S, H, V]
    for q_len / kv_len [B] real queries / keys: -> (out [B, T, H, V] f32, log-sum-exp [B, T, H] f32, a floor of
    -1e30 where a row has no key). V is padded to K's width (the call takes one head width)."""
    width = v.shape[-1]
    v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, k.shape[-1] - width)))
    out, lse = jax.nn.dot_product_attention(
        q,
        k,
        v,
        scale=scale,
        is_causal=causal,
        query_seq_lengths=jnp.maximum(q_len, 1).astype(jnp.int32),  # an empty row is computed, then dropped
        key_value_seq_lengths=jnp.maximum(kv_len, 1).astype(jnp.int32),
        implementation=implementation,
        return_residual=True,
    )
    # rows without keys, and padding queries, get no weight in a merge (and an output of 0, not whatever the call
    # left there)
    real = (jnp.arange(q.shape[1])[None] < q_len[:, None]) & (kv_len > 0)[:, None]  # [B, T]
    lse = jnp.where(real[..., None], lse.astype(jnp.float32), -1e30)
    return jnp.where(real[..., None, None], out[..., :width].astype(jnp.float32), 0.0), lse


def _merge(a, b):
    """Two attention parts' (out, log-sum-exp) over disjoint keys -> the attention over all of them."""
    (oa, la), (ob, lb) = a, b
    top = jnp.maximum(la, lb)
    wa, wb = jnp.exp(la - top), jnp.exp(lb - top)
    total = wa + wb
    return (oa * wa[..., None] + ob * wb[..., None]) / total[..., None], top + jnp.log(total)


def attend_expanded_fused(
    p,
    cfg: ModelConfig,
    q_nope,
    q_pe,
    ckv,
    kpe,
    ctx: CacheContext,
    layer,
    positions,
    implementation: str | None = None,
    key_block: int = FUSED_KEY_BLOCK,
) -> jax.Array:
    """attend_expanded_paged for a chunk whose queries sit at consecutive positions from start = positions[:, 0]
    (a prefill chunk), in fused attention calls that never write the scores out (jax.nn.dot_product_attention;
    `implementation` "cudnn": cuDNN's flash attention, None: XLA's): one causal call over the chunk's own keys
    (ckv [B, T, C], kpe [B, T, R], as the cache stores them), and one per block of cached keys before start, for
    as many blocks as the longest row's start needs; the parts are merged by their log-sum-exps. Rows have
    kv_len - start real queries. -> [B, T, H, V]"""
    cache, scale = ctx.cache, cfg.softmax_scale
    h = cfg.num_attention_heads
    q = jnp.concatenate([q_nope, q_pe], axis=-1)

    def keys_values(c, r):  # latents [B, S, C], [B, S, R] -> K [B, S, H, N + R], V [B, S, H, V]
        k_nope, v = up_project(p, cfg, c.astype(q.dtype))
        k_pe = jnp.broadcast_to(r.astype(q.dtype)[:, :, None], (*r.shape[:2], h, r.shape[-1]))
        return jnp.concatenate([k_nope, k_pe], axis=-1), v

    start = positions[:, 0]
    n = jnp.clip(ctx.kv_len - start, 0, q.shape[1])
    k, v = keys_values(*kvcache.as_stored(cache, ckv, kpe, q.dtype))
    out = _fused_part(q, k, v, n, n, True, scale, implementation)

    per_block = max(1, key_block // cache.page_size)
    block_keys = per_block * cache.page_size
    blocks = -(-ctx.page_table.shape[1] // per_block)
    table = jnp.pad(ctx.page_table, ((0, 0), (0, blocks * per_block - ctx.page_table.shape[1])))
    before = jnp.maximum(start, 0)

    def prefix_block(i, acc):
        pages = jax.lax.dynamic_slice_in_dim(table, i * per_block, per_block, axis=1)
        k, v = keys_values(*kvcache.read(cache, layer, pages, cfg.kv_lora_rank, q.dtype))
        visible = jnp.clip(before - i * block_keys, 0, block_keys)
        return _merge(acc, _fused_part(q, k, v, n, visible, False, scale, implementation))

    used = (jnp.max(before) + block_keys - 1) // block_keys  # blocks any row's prefix needs (a dynamic trip count)
    out, _ = jax.lax.fori_loop(0, used, prefix_block, out)
    return out.astype(q_nope.dtype)


def attend_absorbed_paged(
    p, cfg: ModelConfig, q_nope, q_pe, ctx: CacheContext, layer, positions, opts: Options = DEFAULT
) -> jax.Array:
    """attend_absorbed straight over the paged cache (the MLA decode kernel or its jnp reference, as
    `decode_mode` picks); a query at positions [B, T] sees keys at positions <= its own and < kv_len.
    -> [B, T, H, V]"""
    w_uk, w_uv = up_weights(p, cfg)
    cache = ctx.cache
    kw = dict(scales=cache.scale, kv_lora_rank=cfg.kv_lora_rank, positions=positions, layer=layer)
    mode = decode_mode(cfg, cache, ctx.page_table, ctx.kv_len, q_pe.shape[:2], opts)
    cache_args = (cache.kv, ctx.page_table, ctx.kv_len, cfg.softmax_scale)
    if mode == "reference":
        q_lat = jnp.einsum("BTHN,HCN->BTHC", q_nope, w_uk)
        o_lat = mla_decode_reference(q_lat, q_pe, *cache_args, **kw)
    else:
        # The product over the heads makes [H, B, T, C]; the kernel reads it so (no transpose in between).
        q_lat = jnp.einsum("BTHN,HCN->HBTC", q_nope, w_uk)
        qk8 = opts.mla_qk8 and cache.quantized
        pair = None if opts.mla_pair else False
        h, t = q_pe.shape[2], q_pe.shape[1]
        conv = opts.mla_converters and converters_apply(h, t, cache.quantized, qk8)
        kw.update(qk8=qk8, pair=pair, converters=conv, heads_first=True)
        o_lat = mla_decode(q_lat, q_pe, *cache_args, **kw, interpret=mode == "interpret", plan=ctx.plan)
    return jnp.einsum("BTHC,HCV->BTHV", o_lat, w_uv)  # o_lat [B, T, H, C]


def mla(
    p: dict,
    cfg: ModelConfig,
    x: jax.Array,
    positions: jax.Array,
    ctx: CacheContext | None,
    layer,
    absorbed: bool,
    opts: Options = DEFAULT,
    x_q=None,
) -> tuple[jax.Array, CacheContext | None]:
    """x [B, T, D] at positions [B, T] -> ([B, T, D], ctx with this layer's new entries written). x_q: x quantised
    (`quant.quantize_tokens(x)`) where the caller has it, for the int8 projections.

    Without a cache context the keys are the T tokens themselves (teacher forcing); with one, the new latents are
    written to the pages first and the keys are every cached position below kv_len (chunked prefill, decode and
    speculative verification are all this one case).
    """
    table = None if ctx is None else ctx.rope_table
    q_nope, q_pe = project_q(p, cfg, x, positions, opts, table, x_q)
    if ctx is not None and absorbed:  # the new latents go to the cache, which the attention then reads
        ctx = dataclasses.replace(ctx, cache=write_new_latents(p, cfg, x, positions, ctx, layer, opts, x_q))
        out = attend_absorbed_paged(p, cfg, q_nope, q_pe, ctx, layer, positions, opts)
        return out_proj(out, p["o"], cfg, opts), ctx
    ckv, kpe = project_kv(p, cfg, x, positions, opts, table, x_q)
    if ctx is None:
        key_pos = positions[:, None, :]  # [B, 1, S=T]
        mask = key_pos <= positions[:, :, None]
    else:
        cache = kvcache.write(ctx.cache, layer, ckv, kpe, positions, ctx.valid, ctx.page_table)
        ctx = dataclasses.replace(ctx, cache=cache)
        if opts.prefill_attention_mode() == "fused":
            impl = "cudnn" if on_gpu() else None
            out = attend_expanded_fused(p, cfg, q_nope, q_pe, ckv, kpe, ctx, layer, positions, impl)
        else:
            out = attend_expanded_paged(p, cfg, q_nope, q_pe, ctx, layer, positions)
        return out_proj(out, p["o"], cfg, opts), ctx
    attend = attend_absorbed if absorbed else attend_expanded
    out = attend(p, cfg, q_nope, q_pe, ckv, kpe, mask)  # [B, T, H, V]
    return out_proj(out, p["o"], cfg, opts), ctx
