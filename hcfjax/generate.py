"""Batched generation: one jitted prefill over the ragged prompts, then the whole decode in one lax.while_loop."""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hcfjax import cache as kvcache
from hcfjax.attention import CacheContext
from hcfjax.config import ModelConfig
from hcfjax.model import Model, hidden_states, logits
from hcfjax.quantize import default_cache_dtype
from hcfjax.sampling import SamplingBatch, SamplingParams, sample
from hcfjax.speculative import SpeculativeConfig, speculative_decode

PAD = -1  # marks unused slots of the output buffer


@dataclasses.dataclass
class GenerationResult:
    tokens: list[list[int]]  # generated tokens only, one list per prompt (a stop token, if hit, is the last one)
    text: list[str] | None  # decoded generated text (None without a tokenizer)
    stats: dict


def prepare_prompts(model: Model, prompts, max_new_tokens: int) -> list[list[int]]:
    """Strings or token lists (or one of either) -> validated token lists."""
    if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of strings or token-id lists")
    cfg = model.cfg
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if not p:
                raise ValueError(f"prompt {i} is empty")
            if model.tokenizer is None:
                raise ValueError("string prompts need a tokenizer, and this model has none (pass token ids)")
            ids = model.tokenizer.encode(p).ids
            if cfg.bos_token_id is not None and (not ids or ids[0] != cfg.bos_token_id):
                ids = [cfg.bos_token_id] + ids
        else:
            ids = [int(t) for t in np.asarray(p).reshape(-1)] if len(p) else []
        if not ids:
            raise ValueError(f"prompt {i} is empty")
        bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {cfg.vocab_size})")
        if len(ids) + max_new_tokens > cfg.max_position_embeddings:
            raise ValueError(
                f"prompt {i} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} that exceeds "
                f"the model's context of {cfg.max_position_embeddings}"
            )
        out.append(ids)
    return out


def bucket(n: int, minimum: int = 16) -> int:
    """Next power of two: prompt lengths share compiled shapes."""
    return max(minimum, 1 << (n - 1).bit_length())


@functools.partial(jax.jit, static_argnames=("cfg", "return_hidden"), donate_argnames=("cache",))
def prefill(
    params, cfg: ModelConfig, tokens, lengths, cache, page_table, sp: SamplingBatch, key, return_hidden: bool = False
):
    """tokens [B, T] (right-padded to lengths [B]) -> (first generated token [B], cache with the prompts), and the
    final-normed hidden states [B, T, D] when return_hidden (speculative decoding drafts from them)."""
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    ctx = CacheContext(cache, page_table, lengths, positions < lengths[:, None])
    h, ctx = hidden_states(params, cfg, tokens, positions, ctx, absorbed=False)
    last = h[jnp.arange(b), lengths - 1]  # [B, D]
    first = sample(logits(params, last), sp, key)
    return (first, ctx.cache, h) if return_hidden else (first, ctx.cache)


def decode_loop(
    params,
    cfg: ModelConfig,
    first,
    lengths,
    cache,
    page_table,
    sp: SamplingBatch,
    key,
    stop_ids,
    max_new_tokens: int,
    idle=None,
    experts_fn=None,
    axis: str | None = None,
):
    """Decodes up to max_new_tokens per row in one while_loop (absorbed MLA over the paged cache).

    first [B] is the token sampled at prefill; rows stop at a token in stop_ids [S] (padded with PAD).
    idle [B] marks mock rows, which never write the cache. Under a data-parallel plan (axis set, inside shard_map)
    every rank keeps stepping until all ranks are done, since the MoE exchange needs all of them each step.
    Returns (tokens [B, max_new_tokens] with PAD after a row stops, cache).
    """
    b = first.shape[0]
    out = jnp.full((b, max_new_tokens), PAD, jnp.int32).at[:, 0].set(first)
    done = jnp.isin(first, stop_ids) | (False if idle is None else idle)
    if axis is not None:
        key = jax.random.fold_in(key, jax.lax.axis_index(axis))

    def cond(state):
        i, _, done, _, _ = state
        running = jnp.sum(~done)
        if axis is not None:
            running = jax.lax.psum(running, axis)  # all ranks agree on the number of live requests
        return (i < max_new_tokens) & (running > 0)

    def body(state):
        i, out, done, cache, key = state
        key, sub = jax.random.split(key)
        tok = out[:, i - 1]
        pos = (lengths + i - 1)[:, None]  # [B, 1]
        ctx = CacheContext(cache, page_table, lengths + i, ~done[:, None])
        h, ctx = hidden_states(params, cfg, tok[:, None], pos, ctx, absorbed=True, experts_fn=experts_fn)
        nxt = sample(logits(params, h[:, 0]), sp, sub)
        out = out.at[:, i].set(jnp.where(done, PAD, nxt))
        return i + 1, out, done | jnp.isin(nxt, stop_ids), ctx.cache, key

    _, out, _, cache, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), out, done, cache, key))
    return out, cache


