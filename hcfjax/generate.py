"""Batched generation: a prefill step over the ragged prompts, then the whole decode in one lax.while_loop of steps
(hcfjax.step), on one device or under the sharding plans."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hcfjax import cache as kvcache
from hcfjax.config import ModelConfig
from hcfjax.model import Model, hidden_states, logits
from hcfjax.options import DEFAULT, Options
from hcfjax.quantize import default_cache_dtype
from hcfjax.sampling import SamplingBatch, SamplingParams
from hcfjax.speculative import SpeculativeConfig
from hcfjax.step import PAD, DecodeInputs, PrefillInputs, decode_steps, empty_state, jitted_step


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


_decode = jax.jit(decode_steps, static_argnames=("cfg", "max_new_tokens", "spec", "opts"), donate_argnames=("state",))

MOCK_PROMPT = [0]  # the prompt of a mock row (a decode plan's rank short of requests)


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
    options: Options = DEFAULT,
    decode_plan=None,
    prefill_plan=None,
) -> GenerationResult:
    """Generates continuations of a ragged batch of prompts: a prefill step, then the whole decode in one jitted
    while_loop of decode steps (hcfjax.step).

    prompts: a string, a token list, or a list of either. sampling: one SamplingParams for all or one per prompt
    (default greedy). seed: each row draws from its own stream, seeded from this and its index.
    stop_token_ids: None stops at the checkpoint's eos tokens, [] never stops early.
    cache_dtype: the KV cache's dtype (default the model's, or int8 for a w4a8c8 checkpoint; jnp.int8 asks for it).
    max_prefill_tokens: prompts are prefilled in groups of rows holding at most this many (padded) tokens, which
    bounds prefill activation memory for large batches.
    speculative: draft with the checkpoint's MTP modules and verify (hcfjax.speculative.SpeculativeConfig); the
    stats then carry acceptance_per_depth and mean_accepted_length, overall and per request (and forced_acceptance
    when the config forces it: a benchmark's, not the model's).
    options: kernel or reference per op, and the kernels' variants (hcfjax.options.Options).
    decode_plan (sharding.plans.decode_plan): the batch spread over the plan's ranks in contiguous blocks, attention
    data parallel, experts over EP; ranks short of requests get mock rows, which step with the others but never
    write. prefill_plan (sharding.plans.prefill_plan): prefill under tensor parallelism, its cache then handed over.
    """
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    ids = prepare_prompts(model, prompts, max_new_tokens)
    cfg, b_real = model.cfg, len(ids)
    sampling = sampling or SamplingParams()
    per_req = sampling if isinstance(sampling, list) else [sampling] * b_real
    if len(per_req) != b_real or not all(isinstance(s, SamplingParams) for s in per_req):
        raise ValueError("sampling must be a SamplingParams or a list of one per prompt")
    stops = list(cfg.eos_token_ids if stop_token_ids is None else stop_token_ids)
    if speculative is not None and not model.params.get("mtp"):
        raise ValueError("speculative decoding needs MTP layers, and this model has none (loaded with mtp=False?)")
    k = speculative.num_draft_tokens if speculative else 0
    n_layers = cfg.num_hidden_layers + (len(model.params["mtp"]) if speculative else 0)

    ranks = 1 if decode_plan is None else decode_plan.ranks
    b = -(-b_real // ranks) * ranks  # mock rows give every rank the same number
    rows, per_req = ids + [MOCK_PROMPT] * (b - b_real), per_req + [SamplingParams()] * (b - b_real)
    lengths = np.array([len(p) for p in rows], np.int32)
    t = bucket(int(lengths.max()))
    tokens = np.zeros((b, t), np.int32)
    for i, p in enumerate(rows):
        tokens[i, : len(p)] = p
    pages = math.ceil((max(t, int(lengths.max()) + max_new_tokens + k)) / page_size)
    page_table = np.arange(b * pages, dtype=np.int32).reshape(b, pages)  # rank major: rank r's rows, its pages
    cache = kvcache.init_cache(cfg, b * pages, page_size, default_cache_dtype(model, cache_dtype), n_layers)
    state = empty_state(cfg, b, cache, speculative, model.dtype)
    sp = SamplingBatch.of(per_req)
    seeds = np.random.SeedSequence(seed).generate_state(b).astype(np.uint32)
    stop_arr = jnp.asarray(np.array(stops or [PAD], np.int32))

    t0 = time.perf_counter()
    params = model.params if prefill_plan is None else prefill_plan.place_params(model.params)
    group = max(1, max_prefill_tokens // t)
    zeros = np.zeros(b, np.int32)
    with contextlib.nullcontext() if prefill_plan is None else jax.set_mesh(prefill_plan.mesh):
        for r0 in range(0, b, group):
            part = slice(r0, r0 + group)
            pre = PrefillInputs(
                *map(jnp.asarray, (tokens[part], zeros[part], lengths[part], page_table[part])),
                jnp.arange(b)[part],
                jax.tree.map(lambda x, part=part: x[part], sp),
                jnp.asarray(seeds[part]),
                jnp.asarray(zeros[part]),
            )
            state, first, *_ = jitted_step(params, cfg, state, pre, None, speculative, options)
    first.block_until_ready()
    t1 = time.perf_counter()

    active = np.arange(b) < b_real
    if decode_plan is None:
        dec = DecodeInputs(jnp.asarray(active), jnp.asarray(page_table), sp, jnp.asarray(seeds))
        out, counts, _ = _decode(model.params, cfg, state, dec, stop_arr, max_new_tokens, speculative, options)
    else:
        put = lambda x: jax.device_put(jnp.asarray(x), decode_plan.rows())  # noqa: E731
        local_table = page_table - (np.arange(b) // (b // ranks) * (b // ranks) * pages)[:, None]
        dec = DecodeInputs(put(active), put(local_table), jax.tree.map(put, sp), put(seeds))
        params = decode_plan.place_params(model.params)
        state = decode_plan.place_state(state)  # the prefill's cache handed to the ranks owning its pages
        run = decode_plan.wrap_decode_steps(cfg, params, state, max_new_tokens, speculative, options)
        out, counts, _ = run(params, state, dec, stop_arr)
        if not out.is_fully_addressable:  # multi-process: every process gets all rows
            from jax.experimental import multihost_utils

            out, counts = multihost_utils.process_allgather((out, counts), tiled=True)
    out, counts = np.asarray(out)[:b_real], {name: np.asarray(c)[:b_real] for name, c in counts.items()}
    t2 = time.perf_counter()

    result = [[int(x) for x in row[:c]] for row, c in zip(out, counts["count"], strict=True)]
    n_new = sum(len(r) for r in result)
    text = None
    if model.tokenizer is not None:
        text = [model.tokenizer.decode([x for x in r if x not in stops]) for r in result]
    n_prompt = int(lengths[:b_real].sum())
    stats = {
        "batch": b_real,
        "prompt_tokens": n_prompt,
        "new_tokens": n_new,
        "prefill_s": t1 - t0,
        "decode_s": t2 - t1,
        "prefill_tokens_per_s": n_prompt / (t1 - t0),
        "decode_tokens_per_s": (n_new - b_real) / (t2 - t1) if n_new > b_real else 0.0,
        **(speculative_stats(counts) if speculative is not None else {}),
    }
    if speculative is not None and speculative.forced_acceptance is not None:
        stats["forced_acceptance"] = list(speculative.forced_acceptance)  # benchmark only: not the model's acceptance
    if decode_plan is not None:
        stats.update(ranks=ranks, mock_rows=b - b_real)
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
