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
from hcfjax.detokenize import cut_at_stop
from hcfjax.frontdoor import FrontDoor, InvalidRequest, check_max_new_tokens, check_sampling, check_seed
from hcfjax.model import Model, hidden_states, logits
from hcfjax.options import DEFAULT, Options
from hcfjax.quantize import default_cache_dtype
from hcfjax.sampling import SamplingBatch, SamplingParams
from hcfjax.speculative import SpeculativeConfig
from hcfjax.step import PAD, DecodeInputs, PrefillInputs, decode_steps, empty_state, step_program


@dataclasses.dataclass
class GenerationResult:
    """tokens: the generated tokens only, one list per prompt (the stop token, or the token that completed a stop
    string, is the last one); text: their decoded text, cut before a stop string (None without a tokenizer);
    stats: timings and counts of what the device generated."""

    tokens: list[list[int]]
    text: list[str] | None
    stats: dict


def prepare_prompts(door: FrontDoor, prompts, max_new_tokens: int) -> list[list[int]]:
    """Strings or token lists (or one of either) -> token lists, each checked by the front door."""
    if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise InvalidRequest("prompts must be a non-empty list of strings or token-id lists", "prompt")
    out = []
    for i, p in enumerate(prompts):
        if not isinstance(p, str):
            p = np.asarray(p).reshape(-1).tolist() if len(p) else []
        try:
            ids = door.prompt_ids(p)
            door.fit(ids, max_new_tokens)
        except InvalidRequest as e:
            raise InvalidRequest(f"prompt {i}: {e}", e.param, e.code) from None
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
    if not isinstance(tokens, jax.Array):
        try:
            tokens = np.asarray(tokens)
        except ValueError:  # rows of different lengths
            raise ValueError("tokens must be [B, T]: rows of one length (pad them, or call once per row)") from None
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be integer ids, got {tokens.dtype}")
    tokens = tokens[None] if tokens.ndim == 1 else tokens
    if tokens.ndim != 2 or tokens.shape[0] == 0 or tokens.shape[1] == 0:
        raise ValueError(f"tokens must be [B, T] with B, T >= 1, got shape {tokens.shape}")
    if tokens.shape[1] > model.cfg.max_position_embeddings:
        raise ValueError(f"{tokens.shape[1]} tokens exceed the context of {model.cfg.max_position_embeddings}")
    if not isinstance(tokens, jax.core.Tracer):  # an id past the embedding table would be clamped, not refused
        lo, hi = (int(f(tokens)) for f in ((np.min, np.max) if isinstance(tokens, np.ndarray) else (jnp.min, jnp.max)))
        if lo < 0 or hi >= model.cfg.vocab_size:
            raise ValueError(f"token id {lo if lo < 0 else hi} is outside the vocabulary [0, {model.cfg.vocab_size})")
    tokens = tokens.astype(jnp.int32) if isinstance(tokens, jax.Array) else tokens.astype(np.int32)
    return _forward(model.params, model.cfg, tokens)  # (a host array goes in as it is: no program per shape)


@functools.cache
def _decode(xla: tuple):
    """decode_steps jitted with these XLA compiler options (as step_program)."""
    static = ("cfg", "spec", "opts", "width")
    return jax.jit(decode_steps, static_argnames=static, donate_argnames=("state",), compiler_options=dict(xla) or None)


