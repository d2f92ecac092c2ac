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
import re

import jax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# (regex on the "/"-joined params path, spec of the trailing dims), first match wins
PREFILL_RULES: tuple[tuple[str, tuple], ...] = (
    (r"experts/(gate|up)$", ("ep", None, "tp")),  # [E, D, F]
    (r"experts/down$", ("ep", "tp", None)),  # [E, F, D]
    (r"attn/(q_b|q|kv_b)$", (None, "tp", None)),  # [in, H, K]: heads over tp (column parallel)
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
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def spec_for(plan: Plan, path: str, ndim: int) -> P:
    for pattern, tail in plan.rules:
        if re.search(pattern, path):
            tail = tuple(a if a in plan.mesh.axis_names else None for a in tail)
            return P(*((None,) * (ndim - len(tail)) + tail))
    return P()


def param_specs(params: dict, plan: Plan) -> dict:
    """The PartitionSpec of every leaf of a params pytree under the plan."""
    return jax.tree_util.tree_map_with_path(lambda p, x: spec_for(plan, path_str(p), x.ndim), params)


def shard_params(params: dict, plan: Plan) -> dict:
    """Places params on the plan's mesh (each device gets its slices)."""

    def place(path, x):
        spec = spec_for(plan, path_str(path), x.ndim)
        for dim, axis in zip(x.shape, spec, strict=False):
            if axis is not None and dim % plan.mesh.shape[axis]:
                raise ValueError(
                    f"{path_str(path)} has {dim} along a dim split over {axis}="
                    f"{plan.mesh.shape[axis]} ({plan.name} plan): not divisible"
                )
        return jax.device_put(x, NamedSharding(plan.mesh, spec))

    return jax.tree_util.tree_map_with_path(place, params)
