"""A decode step's expert routing in two kernels (Pallas, Triton lowering): from the router's logits to each
token's top-k experts and weights, the experts' group sizes, every token copy's place in expert order and, for int8
activations, the copies' int8 rows and scales in that order (the grouped gate/up kernel's input).

XLA runs the same as about a dozen small kernels a layer (the scores, top-k, the experts' counts, the pairwise order
and its inverse scatter, the gathers of the rows and of their scales, the scales' padding), each a launch and a gap.

A copy's place depends on every token routed before it, so the work is split at that dependence. The first launch
routes each block of 16 tokens in its own program (their ids and weights) and counts the copies its real tokens make
of each expert. The second, a program per block and chunk of row columns, reads every block's counts (a few hundred
integers), places its own tokens' copies, and writes the source token at each place and its columns of the copies'
int8 rows. Places follow a stable sort by expert: the copies of expert e, token by token, after those of experts
below e; copies of padding tokens (not `real`) come last, in token order.

`route_reference` is the routing in jnp (the model's path elsewhere), `copies_reference` the order and rows as a
stable argsort and gathers; the kernels give the same ids, group sizes, places and rows, and weights within an ulp
or two (their sums run in another order).

The model routes a decode step on them where Options.fused_routing is on (auto: on GPUs; docs/kernels.md,
"Routing on two kernels").
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.int8_rows import ieee_div

MAX_ROUTED = 16384  # a program's table elements at most: [16, E] and [N / 16, E], padded to powers of two
MAX_TOKENS = 256  # tokens routed at once at most: a decode step's (the sizes measured against XLA's routing)
BLOCK_TOKENS = 16  # tokens whose outputs and rows a program writes
ROW_CHUNK = 256  # int8 columns of the rows a program of the second launch copies at most (a power of two)


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
    """Whether the kernels route n tokens over e experts: up to MAX_TOKENS, where a program's tables, [16 tokens,
    E] and the blocks' counts [N / 16, E] (padded to powers of two), fit its registers."""
    ep = _pow2(max(e, BLOCK_TOKENS))
    return 0 < n <= MAX_TOKENS and BLOCK_TOKENS * ep <= MAX_ROUTED and _pow2(_blocks(n)) * ep <= MAX_ROUTED


def adds_partials(parts: int, n: int, e: int) -> bool:
    """Whether the choice kernel takes the router's product as `parts` partial products [parts, n, e] and adds
    them itself (one XLA reduction less): where a program's share, parts x [16, E] f32, is at most 64 KiB (V2-Lite's
    16 slices of 64 experts); a larger sum (V3's 56 x 256) reads faster spread over XLA's reduction."""
    return applies(n, e) and parts * BLOCK_TOKENS * _pow2(max(e, BLOCK_TOKENS)) * 4 <= 64 * 1024


def _pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


