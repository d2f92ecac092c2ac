"""DeepSeek's expert routing for a decode step in one kernel (Pallas, Triton lowering): one program a token sums
the router's partial products, scores them (softmax or sigmoid), adds the bias that steers the choice, limits the
groups, takes the top k, and ranks each chosen copy within its expert by an atomic add on the expert's counter.

XLA runs the same work as about a dozen small kernels a layer (the partial products' sum with the softmax, top-k's
sort, the experts' counts, the copies' order). With the counters and each copy's rank, the copies' sorted positions
are a cumulative sum and a gather (`positions`), and their order one scatter: a copy's rank within its expert depends
on which program reached the counter first, so the copies of one expert come in any order, which the grouped
products, computing each row alone, do not see.

Top-k as `lax.top_k`: the largest value first, the lowest index among equal values. The group limit as DeepSeek's
gates: a group's score is its largest (group_limited_greedy) or its two largest summed (noaux_tc); the others'
experts are masked out of the choice.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.int8_rows import div_rn

SCORINGS = ("softmax", "sigmoid")
GROUP_SCORES = ("max", "top2")


def _argmax(v, lanes, size: int):
    """(the largest value of v, the lowest lane holding it)."""
    top = v.max()
    return top, jnp.where(v == top, lanes, size).min()


def _group_mask(choice, lanes, *, experts: int, groups: int, keep: int, group_score: str):
    """Whether each expert's group is one of the `keep` best of `groups` equal groups, by their scores."""
    per = experts // groups
    group = lanes // per
    glanes = jnp.arange(_pow2(groups), dtype=jnp.int32)
    scores = jnp.full(glanes.shape, -jnp.inf, jnp.float32)
    for g in range(groups):
        v = jnp.where(group == g, choice, -jnp.inf)
        best, at = _argmax(v, lanes, lanes.shape[0])
        if group_score == "top2" and per > 1:
            best = best + jnp.where(lanes == at, -jnp.inf, v).max()
        scores = jnp.where(glanes == g, best, scores)
    kept = jnp.zeros(lanes.shape, jnp.bool_)
    for _ in range(keep):
        _, g = _argmax(scores, glanes, glanes.shape[0])
        kept = kept | (group == g)
        scores = jnp.where(glanes == g, -jnp.inf, scores)
    return kept


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _kernel(*refs, parts, experts, top_k, scoring, groups, keep, group_score, biased, masked, exact):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as plt

    it = iter(refs)
    partial_ref = next(it)
    bias_ref = next(it) if biased else None
    real_ref = next(it) if masked else None
    _, chosen_ref, ids_ref, rank_ref, counts_ref = (next(it) for _ in range(5))

    n = pl.program_id(0)
    tokens = pl.num_programs(0)
    lanes = jnp.arange(_pow2(experts), dtype=jnp.int32)
    valid = lanes < experts
    logits = jnp.zeros(lanes.shape, jnp.float32)
    for p in range(parts):
        logits = logits + plt.load(partial_ref.at[(p * tokens + n) * experts + lanes], mask=valid, other=0.0)

    if scoring == "softmax":
        shifted = jnp.where(valid, logits, -jnp.inf)
        e = jnp.exp(shifted - shifted.max())
        scores = div_rn(e, jnp.full(lanes.shape, e.sum(), jnp.float32), exact)
    else:
        scores = div_rn(jnp.ones(lanes.shape, jnp.float32), 1.0 + jnp.exp(-logits), exact)
    choice = scores + plt.load(bias_ref.at[lanes], mask=valid, other=0.0) if biased else scores
    choice = jnp.where(valid, choice, -jnp.inf)
    if groups > 1 and keep < groups:
        mask = _group_mask(choice, lanes, experts=experts, groups=groups, keep=keep, group_score=group_score)
        choice = jnp.where(mask, choice, -jnp.inf)

    real = plt.load(real_ref.at[n]) != 0 if masked else True
    klanes = jnp.arange(_pow2(max(top_k, 2)), dtype=jnp.int32)
    chosen = jnp.zeros(klanes.shape, jnp.float32)
    ids = jnp.zeros(klanes.shape, jnp.int32)
    ranks = jnp.zeros(klanes.shape, jnp.int32)
    for k in range(top_k):
        top, at = _argmax(choice, lanes, lanes.shape[0])
        score = jnp.where(lanes == at, scores, 0.0).sum() if biased else top
        # a padding token's copies go to the bucket past the last expert (sorted last, in no group)
        rank = plt.atomic_add(counts_ref, jnp.where(real, at, experts), jnp.int32(1))
        chosen = jnp.where(klanes == k, score, chosen)
        ids = jnp.where(klanes == k, at, ids)
        ranks = jnp.where(klanes == k, rank, ranks)
        choice = jnp.where(lanes == at, -jnp.inf, choice)
    out = n * top_k + klanes
    first = klanes < top_k
    plt.store(chosen_ref.at[out], chosen, mask=first)
    plt.store(ids_ref.at[out], ids, mask=first)
    plt.store(rank_ref.at[out], ranks, mask=first)


