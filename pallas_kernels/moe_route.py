"""A decode step's expert routing in one kernel (Pallas, Triton lowering): from the router's logits to each token's
top-k experts and weights, the experts' group sizes, every token copy's place in expert order and, for int8
activations, the copies' int8 rows and scales in that order (the grouped gate/up kernel's input).

XLA runs the same as about a dozen small kernels a layer (the scores, top-k, the experts' counts, the pairwise order
and its inverse scatter, the gathers of the rows and of their scales, the scales' padding), each a launch and a gap.

A copy's place depends on every token routed before it, so each program routes all N tokens (N x E logits, a few
kilobytes), then writes its own block of tokens: their experts and weights, their copies' places, the source token
at each place, and K copies of their int8 rows. Places follow a stable sort by expert: the copies of expert e,
token by token, after those of experts below e; copies of padding tokens (not `real`) come last, in token order.

`route_reference` is the routing in jnp (the model's path elsewhere), `copies_reference` the order and rows as a
stable argsort and gathers; the kernel gives the same ids, group sizes, places and rows, and weights within an ulp
or two (its sums run in another order).

The model takes it only with Options.fused_routing: it is fewer launches, but slower than XLA's kernels together
(docs/kernels.md, "Routing in one kernel").
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.int8_rows import ieee_div

MAX_ROUTED = 16384  # N x E (padded to powers of two) up to which the kernel routes: a decode step's tokens
BLOCK_TOKENS = 16  # tokens whose outputs and rows a program writes
ROW_CHUNK = 512  # int8 columns of a row copied at once (a power of two)


@dataclasses.dataclass(frozen=True)
class RouteSpec:
    """How a model's gate routes. scoring: softmax or sigmoid of the logits. groups > 1 and top_groups < groups:
    group-limited routing (only the experts of the top_groups best groups of E / groups are eligible); a group's
    score is its best expert's (group_score "max") or the sum of its two best ("top2", noaux_tc). A bias, where the
    gate has one, is added to the scores for the choice only. The chosen scores are normalised over the K
    (normalise) and then multiplied by factor."""

    top_k: int
    scoring: str = "softmax"
    groups: int = 1
    top_groups: int = 1
    group_score: str = "max"
    normalise: bool = False
    factor: float = 1.0

    def __post_init__(self):
        if self.scoring not in ("softmax", "sigmoid") or self.group_score not in ("max", "top2"):
            raise ValueError(f"unknown scoring {self.scoring!r} or group score {self.group_score!r}")

    @property
    def limited(self) -> bool:
        return self.groups > 1 and self.top_groups < self.groups


def route_reference(logits: jax.Array, spec: RouteSpec, bias: jax.Array | None = None):
    """logits [N, E] f32 -> (weights [N, K] f32, ids [N, K] int32): the top-k choice in jnp."""
    n, e = logits.shape
    scores = jax.nn.sigmoid(logits) if spec.scoring == "sigmoid" else jax.nn.softmax(logits, axis=-1)
    choice = scores if bias is None else scores + bias  # the bias steers the choice, not the weights
    if spec.limited:
        grouped = choice.reshape(n, spec.groups, e // spec.groups)
        if spec.group_score == "top2":
            group_scores = jax.lax.top_k(grouped, min(2, e // spec.groups))[0].sum(-1)  # [N, G]
        else:
            group_scores = grouped.max(-1)
        top_groups = jax.lax.top_k(group_scores, spec.top_groups)[1]  # [N, top_groups]
        keep = jnp.zeros((n, spec.groups), bool).at[jnp.arange(n)[:, None], top_groups].set(True)
        choice = jnp.where(jnp.repeat(keep, e // spec.groups, axis=1), choice, -jnp.inf)
    top, ids = jax.lax.top_k(choice, spec.top_k)
    # Without a bias the choice's top values are the chosen scores (group limiting only masks the others).
    weights = top if bias is None else jnp.take_along_axis(scores, ids, axis=-1)
    if spec.normalise:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * spec.factor, ids.astype(jnp.int32)


def copies_reference(ids: jax.Array, num_experts: int, real: jax.Array | None = None, x_q=None):
    """The kernel's order of the copies by stable argsort: ids [N, K] -> (group sizes [E], pos [N K] (each copy's
    place), token [N K] (the source token at each place), and with x_q = (q [N, D] int8, scale [N] f32) the rows
    and scales at each place)."""
    n, k = ids.shape
    key = ids if real is None else jnp.where(real[:, None], ids, num_experts)
    flat = key.reshape(-1)
    sizes = (flat[:, None] == jnp.arange(num_experts)).sum(0, dtype=jnp.int32)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    pos = jnp.zeros(n * k, jnp.int32).at[order].set(jnp.arange(n * k, dtype=jnp.int32))
    token = order // k
    rows = None if x_q is None else (x_q[0][token], x_q[1][token])
    return sizes, pos, token, rows


def applies(n: int, e: int) -> bool:
    """Whether the kernel routes n tokens over e experts (their padded product fits a program's registers)."""
    return 0 < n and _pow2(max(n, BLOCK_TOKENS)) * _pow2(max(e, BLOCK_TOKENS)) <= MAX_ROUTED


def _pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


def _route_all(logits_ref, bias_ref, *, spec: RouteSpec, n: int, e: int, np_: int, ep: int, has_bias, exact):
    """Every token routed, as tables over (token, expert) [Np, Ep]: (exists [Np], weight (the chosen experts'
    routing weights, zero elsewhere), rank (each chosen expert's place in the token's top-k, -1 elsewhere)). Tokens
    past n do not exist; experts past e are never chosen."""
    import jax.experimental.pallas.triton as plt

    rows, cols = jnp.arange(np_, dtype=jnp.int32), jnp.arange(ep, dtype=jnp.int32)
    exists, valid = rows < n, cols < e
    logits = plt.load(
        logits_ref.at[rows[:, None] * e + cols[None, :]], mask=exists[:, None] & valid[None, :], other=0.0
    )
    neg = jnp.float32(-jnp.inf)
    logits = jnp.where(valid[None, :], logits, neg)
    if spec.scoring == "sigmoid":
        scores = ieee_div(jnp.ones_like(logits), 1.0 + jnp.exp(-logits), exact)
    else:
        ex = jnp.exp(logits - logits.max(axis=1, keepdims=True))
        scores = ieee_div(ex, jnp.broadcast_to(ex.sum(axis=1, keepdims=True), ex.shape), exact)
    choice = scores
    if has_bias:  # the bias steers the choice; the weights are the scores
        choice = scores + plt.load(bias_ref.at[cols], mask=valid, other=0.0)[None, :]
    choice = jnp.where(valid[None, :], choice, neg)
    if spec.limited:
        choice = _limit_groups(choice, cols, spec, e)
    rank = jnp.full(choice.shape, -1, jnp.int32)
    for j in range(spec.top_k):  # the best left, the lowest index first among equals (as lax.top_k)
        top = choice.max(axis=1)
        free = (rank < 0) & valid[None, :]
        idx = jnp.min(jnp.where((choice == top[:, None]) & free, cols[None, :], ep), axis=1)
        # None equal to the best (a NaN score, or fewer eligible experts than K): the lowest expert not yet chosen,
        # so that every token still has K distinct experts and every copy a place.
        idx = jnp.where(idx == ep, jnp.min(jnp.where(free, cols[None, :], ep), axis=1), idx)
        hit = cols[None, :] == idx[:, None]
        rank = jnp.where(hit, j, rank)
        choice = jnp.where(hit, neg, choice)
    weight = jnp.where(rank >= 0, scores, 0.0)
    if spec.normalise:
        total = jnp.broadcast_to(weight.sum(axis=1, keepdims=True) + 1e-20, weight.shape)
        weight = ieee_div(weight, total, exact)
    return exists, weight * spec.factor, rank


def _limit_groups(choice, cols, spec: RouteSpec, e: int):
    """choice with every expert outside the top_groups best groups at -inf (ties: the lower group first)."""
    neg = jnp.float32(-jnp.inf)
    size = e // spec.groups
    member = [(cols >= j * size) & (cols < (j + 1) * size) for j in range(spec.groups)]
    scores = []
    for m in member:
        vals = jnp.where(m[None, :], choice, neg)
        best = vals.max(axis=1)
        if spec.group_score == "top2" and size > 1:
            first = jnp.min(jnp.where(vals == best[:, None], cols[None, :], cols.shape[0]), axis=1)
            best = best + jnp.where(cols[None, :] == first[:, None], neg, vals).max(axis=1)
        scores.append(best)
    keep = jnp.zeros(choice.shape, jnp.bool_)
    for _ in range(spec.top_groups):
        top, pick = scores[0], jnp.zeros(scores[0].shape, jnp.int32)
        for j in range(1, spec.groups):
            better = scores[j] > top
            top, pick = jnp.where(better, scores[j], top), jnp.where(better, j, pick)
        for j in range(spec.groups):
            hit = pick == j
            keep = keep | (hit[:, None] & member[j][None, :])
            scores[j] = jnp.where(hit, neg, scores[j])
    return jnp.where(keep, choice, neg)


def _kernel(*refs, spec: RouteSpec, n: int, e: int, d: int, np_: int, ep: int, has_bias, with_rows, exact):
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as plt

    logits_ref, bias_ref, real_ref = refs[:3]
    xq_ref, xs_ref = refs[3:5] if with_rows else (None, None)
    w_ref, ids_ref, sizes_ref, pos_ref, token_ref = refs[5:10] if with_rows else refs[3:8]
    cq_ref, cs_ref = refs[10:12] if with_rows else (None, None)
    k, m = spec.top_k, n * spec.top_k
    every, cols = jnp.arange(np_, dtype=jnp.int32), jnp.arange(ep, dtype=jnp.int32)
    exists, weight, rank = _route_all(
        logits_ref, bias_ref, spec=spec, n=n, e=e, np_=np_, ep=ep, has_bias=has_bias, exact=exact
    )
    chosen = rank >= 0
    real = plt.load(real_ref.at[every], mask=exists, other=0) != 0

    # Places: a real token's copy of expert c after every copy of the experts below c and of c by earlier tokens;
    # a padding token's k-th copy after every real copy and the padding tokens' before it.
    count = jnp.where(chosen & (exists & real)[:, None], 1, 0)  # [Np, Ep]
    totals = count.sum(axis=0)
    starts = jnp.cumsum(totals) - totals
    before = jnp.cumsum(count, axis=0) - count
    padding = jnp.where(exists & ~real, 1, 0)
    pads_before = jnp.cumsum(padding) - padding
    place = jnp.where(real[:, None], starts[None, :] + before, totals.sum() + pads_before[:, None] * k + rank)

    # This program's tokens' outputs, scattered from the tables; a masked lane's address is past the end.
    bn = BLOCK_TOKENS
    mine = chosen & (exists & (every // bn == pl.program_id(0)))[:, None]
    slot = jnp.where(mine, every[:, None] * k + rank, m)
    plt.store(ids_ref.at[slot], jnp.broadcast_to(cols[None, :], slot.shape), mask=mine)
    plt.store(w_ref.at[slot], weight, mask=mine)
    plt.store(pos_ref.at[slot], place, mask=mine)
    plt.store(token_ref.at[jnp.where(mine, place, m)], jnp.broadcast_to(every[:, None], slot.shape), mask=mine)

    @pl.when(pl.program_id(0) == 0)
    def _():
        plt.store(sizes_ref.at[cols], totals, mask=cols < e)

    if with_rows:  # each copy's int8 row and scale at its place, the places read back (after every store)
        if exact:  # on the GPU (the interpreter runs a program's stores in order)
            plt.debug_barrier()
        rows = pl.program_id(0) * bn + jnp.arange(bn, dtype=jnp.int32)
        live = rows < n
        places = [plt.load(pos_ref.at[rows * k + j], mask=live, other=0) for j in range(k)]
        places = [jnp.where(live & (at >= 0) & (at < m), at, m) for at in places]  # never outside the copies
        scale = plt.load(xs_ref.at[rows], mask=live, other=0.0)
        for at in places:
            plt.store(cs_ref.at[at], scale, mask=at < m)
        chunk = math.gcd(d, ROW_CHUNK)  # whole chunks: no masked column aliases the next row
        for c0 in range(0, d, chunk):
            c = c0 + jnp.arange(chunk, dtype=jnp.int32)
            row = plt.load(xq_ref.at[rows[:, None] * d + c[None, :]], mask=live[:, None], other=0)
            for at in places:
                plt.store(cq_ref.at[at[:, None] * d + c[None, :]], row, mask=(at < m)[:, None])


def default_warps(n: int, e: int) -> int:
    """Warps a program runs with: 4, or 8 once its [N, E] tables (padded) pass 8,192 elements."""
    return 8 if _pow2(max(n, BLOCK_TOKENS)) * _pow2(max(e, BLOCK_TOKENS)) >= 8192 else 4


@functools.partial(jax.jit, static_argnames=("spec", "interpret", "num_warps"))
def route_copies(logits, spec: RouteSpec, bias=None, real=None, x_q=None, interpret=False, num_warps=None):
    """logits [N, E] f32 -> (weights [N, K] f32, ids [N, K] int32, group sizes [E] int32, pos [N K] int32, token
    [N K] int32, rows): as route_reference and copies_reference give them, in one kernel. real: bool [N], the
    tokens that are not padding (None: all); padding tokens' copies are counted in no group and placed last.
    x_q: (q [N, D] int8, scale [N] f32), the tokens quantised; rows: their copies in place order, (q [N K, D] int8,
    scale [N K] f32), or None without x_q. num_warps: a program's warps (default_warps by default)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as plt

    n, e = logits.shape
    if not applies(n, e):
        raise ValueError(f"{n} tokens x {e} experts: more than the kernel routes ({MAX_ROUTED} padded)")
    k, m = spec.top_k, n * spec.top_k
    np_, ep = _pow2(max(n, BLOCK_TOKENS)), _pow2(max(e, BLOCK_TOKENS))
    real = jnp.ones(n, jnp.int32) if real is None else real.astype(jnp.int32)
    bias_in = jnp.zeros(e, jnp.float32) if bias is None else bias.astype(jnp.float32)
    args = [logits.astype(jnp.float32).reshape(-1), bias_in, real]
    out = [
        jax.ShapeDtypeStruct((m,), jnp.float32),
        jax.ShapeDtypeStruct((m,), jnp.int32),
        jax.ShapeDtypeStruct((e,), jnp.int32),
        jax.ShapeDtypeStruct((m,), jnp.int32),
        jax.ShapeDtypeStruct((m,), jnp.int32),
    ]
    d = 0
    if x_q is not None:
        d = x_q[0].shape[1]
        args += [x_q[0].reshape(-1), x_q[1].reshape(-1).astype(jnp.float32)]
        out += [jax.ShapeDtypeStruct((m * d,), jnp.int8), jax.ShapeDtypeStruct((m,), jnp.float32)]
    kernel = functools.partial(
        _kernel,
        spec=spec,
        n=n,
        e=e,
        d=d,
        np_=np_,
        ep=ep,
        has_bias=bias is not None,
        with_rows=x_q is not None,
        exact=not interpret,
    )
    res = pl.pallas_call(
        kernel,
        out_shape=tuple(out),
        grid=(pl.cdiv(n, BLOCK_TOKENS),),
        compiler_params=plt.CompilerParams(num_warps=num_warps or default_warps(n, e), num_stages=1),
        interpret=interpret,
        name="moe_route",
    )(*args)
    w, ids, sizes, pos, token = res[:5]
    rows = (res[5].reshape(m, d), res[6]) if x_q is not None else None
    return w.reshape(n, k), ids.reshape(n, k), sizes, pos, token, rows