def round_up_eighth(n: int) -> int:
    """n rounded up to a multiple of an eighth of the power of two at or below it: eight sizes per doubling, at most
    1/8 more than n."""
    step = 1 << max(0, n.bit_length() - 4)
    return -(-n // step) * step


MOCK_PROMPT = [0]  # the prompt of a mock row (a decode plan's rank short of requests, or a batch's padding)
ROW_MULTIPLE = 8  # a batch of several rows decodes in a multiple of this many rows on one device (padded_rows)


def padded_rows(b_real: int, ranks: int) -> int:
    """Rows a batch of b_real prompts decodes in over `ranks` ranks: the same number on every rank; on one device, a
    multiple of ROW_MULTIPLE where there is more than one. XLA's GPU products over a row count that is not a
    multiple of 8 fall back to slower kernels, and the mock rows that fill the batch skip the routed experts and
    write nothing. Under a decode plan the mock rows would travel the expert-parallel exchange: no more than the
    plan needs there."""
    per_rank = -(-b_real // ranks)
    if ranks == 1 and per_rank > 1:
        per_rank = -(-per_rank // ROW_MULTIPLE) * ROW_MULTIPLE
    return per_rank * ranks


def generate(
    model: Model,
    prompts,
    max_new_tokens: int = 64,
    sampling: SamplingParams | list | None = None,
    seed: int = 0,
    stop_token_ids: Sequence[int] | None = None,
    page_size: int = 64,
    stop: str | Sequence[str] | None = None,
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
    stop: strings that end a row: the device runs on, and each row's tokens and text are cut afterwards at its first
    stop string (as the engine does while streaming, hcfjax.detokenize).
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
    door = FrontDoor(model.cfg, model.tokenizer, model.cfg.max_position_embeddings)
    check_max_new_tokens(max_new_tokens)
    check_seed(seed)
    stops, stop_strings = door.stop_ids(stop_token_ids), door.stop_strings(stop)
    ids = prepare_prompts(door, prompts, max_new_tokens)
    cfg, b_real = model.cfg, len(ids)
    sampling = sampling or SamplingParams()
    per_req = sampling if isinstance(sampling, list) else [sampling] * b_real
    if len(per_req) != b_real:
        raise InvalidRequest("sampling must be a SamplingParams or a list of one per prompt", "sampling")
    for sp in per_req:
        check_sampling(sp, cfg.vocab_size)
    if speculative is not None and not model.params.get("mtp"):
        raise ValueError(
            "speculative decoding needs MTP layers, and this model has none (its checkpoint lacks them, or it was"
            " loaded with mtp=False)"
        )
    k = speculative.num_draft_tokens if speculative else 0
    n_layers = cfg.num_hidden_layers + (len(model.params["mtp"]) if speculative else 0)

    ranks = 1 if decode_plan is None else decode_plan.ranks
    b = padded_rows(b_real, ranks)
    rows, per_req = ids + [MOCK_PROMPT] * (b - b_real), per_req + [SamplingParams()] * (b - b_real)
    lengths = np.array([len(p) for p in rows], np.int32)
    t = bucket(int(lengths.max()))
    tokens = np.zeros((b, t), np.int32)
    for i, p in enumerate(rows):
        tokens[i, : len(p)] = p
    # The decode program depends on the limit and the prompts' lengths only through the output's width (a power of
    # two), t, and the cache's size rounded up to eight sizes per doubling (at most 1/8 more than it needs).
    width = bucket(max_new_tokens)
    pages = math.ceil(round_up_eighth(max(t, int(lengths.max()) + max_new_tokens + k)) / page_size)
    page_table = np.arange(b * pages, dtype=np.int32).reshape(b, pages)  # rank major: rank r's rows, its pages
    cache = kvcache.init_cache(cfg, b * pages, page_size, default_cache_dtype(model, cache_dtype), n_layers)
    state = empty_state(cfg, b, cache, speculative, model.dtype)
    sp = SamplingBatch.host(per_req)
    seeds = np.random.SeedSequence(seed).generate_state(b).astype(np.uint32)
    stop_arr = jax.device_put(np.array(sorted(stops) or [PAD], np.int32))

    t0 = time.perf_counter()
    params = model.params if prefill_plan is None else prefill_plan.place_params(model.params)
    group = max(1, max_prefill_tokens // t)
    zeros, slots = np.zeros(b, np.int32), np.arange(b, dtype=np.int32)
    with contextlib.nullcontext() if prefill_plan is None else jax.set_mesh(prefill_plan.mesh):
        for r0 in range(0, b, group):
            part = slice(r0, r0 + group)
            # host arrays put as they are: jnp.asarray or an eager slice would compile a program per shape
            pre = jax.device_put(
                PrefillInputs(
                    tokens[part], zeros[part], lengths[part], page_table[part], slots[part],
                    jax.tree.map(lambda x, part=part: x[part], sp), seeds[part], zeros[part],
                )
            )  # fmt: skip
            state, first, *_ = step_program(options.compiler_options(prefill=True))(
                params, cfg, state, pre, None, speculative, options
            )
    first.block_until_ready()
    t1 = time.perf_counter()

    active = np.arange(b) < b_real
    if decode_plan is None:
        dec = jax.device_put(DecodeInputs(active, page_table, sp, seeds))
        decode = _decode(options.compiler_options())
        limit = jnp.int32(max_new_tokens)
        out, counts, _ = decode(model.params, cfg, state, dec, stop_arr, limit, speculative, options, width=width)
    else:
        local_table = page_table - (np.arange(b, dtype=np.int32) // (b // ranks) * (b // ranks) * pages)[:, None]
        dec = jax.device_put(DecodeInputs(active, local_table, sp, seeds), decode_plan.rows())
        params = decode_plan.place_params(model.params)
        state = decode_plan.place_state(state)  # the prefill's cache handed to the ranks owning its pages
        run = decode_plan.wrap_decode_steps(cfg, params, state, width, speculative, options)
        out, counts, _ = run(params, state, dec, stop_arr, jnp.int32(max_new_tokens))
        if not out.is_fully_addressable:  # multi-process: every process gets all rows
            from jax.experimental import multihost_utils

            out, counts = multihost_utils.process_allgather((out, counts), tiled=True)
    out, counts = np.asarray(out)[:b_real], {name: np.asarray(c)[:b_real] for name, c in counts.items()}
    t2 = time.perf_counter()

    result = [[int(x) for x in row[:c]] for row, c in zip(out, counts["count"], strict=True)]
    n_new = sum(len(r) for r in result)
    text = None
    if stop_strings:
        cut = [cut_at_stop(model.tokenizer, r, stops, stop_strings) for r in result]
        result, text = [c[0] for c in cut], [c[1] for c in cut]
    elif model.tokenizer is not None:
        text = [model.tokenizer.decode([x for x in r if x not in stops]) for r in result]
    n_prompt = int(lengths[:b_real].sum())
    stats = {
        "batch": b_real,
        "rows": b,  # (padded_rows)
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
