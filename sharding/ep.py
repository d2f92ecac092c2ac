"""Expert parallelism: explicit dispatch / combine of routed tokens between the ranks that own the experts.

Inside a shard_map over the EP axis each rank holds its own tokens and E_l = E / n of the expert slots (rank r owns
slots r * E_l .. (r + 1) * E_l - 1). A token's k routed copies travel to the owners of their experts, are computed
there with the grouped matmul, and come back the same way; the source rank combines them with the routing weights.

Each rank sorts its N * K copies by slot (so by destination rank, then by expert) and the ranks all_gather their
copies per slot ([n * E_l] integers each). From that table every rank knows what it sends where, what it receives
from whom, and which local expert each received row is for, so no expert ids travel with the rows. A token's experts
are distinct, so it sends at most min(k, E_l) copies to one rank: C = N * min(k, E_l) rows from one source always
fit, and the receive buffer of n * C rows holds the worst case (every rank sending all its copies to this one).
No token is ever dropped. Two exchanges move the rows:

dense:  `all_to_all` of fixed-capacity blocks [n, C, D]. Every rank sends n * C rows whatever the routing,
        n * min(k, E_l) / k times the N * K real copies (n times at DeepSeek-V3's k = 8 <= E_l). Runs everywhere.
ragged: `lax.ragged_all_to_all` of the real rows only, packed by source in the receiver's buffer. XLA implements
        it on GPU but not on CPU (jax 0.11); the tests check its offsets with a CPU stand-in (tests/test_ep.py).
        `python -m hcfjax.bench.ep` compares the two on GPUs.

Dense is the default (hcfjax.options.Options.ep_exchange): on two H200s XLA's ragged_all_to_all measured several
times slower than the dense all_to_all of twice the bytes (docs/results.md), so ragged is opt-in until XLA's
implementation (or a hand-written one) wins.

In both, the received rows lie in groups (source, local expert); padding rows outside every group get an
out-of-range expert (no group of the grouped matmul) and are zeroed.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from hcfjax.moe import experts as local_experts
from hcfjax.options import DEFAULT, EXCHANGES, Options


def ep_experts(axis: str, exchange: str | Callable = "dense", compute: Callable | None = None):
    """An experts function (same contract as hcfjax.moe.experts) that runs the routed experts over `axis`.

    p: this rank's experts {gate, up: [E_l, D, F], down: [E_l, F, D]}; x [N, D] this rank's tokens;
    weights, ids [N, K] with global expert ids. With an EPLB placement (sharding.eplb.apply_placement) p also has
    log2phy [E, M] and logcnt [E], and the slots are physical replicas.

    exchange: 'dense' or 'ragged' (module docstring), or a function with `lax.ragged_all_to_all`'s signature to run
    the ragged path with (the tests' CPU stand-in). compute(p, rows [M, D], expert [M], opts) -> [M, D]:
    what a rank does with the rows it receives, expert = E_l on padding rows (default: its experts; the benchmark
    times the exchange alone with the identity).
    """
    if not callable(exchange) and exchange not in EXCHANGES:
        raise ValueError(f"EP exchange must be one of {EXCHANGES}, got {exchange!r}")
    ragged = exchange if callable(exchange) else (jax.lax.ragged_all_to_all if exchange == "ragged" else None)
    compute = compute or _run_experts

    def run(p: dict, x: jax.Array, weights: jax.Array, ids: jax.Array, opts: Options = DEFAULT) -> jax.Array:
        n_ranks, me = jax.lax.axis_size(axis), jax.lax.axis_index(axis)
        e_local = p["gate"].shape[0]  # expert slots per rank
        n, k = ids.shape
        slots = _physical_slots(p, ids, axis)  # [N*K]
        order = jnp.argsort(slots, stable=True)  # copies by destination rank, then by expert
        token = order // k  # source token of each sorted copy
        counts = jnp.bincount(slots, length=n_ranks * e_local).astype(jnp.int32)
        table = jax.lax.all_gather(counts, axis).reshape(n_ranks, n_ranks, e_local)  # [source, dest, E_l] copies
        cap = n * min(k, e_local)  # most rows one source sends one rank
        own = lambda rows, expert: compute(p, rows, expert, opts)  # noqa: E731
        serve = lambda rows, block_start: _on_received(rows, table[:, me], block_start, own)
        if ragged is None:
            ys = _dense(axis, me, x[token], slots[order] // e_local, table, cap, serve)
        else:
            ys = _ragged(ragged, axis, me, x[token], table, cap, serve)
        copies = ys.astype(jnp.float32) * weights.reshape(-1)[order][:, None]  # [N*K, D]
        return jnp.zeros((n, x.shape[-1]), jnp.float32).at[token].add(copies).astype(x.dtype)

    return run


def _physical_slots(p: dict, ids: jax.Array, axis: str) -> jax.Array:
    """The slot of each routed copy [N*K]: the expert itself, or under an EPLB placement one of its replicas (copy
    c of expert e goes to replica c mod count(e), so an expert's tokens spread over its replicas). A token's
    experts are distinct, and so are their replicas' slots: the capacity bound holds for slots too."""
    flat = ids.reshape(-1)
    if "log2phy" not in p:
        return flat
    copy = jnp.arange(flat.shape[0]) + jax.lax.axis_index(axis) * flat.shape[0]
    return p["log2phy"][flat, copy % p["logcnt"][flat]]


def _exclusive_cumsum(a: jax.Array, axis: int) -> jax.Array:
    return jnp.cumsum(a, axis=axis) - a


def _dense(axis, me, xs, dest, table, cap, serve):
    """Fixed-capacity exchange. xs [N*K, D] this rank's sorted copies, dest [N*K] their ranks; table [source,
    dest, E_l] copies; serve(rows, block_start) computes a receive buffer -> the copies' outputs [N*K, D]."""
    n_ranks = table.shape[0]
    sizes = table.sum(-1)  # [source, dest] rows
    pos = jnp.arange(xs.shape[0]) - _exclusive_cumsum(sizes[me], 0)[dest]  # row within its destination's block
    send = jnp.zeros((n_ranks, cap, xs.shape[-1]), xs.dtype).at[dest, pos].set(xs)
    recv = jax.lax.all_to_all(send, axis, 0, 0, tiled=False)  # [n_ranks (source), cap, D]
    y = serve(recv.reshape(n_ranks * cap, -1), jnp.arange(n_ranks) * cap)
    back = jax.lax.all_to_all(y.reshape(n_ranks, cap, -1), axis, 0, 0, tiled=False)  # [n_ranks (dest), cap, D]
    return back[dest, pos]


def _ragged(ragged_all_to_all, axis, me, xs, table, cap, serve):
    """Exchange of the real rows only (same arguments as _dense, less dest), into a worst-case receive buffer of
    n_ranks * cap rows."""
    n_ranks = table.shape[0]
    sizes = table.sum(-1)  # [source, dest] rows
    at_source = _exclusive_cumsum(sizes, 1)  # [source, dest]: start of dest's rows in the source's sorted copies
    at_dest = _exclusive_cumsum(sizes, 0)  # [source, dest]: start of source's rows in dest's receive buffer
    buf = jnp.zeros((n_ranks * cap, xs.shape[-1]), xs.dtype)
    # output_offsets are where the rows land on the receiver: at_dest[me, d] for the rows sent to d
    recv = ragged_all_to_all(xs, buf, at_source[me], sizes[me], at_dest[me], sizes[:, me], axis_name=axis)
    y = serve(recv, at_dest[:, me])
    # back: the transposed slices, each source's block returned to where it came from in the source's copies
    return ragged_all_to_all(
        y, jnp.zeros_like(xs), at_dest[:, me], sizes[:, me], at_source[:, me], sizes[me], axis_name=axis
    )


def _on_received(rows, groups, block_start, compute):
    """compute(rows, expert) on a receive buffer rows [M, D] that holds each source's block at block_start
    [source], sorted by local expert with groups [source, E_l] rows each; rows outside every group are padding: their
    expert is E_l and they give 0."""
    m, e_local = rows.shape[0], groups.shape[1]
    start = (block_start[:, None] + _exclusive_cumsum(groups, 1)).reshape(-1)  # [source * E_l]
    end = start + groups.reshape(-1)
    # a row's group is the last one starting at or before it (groups sharing a start are empty except the last)
    first = jnp.zeros(m, jnp.int32).at[start].max(jnp.arange(1, start.shape[0] + 1, dtype=jnp.int32), mode="drop")
    g = jax.lax.cummax(first) - 1
    valid = (g >= 0) & (jnp.arange(m) < end[g])
    expert = jnp.where(valid, g % e_local, e_local)
    return jnp.where(valid[:, None], compute(rows, expert), 0)


def _run_experts(p, rows, expert, opts: Options = DEFAULT):
    """The rank's experts on its received rows, each one routed copy of weight 1 (combined at its source); padding
    rows (expert = E_l) fall outside every group of the grouped matmul."""
    ones = jnp.ones((rows.shape[0], 1), jnp.float32)
    return local_experts({w: p[w] for w in ("gate", "up", "down")}, rows, ones, expert[:, None], opts)
