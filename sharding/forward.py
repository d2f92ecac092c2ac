"""The model's forward under a plan: jit shardings for the prefill plan, shard_map with explicit EP for decode."""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hcfjax.config import ModelConfig
from hcfjax.model import hidden_states, logits
from sharding.ep import ep_experts
from sharding.plans import Plan, param_specs


def pad_rows(x: np.ndarray, multiple: int, fill=0) -> tuple[np.ndarray, int]:
    """Pads the batch with mock rows so every rank gets the same number; returns (padded, real rows)."""
    b = x.shape[0]
    pad = -b % multiple
    return np.concatenate([x, np.full((pad,) + x.shape[1:], fill, x.dtype)]) if pad else x, b


def prefill_logits(plan: Plan, params: dict, cfg: ModelConfig, tokens) -> jax.Array:
    """Teacher-forced logits [B, T, V] with params laid out by the prefill plan (XLA inserts the TP collectives)."""
    tokens = np.asarray(tokens, np.int32)  # host arrays go in as they are (jnp ops here would compile per shape)
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    with jax.set_mesh(plan.mesh):
        return _logits(params, cfg, tokens, positions)


@jax.jit(static_argnames=("cfg",))
def _logits(params, cfg, tokens, positions):
    return logits(params, hidden_states(params, cfg, tokens, positions)[0])


def decode_plan_logits(plan: Plan, params: dict, cfg: ModelConfig, tokens, exchange="dense") -> jax.Array:
    """Teacher-forced logits under the decode plan: each rank runs attention on its own rows (mock rows pad the
    batch to a multiple of the ranks) and the MoE exchanges routed tokens between the ranks (sharding.ep.ep_experts'
    `exchange`)."""
    ranks = plan.mesh.shape["ep"]
    tokens, b = pad_rows(np.asarray(tokens, np.int32), ranks)
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    spec_leaves, spec_tree = jax.tree.flatten(param_specs(params, plan))
    fn = _decode_plan_forward(plan, cfg, exchange, tuple(spec_leaves), spec_tree)
    rows = NamedSharding(plan.mesh, P("ep"))
    return fn(params, jax.device_put(tokens, rows), jax.device_put(positions, rows))[:b]


@functools.lru_cache(maxsize=8)
def _decode_plan_forward(plan: Plan, cfg: ModelConfig, exchange: str, spec_leaves: tuple, spec_tree):
    """decode_plan_logits' jitted shard_map, one per plan, model and params' layout (a second call with the same
    ones compiles nothing)."""
    specs = jax.tree.unflatten(spec_tree, spec_leaves)

    def local(p, t, pos):
        h, _ = hidden_states(p, cfg, t, pos, experts_fn=ep_experts("ep", exchange))
        return logits(p, h)

    return jax.jit(jax.shard_map(local, mesh=plan.mesh, in_specs=(specs, P("ep"), P("ep")), out_specs=P("ep")))
