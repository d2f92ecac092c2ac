"""Mixture of experts: DeepSeek routing (greedy, group-limited greedy, noaux_tc) and grouped expert matmuls.

Experts run as grouped matmuls over the token copies sorted by expert: no loop over experts, no padding.
`quant.ragged_dot` picks how: `jax.lax.ragged_dot` for plain weights; for quantised experts (hcfjax/quant.py) the
Pallas int4 kernel on GPU or the pure-jnp reference elsewhere.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hcfjax.config import ModelConfig
from hcfjax.layers import mlp
from hcfjax.options import DEFAULT, Options
from hcfjax.quant import (
    ACT_GROUP,
    QWeight,
    gated_ragged_dot,
    int8_activations,
    quantize_tokens,
    ragged_dot,
    token_quant_mode,
)
from pallas_kernels import moe_route
from pallas_kernels.moe_int4 import HS_PAD
from pallas_kernels.moe_route import RouteSpec, route_reference


def grouped_down_input(down, opts: Options = DEFAULT) -> bool:
    """Whether the experts' down projection takes its input quantised per row and 128 channels (DeepSeek-V3's
    activation grouping), by the fused gate/up kernel itself where that pays, so no XLA pass runs between the two
    kernels (opts.grouped_down_input; int8-activation weights with 128-wide groups)."""
    return opts.grouped_down_input and isinstance(down, QWeight) and down.act == "int8" and down.group == ACT_GROUP


def router_partials(x: jax.Array, w: jax.Array, width: int = 128) -> jax.Array:
    """x [N, D] @ w [D, E] in float32 as the partial products of `width`-wide slices of D, [C, N, E], which
    `router_logits` adds up (and the routing kernels, where they route). With few rows the product is a single
    [N, E] output tile, which a GEMM without split-K (cuBLAS in a decode step, Options.xla_gemm) computes on one CTA
    down the whole of D; the partial products run side by side."""
    x, w = x.astype(jnp.float32), w.astype(jnp.float32)
    (n, d), e = x.shape, w.shape[-1]
    if d % width or d == width:
        return (x @ w)[None]
    return jnp.einsum("nck,cke->cne", x.reshape(n, d // width, width), w.reshape(d // width, width, e))


def router_logits(x: jax.Array, w: jax.Array, width: int = 128) -> jax.Array:
    """x [N, D] @ w [D, E] in float32, as the sum of `router_partials`."""
    return router_partials(x, w, width).sum(0)


def route_spec(cfg: ModelConfig) -> RouteSpec:
    """How the model's gate routes (pallas_kernels.moe_route.RouteSpec): its scoring, group limit and the scaling
    of the chosen experts' scores."""
    k = cfg.num_experts_per_tok
    if cfg.model_type == "deepseek_v2":
        # DeepSeek-V2's gate normalises the top-k weights or scales them, never both (transformers' V2 router
        # ignores norm_topk_prob and always scales).
        normalise = k > 1 and cfg.norm_topk_prob
        factor = 1.0 if normalise else cfg.routed_scaling_factor
    else:
        # DeepSeek-V3's gate (and transformers'): normalised when asked, then always scaled.
        normalise, factor = cfg.norm_topk_prob, cfg.routed_scaling_factor
    limited = cfg.topk_method != "greedy" and cfg.n_group > 1 and cfg.topk_group < cfg.n_group
    return RouteSpec(
        top_k=k,
        scoring=cfg.scoring_func,
        groups=cfg.n_group if limited else 1,
        top_groups=cfg.topk_group if limited else 1,
        group_score="top2" if cfg.topk_method == "noaux_tc" else "max",
        normalise=normalise,
        factor=float(factor),
    )


