"""Meshes and partition rules for the two plans of the reference deployment.

prefill (tp, ep): compute-bound, so tensor parallel. Attention heads are split over tp (q / kv up-projections
    column-parallel, o_proj row-parallel); the dense MLP and the shared experts are tensor parallel; routed experts
    are split over a small ep group, with each expert's width split over tp. The latent KV cache is replicated over
    tp (every head reads the whole latent).
decode (dp, ep): memory-bound on the KV cache, so data-parallel attention. Every rank holds the attention and dense
    weights, owns its own requests and their cache pages, and holds E / ep routed experts. The MoE exchanges routed
    tokens between ranks (sharding/ep.py).

One rule table per plan maps a params path to the PartitionSpec of its trailing dims; leading stacking dims (layers
of a segment) are never split. Plans are applied with jit shardings; shard_map is used only where communication is
written by hand.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sharding.ep import ep_experts

# (regex on the "/"-joined params path, spec of the trailing dims), first match wins
PREFILL_RULES: tuple[tuple[str, tuple], ...] = (
    (r"experts/(gate|up)$", ("ep", None, "tp")),  # [E, D, F]
    (r"experts/down$", ("ep", "tp", None)),  # [E, F, D]
    (r"attn/(q_b|q)$", (None, "tp", None)),  # [in, H, K]: heads over tp (column parallel)
    (r"attn/kv_b$", (None, "tp", None, None)),  # [2, H, C, N]: W_UK and W_UV, heads over tp
    (r"attn/o$", ("tp", None)),  # [H*V, D]: row parallel
    (r"(mlp|shared)/(gate|up)$", (None, "tp")),  # [D, F]
    (r"(mlp|shared)/down$", ("tp", None)),  # [F, D]
    (r"(lm_head|head)$", (None, "tp")),  # [D, V]: vocab parallel
)

DECODE_RULES: tuple[tuple[str, tuple], ...] = (
    (r"experts/(gate|up|down)$", ("ep", None, None)),  # experts over ep; everything else replicated
)


@dataclasses.dataclass(frozen=True)
class Plan:
    name: str  # "prefill" or "decode"
    mesh: Mesh
    rules: tuple[tuple[str, tuple], ...]

    @property
    def sizes(self) -> dict[str, int]:
        return dict(self.mesh.shape)

    # What a plan hands to the drivers (generate, the engine, the PD prefill worker), so that they need not know
    # its partition rules: placement, and the step under its shard_map.

    @property
    def ranks(self) -> int:
        """Data-parallel ranks of a decode plan: rows, slots and cache pages are split over them, rank major."""
        return self.mesh.shape["ep"]

    def place_params(self, params: dict) -> dict:
        return shard_params(params, self)

    def param_sharding(self, path: tuple, shape: tuple[int, ...]) -> NamedSharding:
        """The sharding of the param at params path `path` (its keys, as hcfjax.load's streaming placement names
        it) of full shape `shape`: what place_params gives that leaf."""
        return _param_sharding(self, "/".join(map(str, path)), shape)

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def rows(self) -> NamedSharding:
        """The sharding of per-row inputs of a decode plan (split over the ranks)."""
        return NamedSharding(self.mesh, P("ep"))

    def place_state(self, state):
        """A step.SlotState placed for the decode plan: slot rows and cache pages over the ranks."""
        return jax.device_put(state, jax.tree.map(lambda s: NamedSharding(self.mesh, s), _state_specs(state)))

    def wrap_step(self, cfg, params, state, with_prefill: bool, with_decode: bool, with_load, spec, opts):
        """hcfjax.step.step under the decode plan: a shard_map over the ranks, each running attention on its own
        slot rows and cache pages (page tables and slots in rank-local indices), the MoE exchanging routed tokens
        over EP (sharding.ep, opts.ep_exchange). Every rank runs every step; rows without work are mock rows that
        write nothing (and, with_load, add nothing to the expert loads, which are summed over the ranks).
        -> jitted fn(params, state, pre, dec) -> (state, first, next, load), state donated."""
        from hcfjax.step import step

        row = P("ep")
        # every leaf of a step's inputs is split by rows (one spec for the whole tree: its sampling batch's static
        # metadata, whether the step filters, may be either)
        pre_spec = row if with_prefill else None
        dec_spec = row if with_decode else None
        experts = ep_experts("ep", opts.ep_exchange)

        def local(params, state, pre, dec):  # sampling keys come from each row's seed and counter
            state, first, nxt, load = step(params, cfg, state, pre, dec, spec, opts, experts, with_load)
            return state, first, nxt, None if load is None else jax.lax.psum(load, "ep")

        st = _state_specs(state)
        specs = (param_specs(params, self), st, pre_spec, dec_spec)
        out = (st, row if with_prefill else None, row if with_decode else None, P() if with_load else None)
        fn = jax.shard_map(local, mesh=self.mesh, in_specs=specs, out_specs=out)
        xla = dict(opts.compiler_options(prefill=with_prefill)) or None
        return jax.jit(fn, donate_argnums=(1,), compiler_options=xla)

    def wrap_decode_steps(self, cfg, params, state, width: int, spec, opts):
        """hcfjax.step.decode_steps under the decode plan: the whole decode loop inside one shard_map (the ranks
        agree on when to stop). -> jitted fn(params, state, dec, stop_ids, max_new_tokens) -> (tokens [S, width],
        counters, state); max_new_tokens a scalar at most width. The same plan, model and settings get the same
        function back, so a second generate call reuses its compiled program."""
        leaves, tree = jax.tree.flatten((param_specs(params, self), _state_specs(state)), is_leaf=_is_spec)
        return _decode_steps_program(self, cfg, width, spec, opts, tuple(leaves), tree)


def _is_spec(x) -> bool:
    return isinstance(x, P)


@functools.cache
def _decode_steps_program(plan: Plan, cfg, width: int, spec, opts, spec_leaves: tuple, spec_tree):
    from hcfjax.step import decode_steps

    row = P("ep")
    experts = ep_experts("ep", opts.ep_exchange)

    def local(params, state, dec, stops, limit):
        return decode_steps(params, cfg, state, dec, stops, limit, spec, opts, experts, "ep", width)

    params_spec, st = jax.tree.unflatten(spec_tree, spec_leaves)
    counters = {"count": row, "steps": row, "evaluated": row, "accepted": row}
    specs = (params_spec, st, row, P(), P())  # the decode inputs split by rows, every leaf
    fn = jax.shard_map(local, mesh=plan.mesh, in_specs=specs, out_specs=(row, counters, st))
    return jax.jit(fn, donate_argnums=(1,), compiler_options=dict(opts.compiler_options()) or None)


def _devices(n: int, devices=None):
    devices = list(devices if devices is not None else jax.devices())
    if len(devices) < n:
        raise ValueError(f"the plan needs {n} devices, only {len(devices)} are available")
    return devices[:n]


def prefill_plan(tp: int, ep: int = 1, devices=None) -> Plan:
    """Mesh ('tp', 'ep') of tp * ep devices."""
    if tp < 1 or ep < 1:
        raise ValueError(f"tp and ep must be >= 1, got tp={tp}, ep={ep}")
    mesh = jax.make_mesh((tp, ep), ("tp", "ep"), axis_types=(AxisType.Auto,) * 2, devices=_devices(tp * ep, devices))
    return Plan("prefill", mesh, PREFILL_RULES)


def decode_plan(dp: int, ep: int | None = None, devices=None) -> Plan:
    """Mesh ('ep',) of dp devices. As in the reference's layout (DP=16, TP=1, EP=16 on 16 GPUs), the same ranks
    are attention-DP ranks and expert-parallel ranks, so ep must equal dp."""
    ep = dp if ep is None else ep
    if dp < 1 or ep != dp:
        raise ValueError(
            f"the decode plan runs attention-DP and EP on the same ranks: need dp == ep >= 1, got dp={dp}, ep={ep}"
        )
    mesh = jax.make_mesh((dp,), ("ep",), axis_types=(AxisType.Auto,), devices=_devices(dp, devices))
    return Plan("decode", mesh, DECODE_RULES)


def path_str(path) -> str:
    """A params path as the rules see it: dict keys, list indices and dataclass fields (a quantised weight's parts)
    joined by '/'."""
    return "/".join(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))) for k in path)


# The parts of a quantised weight: hcfjax.quant.QWeight's q [..., N, K'] and scale [..., K/G, N]; hcfjax.fp8.Fp8Weight's
# q [..., N, K] and scale_inv [..., N/B, K/B].
QUANT_PARTS = ("q", "scale", "scale_inv")


def spec_for(plan: Plan, path: str, shape: tuple[int, ...]) -> P:
    """The spec of the param at `path` of `shape`. A quantised weight's parts follow the rule of the weight
    W [..., K, N] they stand for: q is stored output-major (its last two dims swapped), and per-channel scales
    ([..., 1, N]) have nothing to split along K. An fp8 weight's block scales are split along the stacking dims
    alone (the layers, the experts), as q is; a per-head W [K, H, D] (MLA's q_b or q, int8 or fp8) is held
    flattened, [H*D, K], its heads split as the rule splits H. (MLA's attn/q is a plain weight where it is
    unquantised.)"""
    parent, _, part = path.rpartition("/")
    if part not in QUANT_PARTS or parent.endswith("attn"):
        return P(*_tail(plan, path, len(shape)))
    rule = _tail(plan, parent, 0)
    if not rule:
        return P()
    if parent.rpartition("/")[0].endswith("attn") and len(rule) == 3:  # per-head [K, H, D] held as [K, H*D]
        rule = rule[:2]
    tail = (None,) * (len(shape) - len(rule)) + rule
    if part == "q":
        return P(*tail[:-2], tail[-1], tail[-2])
    if part == "scale_inv":
        return P(*tail[:-2], None, None)
    return P(*tail[:-2], None if shape[-2] == 1 else tail[-2], tail[-1])


def _tail(plan: Plan, path: str, ndim: int) -> tuple:
    for pattern, tail in plan.rules:
        if re.search(pattern, path):
            tail = tuple(a if a in plan.mesh.axis_names else None for a in tail)
            return (None,) * (ndim - len(tail)) + tail
    return ()  # replicated


def param_specs(params: dict, plan: Plan) -> dict:
    """The PartitionSpec of every leaf of a params pytree under the plan."""
    return jax.tree_util.tree_map_with_path(lambda p, x: spec_for(plan, path_str(p), x.shape), params)


def _param_sharding(plan: Plan, path: str, shape: tuple[int, ...]) -> NamedSharding:
    spec = spec_for(plan, path, shape)
    for dim, axis in zip(shape, spec, strict=False):
        if axis is not None and dim % plan.mesh.shape[axis]:
            raise ValueError(
                f"{path} has {dim} along a dim split over {axis}={plan.mesh.shape[axis]} ({plan.name} plan): "
                "not divisible"
            )
    return NamedSharding(plan.mesh, spec)


def shard_params(params: dict, plan: Plan) -> dict:
    """Places params on the plan's mesh (each device gets its slices)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jax.device_put(x, _param_sharding(plan, path_str(path), x.shape)), params
    )


def _state_specs(state):
    """PartitionSpecs of a step.SlotState under a decode plan: slot rows and cache pages over the ranks."""
    from hcfjax.step import SlotState

    row = P("ep")
    drafts = None if state.drafts is None else jax.tree.map(lambda _: row, state.drafts)
    return SlotState(jax.tree.map(lambda _: P(None, "ep"), state.cache), row, row, row, drafts)