decode = jax.jit(decode_loop, static_argnames=("cfg", "max_new_tokens"), donate_argnames=("cache",))


@functools.partial(jax.jit, static_argnames=("cfg",))
def _forward(params, cfg: ModelConfig, tokens):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    h, _ = hidden_states(params, cfg, tokens, positions)
    return logits(params, h)


def forward(model: Model, tokens) -> jax.Array:
    """Teacher-forced logits: tokens [B, T] (or [T]) -> float32 logits [B, T, V] (expanded MLA, no cache)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    tokens = tokens[None] if tokens.ndim == 1 else tokens
    if tokens.ndim != 2 or tokens.shape[1] == 0:
        raise ValueError(f"tokens must be [B, T] with T >= 1, got shape {tokens.shape}")
    if tokens.shape[1] > model.cfg.max_position_embeddings:
        raise ValueError(f"{tokens.shape[1]} tokens exceed the context of {model.cfg.max_position_embeddings}")
    return _forward(model.params, model.cfg, tokens)


def generate(
    model: Model,
    prompts,
    max_new_tokens: int = 64,
    sampling: SamplingParams | list | None = None,
    seed: int = 0,
    stop_token_ids: Sequence[int] | None = None,
    page_size: int = 64,
    cache_dtype=None,
    max_prefill_tokens: int = 16384,
    speculative: SpeculativeConfig | None = None,
) -> GenerationResult:
    """Generates continuations of a ragged batch of prompts.

    prompts: a string, a token list, or a list of either. sampling: one SamplingParams for all or one per prompt
    (default greedy). stop_token_ids: None stops at the checkpoint's eos tokens, [] never stops early.
    cache_dtype: the KV cache's dtype (default the model's, or int8 for a w4a8c8 checkpoint; jnp.int8 asks for it).
    max_prefill_tokens: prompts are prefilled in groups of rows holding at most this many (padded) tokens, which
    bounds prefill activation memory for large batches.
    speculative: draft with the checkpoint's MTP modules and verify (hcfjax.speculative.SpeculativeConfig); the
    stats then carry acceptance_per_depth and mean_accepted_length, overall and per request.
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    ids = prepare_prompts(model, prompts, max_new_tokens)
    b = len(ids)
    sampling = sampling or SamplingParams()
    per_req = sampling if isinstance(sampling, list) else [sampling] * b
    if len(per_req) != b or not all(isinstance(s, SamplingParams) for s in per_req):
        raise ValueError("sampling must be a SamplingParams or a list of one per prompt")
    stops = list(model.cfg.eos_token_ids if stop_token_ids is None else stop_token_ids)
    cfg = model.cfg
    if speculative is not None and not model.params.get("mtp"):
        raise ValueError("speculative decoding needs MTP layers, and this model has none (loaded with mtp=False?)")
    k = speculative.num_draft_tokens if speculative else 0
    n_layers = cfg.num_hidden_layers + (len(model.params["mtp"]) if speculative else 0)

    lengths = np.array([len(p) for p in ids], np.int32)
    t = bucket(int(lengths.max()))
    tokens = np.zeros((b, t), np.int32)
    for i, p in enumerate(ids):
        tokens[i, : len(p)] = p
    pages_per_seq = math.ceil((max(t, int(lengths.max()) + max_new_tokens + k)) / page_size)
    page_table = np.arange(b * pages_per_seq, dtype=np.int32).reshape(b, pages_per_seq)
    dtype = default_cache_dtype(model, cache_dtype)
    cache = kvcache.init_cache(cfg, b * pages_per_seq, page_size, dtype, num_layers=n_layers)
    sp = SamplingBatch.of(per_req)
    k_prefill, k_decode = jax.random.split(jax.random.key(seed))
    stop_arr = jnp.asarray(np.array(stops or [PAD], np.int32))

    t0 = time.perf_counter()
    rows = max(1, max_prefill_tokens // t)
    firsts, hiddens = [], []
    for r0 in range(0, b, rows):
        part = slice(r0, r0 + rows)
        f, cache, *h = prefill(
            model.params,
            cfg,
            jnp.asarray(tokens[part]),
            jnp.asarray(lengths[part]),
            cache,
            jnp.asarray(page_table[part]),
            jax.tree.map(lambda x, part=part: x[part], sp),
            jax.random.fold_in(k_prefill, r0),
            return_hidden=speculative is not None,
        )
        firsts.append(f)
        hiddens += h
    first = jnp.concatenate(firsts)
    first.block_until_ready()
    t1 = time.perf_counter()
    args = (jnp.asarray(lengths), cache, jnp.asarray(page_table), sp, k_decode, stop_arr, max_new_tokens)
    spec_stats = {}
    if speculative is None:
        out, cache = decode(model.params, cfg, first, *args)
        out = np.asarray(out)
        result = [[int(x) for x in row if x != PAD] for row in out]
    else:
        h = jnp.concatenate(hiddens)
        out, counts, cache = speculative_decode(model.params, cfg, speculative, h, jnp.asarray(tokens), first, *args)
        out, counts = np.asarray(out), jax.tree.map(np.asarray, counts)
        result = [[int(x) for x in row[:c]] for row, c in zip(out, counts["count"], strict=True)]
        spec_stats = speculative_stats(counts)
    t2 = time.perf_counter()

    n_new = sum(len(r) for r in result)
    text = None
    if model.tokenizer is not None:
        text = [model.tokenizer.decode([x for x in r if x not in stops]) for r in result]
    stats = {
        "batch": b,
        "prompt_tokens": int(lengths.sum()),
        "new_tokens": n_new,
        "prefill_s": t1 - t0,
        "decode_s": t2 - t1,
        "prefill_tokens_per_s": float(lengths.sum()) / (t1 - t0),
        "decode_tokens_per_s": (n_new - b) / (t2 - t1) if n_new > b else 0.0,
        **spec_stats,
    }
    return GenerationResult(result, text, stats)


def speculative_stats(counts: dict) -> dict:
    """Acceptance per depth (conditional on earlier depths) and tokens emitted per target forward, overall and per
    request, from the per-row counters of speculative_decode."""

    def summarise(steps, evaluated, accepted, emitted):
        return {
            "acceptance_per_depth": [float(a / e) if e else 0.0 for a, e in zip(accepted, evaluated, strict=True)],
            "mean_accepted_length": float(emitted / steps) if steps else 0.0,
            "verify_steps": int(steps),
        }

    emitted = counts["count"] - 1  # the first token comes from prefill
    overall = summarise(counts["steps"].sum(), counts["evaluated"].sum(0), counts["accepted"].sum(0), emitted.sum())
    per_request = [
        summarise(*row) for row in zip(counts["steps"], counts["evaluated"], counts["accepted"], emitted, strict=True)
    ]
    return {**overall, "per_request": per_request}
