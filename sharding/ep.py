"""Expert parallelism: explicit dispatch / combine of routed tokens between the ranks that own the experts.

Inside a shard_map over the EP axis each rank holds its own tokens and E / n of the experts (rank r owns experts
r * E_l .. (r + 1) * E_l - 1). A token's k routed copies travel to the owners of their experts with one all_to_all,
are computed there with the grouped matmul, and come back with a second all_to_all; the source rank combines them
with the routing weights.

The exchange has a fixed capacity per (source, destination) pair, so every rank runs the same shapes: a token's
experts are distinct, so it sends at most min(k, E_l) copies to one rank, and C = N_local * min(k, E_l) can never
overflow. No token is ever dropped. (`lax.ragged_all_to_all`, which would move only the real rows, does not run on
CPU in jax 0.11; this path runs everywhere.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hcfjax.moe import experts as local_experts


def ep_experts(axis: str):
    """An experts function (same contract as hcfjax.moe.experts) that runs the routed experts over `axis`.

    p: this rank's experts {gate, up: [E_l, D, F], down: [E_l, F, D]}; x [N, D] this rank's tokens;
    weights, ids [N, K] with global expert ids. With an EPLB placement (sharding.eplb.apply_placement) p also has
    log2phy [E, M] and logcnt [E], and the slots are physical replicas.
    """

    def run(p: dict, x: jax.Array, weights: jax.Array, ids: jax.Array) -> jax.Array:
        n_ranks = jax.lax.axis_size(axis)
        e_local = p["gate"].shape[0]  # expert slots per rank
        n, k = ids.shape
        cap = n * min(k, e_local)
        flat = ids.reshape(-1)  # [N*K] logical experts
        if "log2phy" in p:
            # EPLB placement: copy c of logical expert e goes to replica c mod count(e), so an expert's tokens
            # spread over its replicas; slots are physical from here on.
            copy = jnp.arange(n * k) + jax.lax.axis_index(axis) * n * k
            flat = p["log2phy"][flat, copy % p["logcnt"][flat]]  # distinct experts -> distinct slots: cap holds
        dest = flat // e_local
        # slot of each copy inside its destination's block: rank among copies to the same destination
        order = jnp.argsort(dest, stable=True)
        sorted_dest = dest[order]
        first = jnp.searchsorted(sorted_dest, jnp.arange(n_ranks))  # start of each destination's run
        slot_sorted = jnp.arange(n * k) - first[sorted_dest]
        slot = jnp.zeros_like(slot_sorted).at[order].set(slot_sorted)
        token = jnp.arange(n * k) // k
        send_x = jnp.zeros((n_ranks, cap, x.shape[-1]), x.dtype).at[dest, slot].set(x[token])
        send_e = jnp.full((n_ranks, cap), -1, jnp.int32).at[dest, slot].set(flat % e_local)

        recv_x = jax.lax.all_to_all(send_x, axis, 0, 0, tiled=False)  # [n_ranks (source), cap, D]
        recv_e = jax.lax.all_to_all(send_e, axis, 0, 0, tiled=False)
        rows_x = recv_x.reshape(-1, x.shape[-1])
        rows_e = recv_e.reshape(-1)
        valid = rows_e >= 0
        # Each received row is one routed copy for one local expert: weight 1, combined at the source.
        y = local_experts(
            {w: p[w] for w in ("gate", "up", "down")},
            rows_x,
            valid[:, None].astype(jnp.float32),
            jnp.where(valid, rows_e, 0)[:, None],
        )
        y = jnp.where(valid[:, None], y, 0).reshape(n_ranks, cap, -1)

        back = jax.lax.all_to_all(y, axis, 0, 0, tiled=False)  # [n_ranks (destination), cap, D]
        copies = back[dest, slot].astype(jnp.float32) * weights.reshape(-1)[:, None]  # [N*K, D]
        return jnp.zeros((n, x.shape[-1]), jnp.float32).at[token].add(copies).astype(x.dtype)

    return run
