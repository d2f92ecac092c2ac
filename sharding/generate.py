"""Generation under the two plans: prefill under the prefill plan, hand-off of the KV pages, decode under the
decode plan (attention data parallel over the ranks' own requests, experts over EP with explicit dispatch,
sharding/ep.py)."""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hcfjax import cache as kvcache
from hcfjax.generate import PAD, GenerationResult, bucket, decode_loop, prefill, prepare_prompts
from hcfjax.model import Model
from hcfjax.sampling import SamplingBatch, SamplingParams
from sharding.ep import ep_experts
from sharding.plans import Plan, param_specs, shard_params

MOCK_PROMPT = [0]


def handoff(cache: kvcache.KVCache, plan: Plan) -> kvcache.KVCache:
    """Moves KV pages from the prefill layout (replicated) to the decode plan's: the page axis is split over the
    ranks, so rank r holds pages r * P_local .. (r + 1) * P_local - 1, those of the requests it owns."""
    return jax.device_put(cache, NamedSharding(plan.mesh, P(None, "ep")))


def generate_planned(
    model: Model,
    prompts,
    decode_plan: Plan,
    prefill_plan: Plan | None = None,
    max_new_tokens: int = 64,
    sampling: SamplingParams | None = None,
    seed: int = 0,
    stop_token_ids=None,
    page_size: int = 64,
    exchange: str = "auto",
) -> GenerationResult:
    """Like hcfjax.generate (one SamplingParams for all rows), with the batch spread over the decode plan's ranks.

    Requests are dealt to ranks in contiguous blocks; ranks short of requests get mock rows, which run every step
    (the MoE exchange needs every rank) but never write or read another row's pages. exchange: how the MoE moves
    routed tokens between the ranks (sharding.ep.ep_experts: dense, ragged or auto).
    """
    cfg = model.cfg
    ids = prepare_prompts(model, prompts, max_new_tokens)
    ranks = decode_plan.mesh.shape["ep"]
    b_real = len(ids)
    per_rank = math.ceil(b_real / ranks)
    b = per_rank * ranks
    rows = ids + [MOCK_PROMPT] * (b - b_real)
    idle = np.arange(b) >= b_real
    lengths = np.array([len(r) for r in rows], np.int32)
    t = bucket(int(lengths.max()))
    tokens = np.zeros((b, t), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    pages = math.ceil(max(t, int(lengths.max()) + max_new_tokens) / page_size)
    local_table = (np.arange(b) % per_rank)[:, None] * pages + np.arange(pages)  # pages within the owner rank
    global_table = (np.arange(b) // per_rank)[:, None] * (per_rank * pages) + local_table
    cache = kvcache.init_cache(cfg, b * pages, page_size, model.dtype)
    sp = SamplingBatch.of([sampling or SamplingParams()] * b)
    stops = list(cfg.eos_token_ids if stop_token_ids is None else stop_token_ids)
    stop_arr = jnp.asarray(np.array(stops or [PAD], np.int32))
    k_prefill, k_decode = jax.random.split(jax.random.key(seed))

    # prefill under the prefill plan (jit shardings), or unsharded without one
    params = model.params if prefill_plan is None else shard_params(model.params, prefill_plan)
    with jax.set_mesh(prefill_plan.mesh) if prefill_plan is not None else contextlib.nullcontext():
        first, cache = prefill(
            params, cfg, jnp.asarray(tokens), jnp.asarray(lengths), cache, jnp.asarray(global_table), sp, k_prefill
        )
    cache = handoff(cache, decode_plan)

    params = shard_params(model.params, decode_plan)
    row = P("ep")

    def local(params, first, lengths, cache, table, sp, key, stops, idle):
        return decode_loop(
            params,
            cfg,
            first,
            lengths,
            cache,
            table,
            sp,
            key,
            stops,
            max_new_tokens,
            idle,
            ep_experts("ep", exchange),
            "ep",
        )

    cache_spec = jax.tree.map(lambda _: P(None, "ep"), cache)
    fn = jax.jit(
        jax.shard_map(
            local,
            mesh=decode_plan.mesh,
            in_specs=(
                param_specs(params, decode_plan),
                row,
                row,
                cache_spec,
                row,
                jax.tree.map(lambda _: row, sp),
                P(),
                P(),
                row,
            ),
            out_specs=(row, cache_spec),
        )
    )
    put = lambda x: jax.device_put(jnp.asarray(x), NamedSharding(decode_plan.mesh, row))
    out, _ = fn(
        params, put(first), put(lengths), cache, put(local_table), jax.tree.map(put, sp), k_decode, stop_arr, put(idle)
    )
    if not out.is_fully_addressable:  # multi-process: every process gets all rows
        from jax.experimental import multihost_utils

        out = multihost_utils.process_allgather(out, tiled=True)
    result = [[int(x) for x in r if x != PAD] for r in np.asarray(out)[:b_real]]
    text = None
    if model.tokenizer is not None:
        text = [model.tokenizer.decode([x for x in r if x not in stops]) for r in result]
    stats = {"batch": b_real, "ranks": ranks, "mock_rows": int(b - b_real), "new_tokens": sum(map(len, result))}
    return GenerationResult(result, text, stats)