@functools.partial(jax.jit, static_argnames=("top_k", "scoring", "groups", "keep", "group_score", "interpret"))
def route(
    partials: jax.Array,
    bias: jax.Array | None,
    real: jax.Array | None,
    *,
    top_k: int,
    scoring: str = "softmax",
    groups: int = 1,
    keep: int = 1,
    group_score: str = "max",
    interpret: bool = False,
):
    """partials [P, N, E] f32 (the router's logits as P partial products, summed here), bias [E] or None, real [N]
    bool or None (padding tokens: routed, but counted in the bucket past the last expert) ->
    (scores [N, K] f32 of the chosen experts, unscaled; ids [N, K] int32; rank [N, K] int32, each copy's place among
    its expert's copies; counts [E + 1] int32, the copies of each expert and, last, of the padding tokens).

    groups / keep / group_score: the group limit (keep of groups groups by their max or top-2 sum; none where keep
    >= groups). `interpret`: Pallas's interpreter, any backend."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as plt

    if scoring not in SCORINGS or group_score not in GROUP_SCORES:
        raise ValueError(f"scoring must be one of {SCORINGS} and group_score of {GROUP_SCORES}")
    parts, tokens, experts = partials.shape
    if experts % groups:
        raise ValueError(f"{experts} experts do not split into {groups} groups")
    if top_k > experts:
        raise ValueError(f"top_k {top_k} is more than the {experts} experts")
    args = [partials.astype(jnp.float32).reshape(-1)]
    if bias is not None:
        args.append(bias.astype(jnp.float32).reshape(experts))
    if real is not None:
        args.append(real.reshape(tokens).astype(jnp.int32))
    counts = jnp.zeros((experts + 1,), jnp.int32)
    kernel = functools.partial(
        _kernel,
        parts=parts,
        experts=experts,
        top_k=top_k,
        scoring=scoring,
        groups=groups,
        keep=keep,
        group_score=group_score,
        biased=bias is not None,
        masked=real is not None,
        exact=not interpret,
    )
    flat = jax.ShapeDtypeStruct((tokens * top_k,), jnp.float32)
    flat_i = jax.ShapeDtypeStruct((tokens * top_k,), jnp.int32)
    chosen, ids, rank, counts = pl.pallas_call(
        kernel,
        out_shape=(flat, flat_i, flat_i, jax.ShapeDtypeStruct(counts.shape, jnp.int32)),
        grid=(tokens,),
        input_output_aliases={len(args): 3},
        compiler_params=plt.CompilerParams(num_warps=2, num_stages=1),
        interpret=interpret,
        name="moe_route",
    )(*args, counts)
    shape = (tokens, top_k)
    return chosen.reshape(shape), ids.reshape(shape), rank.reshape(shape), counts


def positions(ids: jax.Array, rank: jax.Array, counts: jax.Array, real: jax.Array | None = None):
    """The copies' places when sorted by expert, padding last, from `route`'s ranks and counts: (pos [N*K], each
    copy's sorted position; order [N*K], the copy at each position, pos's inverse)."""
    experts = counts.shape[0] - 1
    key = ids if real is None else jnp.where(real.reshape(-1, 1), ids, experts)
    starts = jnp.cumsum(counts) - counts
    pos = (starts[key] + rank).reshape(-1)
    m = pos.shape[0]
    order = jnp.zeros(m, jnp.int32).at[pos].set(jnp.arange(m, dtype=jnp.int32), unique_indices=True)
    return pos, order