def _blocks(n: int) -> int:
    return -(-n // BLOCK_TOKENS)


def _route_rows(logits_ref, bias_ref, rows, *, spec: RouteSpec, n: int, e: int, ep: int, parts: int, has_bias, exact):
    """Tokens `rows` routed, as tables over (token, expert) [len(rows), Ep]: (exists, weight (the chosen experts'
    routing weights, zero elsewhere), rank (each chosen expert's place in the token's top-k, -1 elsewhere)). Tokens
    past n do not exist; experts past e are never chosen. The logits are the sum of `parts` [N, E] slices."""
    import jax.experimental.pallas.triton as plt

    cols = jnp.arange(ep, dtype=jnp.int32)
    exists, valid = rows < n, cols < e
    at, mask = rows[:, None] * e + cols[None, :], exists[:, None] & valid[None, :]
    logits = plt.load(logits_ref.at[at], mask=mask, other=0.0)
    for c in range(1, parts):  # the router's partial products, added in order
        logits = logits + plt.load(logits_ref.at[c * n * e + at], mask=mask, other=0.0)
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
    # A NaN score (bad input) counts as -inf: then a pick's best is a free expert's score, or -inf, which every
    # free expert has once no finite score is left (a NaN row, or a group limit keeping fewer than K experts), so
    # every token gets K distinct experts and every copy a place.
    choice = jnp.where(valid[None, :] & (choice == choice), choice, neg)
    if spec.limited:
        limit = _limit_groups_3d if e == ep else _limit_groups
        choice = limit(choice, cols, spec, e)
    rank = jnp.full(choice.shape, -1, jnp.int32)
    for j in range(spec.top_k):  # the best left, the lowest index first among equals (as lax.top_k)
        top = choice.max(axis=1)
        free = (rank < 0) & valid[None, :]
        idx = jnp.min(jnp.where((choice == top[:, None]) & free, cols[None, :], ep), axis=1)
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
    picked = [jnp.zeros(scores[0].shape, jnp.bool_) for _ in range(spec.groups)]
    for _ in range(spec.top_groups):  # the best group left, the lower first among equals (-inf ones too)
        top = scores[0]
        for j in range(1, spec.groups):
            top = jnp.maximum(top, scores[j])
        found = jnp.zeros(top.shape, jnp.bool_)
        for j in range(spec.groups):
            hit = ~found & ~picked[j] & (scores[j] == top)
            found, picked[j] = found | hit, picked[j] | hit
            keep = keep | (hit[:, None] & member[j][None, :])
            scores[j] = jnp.where(hit, neg, scores[j])
    return jnp.where(keep, choice, neg)


def _limit_groups_3d(choice, cols, spec: RouteSpec, e: int):
    """_limit_groups where the experts fill their padded width (E a power of two, at least 16, so a group's experts
    are a power of two too): the groups' scores as reductions over [tokens, groups, experts of a group] (one or
    three, not one or three a group)."""
    neg = jnp.float32(-jnp.inf)
    g, size = spec.groups, e // spec.groups
    vals = choice.reshape(choice.shape[0], g, size)
    best = vals.max(axis=2)  # [T, G]
    if spec.group_score == "top2" and size > 1:
        local = jnp.arange(size, dtype=jnp.int32)[None, None, :]
        first = jnp.min(jnp.where(vals == best[:, :, None], local, size), axis=2)
        best = best + jnp.where(local == first[:, :, None], neg, vals).max(axis=2)
    groups = jnp.arange(g, dtype=jnp.int32)[None, :]
    keep = jnp.zeros(best.shape, jnp.bool_)
    for _ in range(spec.top_groups):  # the best group left, the lower first among equals
        top = best.max(axis=1)
        pick = jnp.min(jnp.where((best == top[:, None]) & ~keep, groups, g), axis=1)
        hit = groups == pick[:, None]
        keep, best = keep | hit, jnp.where(hit, neg, best)
    keep = jnp.broadcast_to(keep[:, :, None], vals.shape).reshape(choice.shape)
    return jnp.where(keep, choice, neg)


def _choose_kernel(
    logits_ref, bias_ref, real_ref, w_ref, ids_ref, counts_ref, *, spec, n, e, ep, parts, has_bias, exact
):
    """The first launch, a program per 16 tokens: their top-k ids and weights, and how many copies of each expert
    their real tokens make (a row of the blocks' counts [blocks, Ep])."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as plt

    k, m, block = spec.top_k, n * spec.top_k, pl.program_id(0)
    rows = block * BLOCK_TOKENS + jnp.arange(BLOCK_TOKENS, dtype=jnp.int32)
    cols = jnp.arange(ep, dtype=jnp.int32)
    exists, weight, rank = _route_rows(
        logits_ref, bias_ref, rows, spec=spec, n=n, e=e, ep=ep, parts=parts, has_bias=has_bias, exact=exact
    )
    mine = (rank >= 0) & exists[:, None]
    slot = jnp.where(mine, rows[:, None] * k + rank, m)  # a masked lane's address past the end
    plt.store(ids_ref.at[slot], jnp.broadcast_to(cols[None, :], slot.shape), mask=mine)
    plt.store(w_ref.at[slot], weight, mask=mine)
    real = plt.load(real_ref.at[rows], mask=exists, other=False)
    plt.store(counts_ref.at[block * ep + cols], jnp.where(mine & real[:, None], 1, 0).sum(axis=0))


def _place_kernel(*refs, k: int, n: int, e: int, d: int, ep: int, bp: int, with_rows, tail: int):
    """The second launch, a program per 16 tokens and ROW_CHUNK columns of their rows: each of their copies' place
    in expert order, the source token at each place and, with int8 rows, the copies' rows (these columns) and
    scales there. A real token's copy of expert c lands after every copy of the experts below c and of c by
    earlier tokens (the blocks' counts give the earlier blocks' share, a cumulative sum down the block's own tokens
    the rest); a padding token's k-th copy after every real copy and the padding tokens' before it. The programs of
    a block's first columns write the places, tokens and scales, and block 0's the scales' `tail` zeros."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as plt

    ids_ref, counts_ref, real_ref = refs[:3]
    xq_ref, xs_ref = refs[3:5] if with_rows else (None, None)
    sizes_ref, pos_ref, token_ref = refs[5:8] if with_rows else refs[3:6]
    cq_ref, cs_ref = refs[8:10] if with_rows else (None, None)
    m, block, blocks = n * k, pl.program_id(0), _blocks(n)
    first = pl.program_id(1) == 0
    cols, b = jnp.arange(ep, dtype=jnp.int32), jnp.arange(bp, dtype=jnp.int32)
    counts = plt.load(counts_ref.at[b[:, None] * ep + cols[None, :]], mask=(b < blocks)[:, None], other=0)
    totals = counts.sum(axis=0)
    earlier = jnp.where((b < block)[:, None], counts, 0).sum(axis=0)  # [Ep]: the earlier blocks' copies
    base = jnp.cumsum(totals) - totals + earlier
    rows = block * BLOCK_TOKENS + jnp.arange(BLOCK_TOKENS, dtype=jnp.int32)
    live = rows < n
    real = plt.load(real_ref.at[rows], mask=live, other=False)
    # The earlier blocks are whole, and each of their real tokens made K copies: the rest of their tokens are padding.
    pads_before = block * BLOCK_TOKENS - earlier.sum() // k
    own_pad = jnp.where(live & ~real, 1, 0)
    pad_rank = pads_before + jnp.cumsum(own_pad) - own_pad  # [16]: padding tokens before each token

    ids = [plt.load(ids_ref.at[rows * k + j], mask=live, other=ep) for j in range(k)]
    hits = [cols[None, :] == i[:, None] for i in ids]  # [16, Ep] each
    count = sum(jnp.where(h, 1, 0) for h in hits) * jnp.where(real, 1, 0)[:, None]
    at_expert = base[None, :] + jnp.cumsum(count, axis=0) - count  # a real copy's place, by expert [16, Ep]
    places = []
    for j, h in enumerate(hits):
        at = jnp.where(real, jnp.where(h, at_expert, 0).sum(axis=1), totals.sum() + pad_rank * k + j)
        at = jnp.where(live & (at >= 0) & (at < m), at, m)  # never outside the copies
        places.append(at)
        at = jnp.where(first, at, m)  # one program of the block writes the places and tokens
        plt.store(pos_ref.at[jnp.where(live & first, rows * k + j, m)], at, mask=live & first)
        plt.store(token_ref.at[at], rows, mask=at < m)

    @pl.when((block == 0) & first)
    def _():
        plt.store(sizes_ref.at[cols], totals, mask=cols < e)

    if with_rows:
        scale = plt.load(xs_ref.at[rows], mask=live, other=0.0)
        for at in places:
            plt.store(cs_ref.at[jnp.where(first, at, m)], scale, mask=(at < m) & first)
        if tail:  # the scales' zero tail, past the copies

            @pl.when((block == 0) & first)
            def _():
                t = jnp.arange(_pow2(tail), dtype=jnp.int32)
                plt.store(cs_ref.at[m + t], jnp.zeros(t.shape, jnp.float32), mask=t < tail)

        c = pl.program_id(1) * _row_chunk(d) + jnp.arange(_row_chunk(d), dtype=jnp.int32)
        row = plt.load(xq_ref.at[rows[:, None] * d + c[None, :]], mask=live[:, None], other=0)
        for at in places:
            plt.store(cq_ref.at[at[:, None] * d + c[None, :]], row, mask=(at < m)[:, None])


def _row_chunk(d: int) -> int:
    """Columns of the rows a program copies: whole chunks, so that no masked column aliases the next row."""
    return math.gcd(d, ROW_CHUNK)


def default_warps(n: int, e: int) -> int:
    """Warps a program runs with: 8 for 256 experts or more (their [16, E] tables) or once the blocks' counts
    (padded) pass 8,192 elements, else 4."""
    ep = _pow2(max(e, BLOCK_TOKENS))
    return 8 if ep >= 256 or _pow2(_blocks(n)) * ep >= 8192 else 4


@functools.partial(jax.jit, static_argnames=("spec", "interpret", "num_warps", "scales_tail"))
def route_copies(
    logits, spec: RouteSpec, bias=None, real=None, x_q=None, interpret=False, num_warps=None, scales_tail: int = 0
):
    """logits [N, E] f32, or the router's partial products [C, N, E] f32 (the choice adds them, in order; see
    `adds_partials`) -> (weights [N, K] f32, ids [N, K] int32, group sizes [E] int32, pos [N K] int32, token [N K]
    int32, rows): as route_reference and copies_reference give them, in two launches (the choice, then the places
    and copies). real: bool [N], the tokens that are not padding (None: all); padding tokens' copies are
    counted in no group and placed last. x_q: (q [N, D] int8, scale [N] f32), the tokens quantised; rows: their
    copies in place order, (q [N K, D] int8, scale [N K + scales_tail] f32, zeros past N K: a consumer that reads
    past the last copy, the int4 kernel, takes them without padding them), or None without x_q. num_warps: a
    program's warps (default_warps by default)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.triton as plt

    n, e = logits.shape[-2:]
    parts = logits.shape[0] if logits.ndim == 3 else 1
    if not applies(n, e):
        raise ValueError(
            f"{n} tokens x {e} experts: more than the kernels route ({MAX_TOKENS} tokens, {MAX_ROUTED} padded)"
        )
    k, m, blocks = spec.top_k, n * spec.top_k, _blocks(n)
    ep = _pow2(max(e, BLOCK_TOKENS))
    # The kernels read `real` as bool, so that a decode step's mask goes in as it is, and no bias as any f32 array
    # they never load: in a layer loop a cast or a zeros array is a launch of its own each layer.
    real = jnp.ones(n, jnp.bool_) if real is None else real.astype(jnp.bool_)
    flat = logits.astype(jnp.float32).reshape(-1)
    bias_in = flat if bias is None else bias.astype(jnp.float32)
    params = plt.CompilerParams(num_warps=num_warps or default_warps(n, e), num_stages=1)
    choose = functools.partial(
        _choose_kernel, spec=spec, n=n, e=e, ep=ep, parts=parts, has_bias=bias is not None, exact=not interpret
    )
    w, ids, counts = pl.pallas_call(
        choose,
        out_shape=(
            jax.ShapeDtypeStruct((m,), jnp.float32),
            jax.ShapeDtypeStruct((m,), jnp.int32),
            jax.ShapeDtypeStruct((blocks * ep,), jnp.int32),
        ),
        grid=(blocks,),
        compiler_params=params,
        interpret=interpret,
        name="moe_route_choose",
    )(flat, bias_in, real)
    args = [ids, counts, real]
    out = [jax.ShapeDtypeStruct(shape, jnp.int32) for shape in ((e,), (m,), (m,))]  # group sizes, pos, token
    d = 0
    if x_q is not None:
        d = x_q[0].shape[1]
        args += [x_q[0].reshape(-1), x_q[1].reshape(-1).astype(jnp.float32)]
        out += [jax.ShapeDtypeStruct((m * d,), jnp.int8), jax.ShapeDtypeStruct((m + scales_tail,), jnp.float32)]
    place = functools.partial(
        _place_kernel, k=k, n=n, e=e, d=d, ep=ep, bp=_pow2(blocks), with_rows=x_q is not None, tail=scales_tail
    )
    res = pl.pallas_call(
        place,
        out_shape=tuple(out),
        grid=(blocks, d // _row_chunk(d) if d else 1),
        compiler_params=params,
        interpret=interpret,
        name="moe_route_place",
    )(*args)
    sizes, pos, token = res[:3]
    rows = (res[3].reshape(m, d), res[4]) if x_q is not None else None
    return w.reshape(n, k), ids.reshape(n, k), sizes, pos, token, rows
