"""Expert-parallel load balancing (EPLB) with redundant experts, with the semantics of DeepSeek's public EPLB.

rebalance_experts(weight [L, E], num_replicas, num_groups, num_nodes, num_gpus) -> (phy2log, log2phy, logcnt)
  phy2log [L, num_replicas]: the logical expert in each physical slot; slot s lives on GPU s // (num_replicas /
      num_gpus) and node s // (num_replicas / num_nodes).
  log2phy [L, E, max replicas]: the slots of each logical expert, -1 padded.
  logcnt [L, E]: replicas per logical expert (>= 1).

Hierarchical when num_groups is divisible by num_nodes (DeepSeek's expert groups): groups are packed onto nodes so
node loads balance, experts are replicated within each node (hottest first, by load per replica), and the replicas
are packed onto the node's GPUs. Otherwise global: one node, one group.
Loads are numpy arrays of tokens per expert (from the routing counters, sharding.eplb.LoadWindow).
"""

from __future__ import annotations

import collections
import logging

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger("hcfjax.eplb")


def balanced_packing(weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Packs n items per row into num_packs packs of n / num_packs items each, heaviest first onto the lightest pack
    with room. weight [L, n] -> (pack [L, n], rank within pack [L, n])."""
    layers, n = weight.shape
    if n % num_packs:
        raise ValueError(f"{n} items do not split into {num_packs} equal packs")
    per_pack = n // num_packs
    pack = np.zeros((layers, n), np.int64)
    rank = np.zeros((layers, n), np.int64)
    for layer in range(layers):
        load = np.zeros(num_packs)
        count = np.zeros(num_packs, np.int64)
        for item in np.argsort(-weight[layer], kind="stable"):
            open_packs = np.flatnonzero(count < per_pack)
            p = open_packs[np.argmin(load[open_packs])]
            pack[layer, item], rank[layer, item] = p, count[p]
            load[p] += weight[layer, item]
            count[p] += 1
    return pack, rank


def replicate_experts(weight: np.ndarray, num_phy: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gives every expert one slot, then each extra slot to the expert with the highest load per replica.
    weight [L, n] -> (phy2log [L, num_phy], replica rank [L, num_phy], logcnt [L, n])."""
    layers, n = weight.shape
    if num_phy < n:
        raise ValueError(f"{num_phy} physical slots cannot hold {n} experts")
    phy2log = np.zeros((layers, num_phy), np.int64)
    phyrank = np.zeros((layers, num_phy), np.int64)
    logcnt = np.ones((layers, n), np.int64)
    phy2log[:, :n] = np.arange(n)
    for s in range(n, num_phy):
        hot = np.argmax(weight / logcnt, axis=1)
        phy2log[:, s] = hot
        phyrank[:, s] = logcnt[np.arange(layers), hot]
        logcnt[np.arange(layers), hot] += 1
    return phy2log, phyrank, logcnt


def _inverse(perm: np.ndarray) -> np.ndarray:
    inv = np.empty_like(perm)
    np.put_along_axis(inv, perm, np.broadcast_to(np.arange(perm.shape[1]), perm.shape), axis=1)
    return inv


def rebalance_hierarchical(weight: np.ndarray, num_phy: int, num_groups: int, num_nodes: int, num_gpus: int):
    layers, n_log = weight.shape
    if n_log % num_groups or num_groups % num_nodes or num_gpus % num_nodes or num_phy % num_gpus:
        raise ValueError(
            f"incompatible sizes: experts={n_log}, groups={num_groups}, nodes={num_nodes}, "
            f"gpus={num_gpus}, replicas={num_phy}"
        )
    group_size = n_log // num_groups
    groups_per_node = num_groups // num_nodes
    # 1. groups onto nodes
    group_load = weight.reshape(layers, num_groups, group_size).sum(-1)
    g_pack, g_rank = balanced_packing(group_load, num_nodes)
    # "mlog": logical experts renumbered so that each node's groups are contiguous
    group_slot = g_pack * groups_per_node + g_rank  # [L, groups]
    log2mlog = (group_slot[:, :, None] * group_size + np.arange(group_size)).reshape(layers, n_log)
    mlog2log = _inverse(log2mlog)
    # 2. replicate within each node
    mlog_load = np.take_along_axis(weight, mlog2log, axis=1).reshape(layers * num_nodes, n_log // num_nodes)
    phy2mlog, phyrank, mlogcnt = replicate_experts(mlog_load, num_phy // num_nodes)
    # 3. replicas onto the node's GPUs
    per_replica = np.take_along_axis(mlog_load / mlogcnt, phy2mlog, axis=1)
    p_pack, p_rank = balanced_packing(per_replica, num_gpus // num_nodes)
    phy_per_gpu = num_phy // num_gpus
    pphy2phy = _inverse(p_pack * phy_per_gpu + p_rank)
    pphy2mlog = np.take_along_axis(phy2mlog, pphy2phy, axis=1)  # within-node mlog ids
    pphy2mlog = (
        pphy2mlog.reshape(layers, num_nodes, -1) + (np.arange(num_nodes) * (n_log // num_nodes))[None, :, None]
    ).reshape(layers, -1)
    pphy2log = np.take_along_axis(mlog2log, pphy2mlog, axis=1)
    pphyrank = np.take_along_axis(phyrank, pphy2phy, axis=1).reshape(layers, -1)
    logcnt = np.take_along_axis(mlogcnt.reshape(layers, -1), log2mlog, axis=1)
    return pphy2log, pphyrank, logcnt


def rebalance_experts(weight, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int):
    """DeepSeek EPLB: (phy2log [L, R], log2phy [L, E, max count] -1 padded, logcnt [L, E])."""
    weight = np.asarray(weight, np.float64)
    if num_groups % num_nodes == 0:
        phy2log, phyrank, logcnt = rebalance_hierarchical(weight, num_replicas, num_groups, num_nodes, num_gpus)
    else:
        phy2log, phyrank, logcnt = rebalance_hierarchical(weight, num_replicas, 1, 1, num_gpus)
    layers, n_log = weight.shape
    log2phy = np.full((layers, n_log, int(logcnt.max())), -1, np.int64)
    for layer in range(layers):
        log2phy[layer, phy2log[layer], phyrank[layer]] = np.arange(num_replicas)
    return phy2log, log2phy, logcnt


def gpu_loads(weight: np.ndarray, phy2log: np.ndarray, logcnt: np.ndarray, num_gpus: int) -> np.ndarray:
    """Tokens per GPU [L, G] when each expert's tokens spread evenly over its replicas."""
    layers = weight.shape[0]
    per_slot = np.take_along_axis(weight / logcnt, phy2log, axis=1)
    return per_slot.reshape(layers, num_gpus, -1).sum(-1)


def imbalance(loads: np.ndarray) -> float:
    """Mean over layers of max / mean tokens per rank."""
    return float(np.mean(loads.max(1) / loads.mean(1)))


class LoadWindow:
    """Expert-load counters aggregated over a sliding window of steps: add per-step counts [L, E], read the sum."""

    def __init__(self, layers: int, experts: int, window: int):
        self.counts = np.zeros((window, layers, experts), np.int64)
        self.step = 0

    def add(self, counts) -> None:
        self.counts[self.step % len(self.counts)] = np.asarray(counts)
        self.step += 1

    def total(self) -> np.ndarray:
        return self.counts.sum(0)


def pad_log2phy(log2phy: np.ndarray, num_replicas: int) -> np.ndarray:
    """log2phy [L, E, M] -> [L, E, R - E + 1] (-1 padded): the most replicas one expert can get, so every placement
    with the same replica count has the same shapes and applying a new one needs no recompilation."""
    n_log = log2phy.shape[1]
    return np.pad(log2phy, ((0, 0), (0, 0), (0, num_replicas - n_log + 1 - log2phy.shape[2])), constant_values=-1)


def moe_experts(params: dict, cfg) -> list[dict]:
    """The routed-experts dict of every MoE segment, in layer order (each stacked over the segment's layers)."""
    segs = zip(params["segments"], cfg.layer_segments, strict=True)
    return [seg["mlp"]["experts"] for seg, (_, _, is_moe) in segs if is_moe]


def with_moe_experts(params: dict, cfg, experts: list[dict]) -> dict:
    """params with every MoE segment's routed-experts dict replaced (moe_experts' order); the rest is shared."""
    out = dict(params, segments=list(params["segments"]))
    new = iter(experts)
    for s, (_, _, is_moe) in enumerate(cfg.layer_segments):
        if is_moe:
            seg = out["segments"][s]
            out["segments"][s] = dict(seg, mlp=dict(seg["mlp"], experts=next(new)))
    return out


def _fill_slots(experts: list[dict], rows, log2phy, logcnt) -> list[dict]:
    """New physical slot s of MoE layer l holds row rows[l, s] of the current weight arrays [count, n, ...].
    rows [L, R]; log2phy [L, E, M] (padded), logcnt [L, E]: the new placement, stored beside the weights."""
    out, first = [], 0
    for ex in experts:
        count = jax.tree.leaves(ex["gate"])[0].shape[0]  # layers of the segment
        sl = slice(first, first + count)
        idx = jnp.asarray(rows[sl])  # [count, R]
        take = lambda w, idx=idx: jnp.take_along_axis(w, idx.reshape(idx.shape + (1,) * (w.ndim - 2)), axis=1)
        new = {k: jax.tree.map(take, ex[k]) for k in ("gate", "up", "down")}
        new["log2phy"] = jnp.asarray(log2phy[sl], jnp.int32)
        new["logcnt"] = jnp.asarray(logcnt[sl], jnp.int32)
        out.append(new)
        first += count
    return out


def apply_placement(params: dict, cfg, phy2log: np.ndarray, log2phy: np.ndarray, logcnt: np.ndarray) -> dict:
    """Re-lays out every MoE layer's routed experts into physical slots [R, ...] (replicas copied) and stores the
    layer's placement beside them (experts/log2phy [E, M], experts/logcnt [E]); sharding/ep.py routes each token
    copy to one replica of its expert, spreading an expert's tokens over its replicas.

    params: logical experts [E, ...] (as loaded). phy2log, log2phy, logcnt: rebalance_experts' output for the MoE
    layers in order (L = number of MoE layers). log2phy is padded to R - E + 1 columns (pad_log2phy).
    """
    log2phy = pad_log2phy(log2phy, phy2log.shape[1])
    return with_moe_experts(params, cfg, _fill_slots(moe_experts(params, cfg), phy2log, log2phy, logcnt))


def replace_placement(experts: list[dict], phy2log, log2phy, logcnt) -> list[dict]:
    """Moves routed experts that already carry a placement (moe_experts of apply_placement's output) to a new one
    with the same replica count: new slot s takes the first replica of its expert under the current placement, so
    the logical weights need not be kept anywhere. Same shapes in and out, so jitted with the experts' shardings as
    out_shardings (and donated) it re-places sharded experts in place. log2phy padded (pad_log2phy)."""
    current = jnp.concatenate([ex["log2phy"][:, :, 0] for ex in experts])  # [L, E] a slot of each expert now
    rows = jnp.take_along_axis(current, jnp.asarray(phy2log), axis=1)  # [L, R]
    return _fill_slots(experts, rows, log2phy, logcnt)


class LiveEplb:
    """EPLB while serving under a decode plan: the routed loads of the last `window` steps, the placement in use,
    and a re-placement of the sharded experts every `interval` steps.

    The physical slot count is E + redundant from the start (place() lays the loaded experts out under a placement
    for uniform load), so a re-placement changes array contents and the log2phy / logcnt tables, never shapes or
    shardings: the compiled steps stay valid. Slots are spread over the plan's ep ranks; num_nodes > 1 packs
    DeepSeek's expert groups onto nodes (hierarchical EPLB)."""

    def __init__(self, cfg, plan, redundant: int, interval: int, window: int, num_nodes: int = 1):
        self.cfg, self.plan, self.interval, self.num_nodes = cfg, plan, interval, num_nodes
        self.ranks = plan.mesh.shape["ep"]
        self.num_replicas = cfg.n_routed_experts + redundant
        if redundant < 0 or self.num_replicas % self.ranks or self.ranks % num_nodes:
            raise ValueError(
                f"EPLB: {cfg.n_routed_experts} experts + {redundant} redundant slots must split evenly over "
                f"{self.ranks} ep ranks (and the ranks over {num_nodes} nodes)"
            )
        n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
        self.window = LoadWindow(n_moe, cfg.n_routed_experts, window)
        self.placement = self._placement(np.ones((n_moe, cfg.n_routed_experts)))
        self.last_step = 0  # engine step of the last re-placement
        self.rebalances = 0
        self.history = collections.deque(maxlen=1000)  # (step, imbalance before, after) of recent re-placements
        self._replace = None  # compiled by place()

    def _placement(self, loads: np.ndarray):
        phy2log, log2phy, logcnt = rebalance_experts(
            loads, self.num_replicas, self.cfg.n_group, self.num_nodes, self.ranks
        )
        return phy2log, pad_log2phy(log2phy, self.num_replicas), logcnt

    def rank_loads(self, loads: np.ndarray, placement=None) -> np.ndarray:
        """Tokens per rank [L, ranks] for expert loads [L, E] under a placement (default: the one in use)."""
        phy2log, _, logcnt = placement or self.placement
        return gpu_loads(loads, phy2log, logcnt, self.ranks)

    def place(self, params: dict) -> dict:
        """Loaded params (logical experts) -> params under the current placement, sharded by the plan. Also compiles
        the re-placement (for these shardings), so serving never stops to compile it."""
        from sharding.plans import shard_params

        params = shard_params(apply_placement(params, self.cfg, *self.placement), self.plan)
        experts = moe_experts(params, self.cfg)
        shardings = jax.tree.map(lambda x: x.sharding, experts)
        fn = jax.jit(replace_placement, out_shardings=shardings, donate_argnums=0)
        self._replace = fn.lower(experts, *self.placement).compile()
        return params

    def observe(self, load) -> None:
        """One step's routed tokens per expert [L, E] (real rows only)."""
        self.window.add(load)

    def due(self, step: int) -> bool:
        return step - self.last_step >= self.interval and self.window.total().any()

    def rebalance(self, params: dict, step: int) -> dict:
        """A new placement for the window's loads, applied to params (placed by place()) without recompiling."""
        loads = self.window.total()
        placement = self._placement(loads)
        before = imbalance(self.rank_loads(loads))
        after = imbalance(self.rank_loads(loads, placement))
        params = self.apply(params, placement)
        self.last_step, self.rebalances = step, self.rebalances + 1
        self.history.append((step, before, after))
        log.info(
            "EPLB at step %d: per-rank imbalance %.3f -> %.3f (window of %d routed token copies)",
            step,
            before,
            after,
            int(loads.sum()),
        )
        return params

    def apply(self, params: dict, placement) -> dict:
        """Re-places the sharded experts of params (from place()) in place: donated, same shapes and shardings."""
        experts = self._replace(moe_experts(params, self.cfg), *placement)
        self.placement = placement
        return with_moe_experts(params, self.cfg, experts)