def route(p: dict, cfg: ModelConfig, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Top-k expert choice per token.  x [N, D] -> (weights [N, K] f32, expert ids [N, K] int32)."""
    return route_reference(router_logits(x, p["router"]), route_spec(cfg), p.get("router_bias"))


def route_mode(n: int, num_experts: int, opts: Options = DEFAULT) -> str:
    """Where n tokens are routed and their copies put in expert order: on the routing kernels
    (pallas_kernels/moe_route.py, mode 'kernel' or 'interpret') where opts.fused_routing is on (auto: on GPUs), the
    MoE kernels' mode (opts.mode("moe")) is not 'reference' and the tokens are a decode step's few; else
    'reference' (XLA)."""
    return opts.mode("moe") if opts.on("fused_routing") and moe_route.applies(n, num_experts) else "reference"


def route_on_kernels(partials, spec: RouteSpec, bias, real, x_q, interpret: bool, num_warps=None):
    """A decode step's routing on the routing kernels, from the router's partial products [C, N, E]: the choice adds
    them itself where `moe_route.adds_partials` (else XLA sums them first), and the copies' scales come with the
    zero tail the int4 kernel reads past the last copy (no pad before it). -> `moe_route.route_copies`' outputs."""
    logits = partials if moe_route.adds_partials(*partials.shape) else partials.sum(0)
    return moe_route.route_copies(
        logits, spec, bias, real, x_q, interpret=interpret, num_warps=num_warps, scales_tail=HS_PAD
    )


def experts(
    p: dict, x: jax.Array, weights: jax.Array, ids: jax.Array, opts: Options = DEFAULT, x_q=None, copies=None
) -> jax.Array:
    """Routed experts as grouped matmuls.  x [N, D], weights/ids [N, K]; gate/up [E, D, F], down [E, F, D] (arrays or
    QWeights of those logical shapes). x_q: x quantised (`quantize_tokens(x)`) where the caller has it. copies: the
    copies already in expert order, as `moe_route.route_copies` gives them (group sizes, pos, token, int8 rows or
    None), where the routing kernels ordered them."""
    n, k = ids.shape
    num_experts = p["gate"].shape[0]
    if copies is None:
        (group_sizes, pos, token), copies_q = order_copies(ids, num_experts, opts), None
    else:
        group_sizes, pos, token, copies_q = copies
    xs = x[token]  # [N*K, D]
    if int8_activations(p["gate"]) and copies_q is None:  # w4a8 / w8a8: the tokens quantised, their copies gathered
        xq, sc = quantize_tokens(x, token_quant_mode(x, opts)) if x_q is None else x_q
        copies_q = (xq[token], sc[token])
    if grouped_down_input(p["down"], opts):  # the product quantised per 128 channels by its producer
        h_q = gated_ragged_dot(xs, p["gate"], p["up"], group_sizes, copies_q, quant_out=True, opts=opts)
        h = jnp.zeros(h_q[0].shape, x.dtype)  # only a shape for the down projection (unused, so never made)
        y = ragged_dot(h, p["down"], group_sizes, h_q, opts)
    else:
        # silu(xs gate) * (xs up) [N*K, F]
        h = gated_ragged_dot(xs, p["gate"], p["up"], group_sizes, copies_q, opts=opts)
        y = ragged_dot(h, p["down"], group_sizes, opts=opts)  # [N*K, D]
    # Each token's K copies gathered back from their sorted rows and summed with the routing weights: one fusion,
    # where a scatter-add into zeros is three kernels (zeros, the weights' gather, the scatter). Copies routed past
    # the last expert (padding) lie outside every group, where the products leave any value: they count zero.
    back = y[pos].reshape(n, k, -1).astype(jnp.float32)
    back = jnp.where((ids < num_experts)[..., None], back, 0.0)
    return (back * weights[..., None]).sum(1).astype(x.dtype)


def order_copies(ids: jax.Array, num_experts: int, opts: Options = DEFAULT):
    """The tokens' copies ids [N, K] in expert order, as XLA puts them: (group sizes [E], pos [N K] each copy's
    sorted position, token [N K] the source token at each position). Ids past the last expert are padding, last."""
    flat = ids.reshape(-1)  # [N*K]
    pairwise = flat.shape[0] <= PAIRWISE_SORT_MAX and opts.on("sort_free_routing")
    order, pos = by_expert(flat, num_experts, pairwise)
    return expert_counts(flat, num_experts), pos, order // ids.shape[1]


def expert_counts(flat: jax.Array, num_experts: int) -> jax.Array:
    """Copies routed to each expert [E] int32 (ids past the last expert, an EP plan's padding, are not counted): a
    one-hot sum, one reduction, where `jnp.bincount` is a scatter-add into zeros (two kernels)."""
    return (flat[:, None] == jnp.arange(num_experts, dtype=flat.dtype)).sum(0, dtype=jnp.int32)


PAIRWISE_SORT_MAX = 4096  # copies up to which experts() orders them pairwise (Options.sort_free_routing)


def by_expert(flat: jax.Array, num_experts: int, pairwise: bool) -> tuple[jax.Array, jax.Array]:
    """The copies [M] sorted by expert, stably, ids past the last expert (an EP plan's padding) last: (order [M], the
    copy at each sorted position, which is `argsort(flat, stable=True)` where padding ids are equal; pos [M], each
    copy's sorted position, its inverse).

    `pairwise` counts each position pairwise (copies with a smaller id, or the same id and a smaller index: one
    [M, M] reduction) and inverts it by one scatter, where a GPU sort is several kernels of tens of microseconds per
    layer; else an argsort (a CPU's choice: it sorts M copies faster than it makes M^2 comparisons, 0.4 against
    25 ms at M = 3072)."""
    m = flat.shape[0]
    idx = jnp.arange(m, dtype=jnp.int32)
    key = jnp.minimum(flat, num_experts)
    if pairwise:
        before = (key[None, :] < key[:, None]) | ((key[None, :] == key[:, None]) & (idx[None, :] < idx[:, None]))
        pos = before.sum(1, dtype=jnp.int32)
        return jnp.zeros(m, jnp.int32).at[pos].set(idx, unique_indices=True), pos
    order = jnp.argsort(key, stable=True).astype(jnp.int32)
    return order, jnp.zeros(m, jnp.int32).at[order].set(idx, unique_indices=True)


def moe(
    p: dict,
    cfg: ModelConfig,
    x: jax.Array,
    experts_fn=None,
    with_load=False,
    opts: Options = DEFAULT,
    real: jax.Array | None = None,
    x_q=None,
):
    """x [..., D] -> routed experts + shared experts (and, with_load, tokens routed to each expert [E] for EPLB).

    with_load: False, True (count every token) or a bool mask [...] of the tokens to count (padding rows of a
    batch route too, but must not count as load).
    real: a bool mask [...] of the tokens that are not padding (a decode step's inactive rows, a prefill chunk's
    padded tokens), or None (all are). With the local experts, padding tokens go to no expert: the grouped
    products skip their copies, and their routed output is zero.

    experts_fn(p, x, weights, ids, opts) runs the routed experts (default: all experts local, `experts`); an
    expert-parallel plan passes its own (sharding/ep.py) with the same contract.
    x_q: x quantised (`quantize_tokens(x)`) where the caller has it, for the local experts and the shared ones."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    num_experts = p["experts"]["gate"].shape[0]
    partials = router_partials(flat, p["router"])
    flat_q = None if x_q is None else (x_q[0].reshape(flat.shape), x_q[1].reshape(-1))
    n, e = partials.shape[1:]
    mode = route_mode(n, e, opts) if experts_fn is None and e == num_experts else "reference"
    copies = None
    if mode == "reference":
        weights, ids = route_reference(partials.sum(0), route_spec(cfg), p.get("router_bias"))
    else:  # routed and put in expert order by the routing kernels, with the copies' int8 rows for int8 experts
        q = None
        if int8_activations(p["experts"]["gate"]):
            q = flat_q = quantize_tokens(flat, token_quant_mode(flat, opts)) if flat_q is None else flat_q
        keep = None if real is None else real.reshape(-1)
        bias = p.get("router_bias")
        weights, ids, *copies = route_on_kernels(partials, route_spec(cfg), bias, keep, q, mode == "interpret")
    routed = ids
    if real is not None and experts_fn is None:  # past the last expert: counted in no group, sorted last
        routed = jnp.where(real.reshape(-1, 1), ids, num_experts)
    if experts_fn is None:
        out = experts(p["experts"], flat, weights, routed, opts, flat_q, copies)
    else:
        out = experts_fn(p["experts"], flat, weights, routed, opts)
    if "shared" in p:
        out = out + mlp(p["shared"], flat, opts, flat_q)
    if with_load is not False:
        real = None if with_load is True else jnp.repeat(with_load.reshape(-1), ids.shape[-1]).astype(jnp.int32)
        load = jnp.bincount(ids.reshape(-1), real, length=cfg.n_routed_experts).astype(jnp.int32)  # [E]
        return out.reshape(shape), load
    return out.reshape(shape)
