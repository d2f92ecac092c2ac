"""EPLB: the placement's invariants on random loads, and the imbalance it removes on skewed (Zipf) loads."""

import numpy as np
import pytest

from sharding.eplb import LoadWindow, balanced_packing, gpu_loads, imbalance, rebalance_experts


def zipf_loads(layers, experts, seed, a=1.2):
    """Token counts per expert with a different hot set in every layer."""
    rng = np.random.default_rng(seed)
    base = 1.0 / np.arange(1, experts + 1) ** a
    return np.stack([rng.permutation(base) * 100000 for _ in range(layers)]).round()


@pytest.mark.parametrize(
    "experts,replicas,groups,nodes,gpus",
    [(16, 24, 4, 2, 8), (64, 80, 8, 2, 16), (32, 48, 4, 4, 8), (16, 20, 3, 2, 4), (256, 288, 8, 4, 32)],
)
def test_placement_invariants(experts, replicas, groups, nodes, gpus):
    if experts % groups:
        groups = 1
    w = np.random.default_rng(experts + replicas).integers(0, 1000, (3, experts))
    phy2log, log2phy, logcnt = rebalance_experts(w, replicas, groups, nodes, gpus)
    assert phy2log.shape == (3, replicas) and logcnt.shape == (3, experts)
    for layer in range(3):
        assert np.array_equal(np.bincount(phy2log[layer], minlength=experts), logcnt[layer])  # counts agree
        assert logcnt[layer].min() >= 1 and logcnt[layer].sum() == replicas
        for e in range(experts):
            slots = log2phy[layer, e][log2phy[layer, e] >= 0]
            assert len(slots) == logcnt[layer, e] and np.all(phy2log[layer, slots] == e)
            if groups % nodes == 0:  # hierarchical: every replica of an expert on one node
                assert len(set(slots // (replicas // nodes))) == 1
        # each node has spare slots here, and the first one it fills goes to its heaviest expert
        assert logcnt[layer, np.argmax(w[layer])] >= 2


def test_packing_is_balanced_and_full():
    w = np.array([[10, 9, 8, 7, 1, 1, 1, 1.0]])
    pack, rank = balanced_packing(w, 4)
    assert np.all(np.bincount(pack[0], minlength=4) == 2)
    loads = np.bincount(pack[0], weights=w[0], minlength=4)
    assert sorted(loads) == [8, 9, 10, 11]  # heaviest first, each onto the lightest pack with room


def test_eplb_brings_skewed_imbalance_down():
    layers, experts, gpus = 6, 64, 8
    w = zipf_loads(layers, experts, seed=0)
    no_eplb = imbalance(w.reshape(layers, gpus, -1).sum(-1))  # experts in order, 8 per GPU, no replicas
    phy2log, _, logcnt = rebalance_experts(w, experts + 16, 8, 1, gpus)
    balanced = imbalance(gpu_loads(w, phy2log, logcnt, gpus))
    print(f"imbalance without EPLB {no_eplb:.2f}, with {balanced:.2f}")
    assert no_eplb > 2.0 and balanced < 1.3


def test_load_window():
    win = LoadWindow(2, 4, window=3)
    for i in range(5):
        win.add(np.full((2, 4), i))
    assert np.all(win.total() == 2 + 3 + 4)


def test_bad_sizes():
    with pytest.raises(ValueError):
        rebalance_experts(np.ones((1, 16)), 12, 4, 2, 4)  # fewer slots than experts


def test_routing_load_counters_feed_the_balancer():
    """The forward pass counts tokens per expert per MoE layer; a window of them drives the placement."""
    import jax
    import jax.numpy as jnp

    import hcfjax
    from hcfjax.model import hidden_states
    from tests.conftest import FIXTURES

    model = hcfjax.load(FIXTURES / "tiny_v3", dtype=jnp.float32)
    cfg = model.cfg
    ids = jnp.asarray(np.load(FIXTURES / "tiny_v3" / "reference.npz")["ids"])
    pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    step = jax.jit(hidden_states, static_argnames=("cfg", "with_load"))
    h, _, load = step(model.params, cfg, ids, pos, with_load=True)
    h_plain, _ = step(model.params, cfg, ids, pos)
    assert np.array_equal(np.asarray(h), np.asarray(h_plain))  # counting changes nothing
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    assert load.shape == (n_moe, cfg.n_routed_experts)
    assert np.all(np.asarray(load).sum(1) == ids.size * cfg.num_experts_per_tok)
    window = LoadWindow(n_moe, cfg.n_routed_experts, window=4)
    window.add(load)
    w = window.total()
    phy2log, _, logcnt = rebalance_experts(w, cfg.n_routed_experts + 8, cfg.n_group, 1, 4)
    hottest = w.argmax(1)
    assert np.all(logcnt[np.arange(n_moe), hottest] >= 2)


def test_replace_placement_equals_placing_the_loaded_experts(v3_model):
    """Moving placed experts to a new placement (what the engine does live, without the logical weights) gives the
    same slots and tables as placing the loaded experts there directly."""
    import jax

    from sharding.eplb import apply_placement, moe_experts, pad_log2phy, replace_placement

    cfg = v3_model.cfg
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    old = rebalance_experts(zipf_loads(n_moe, 16, seed=1), 24, 4, 1, 4)
    new = rebalance_experts(zipf_loads(n_moe, 16, seed=2), 24, 4, 1, 4)
    placed = apply_placement(v3_model.params, cfg, *old)
    moved = replace_placement(moe_experts(placed, cfg), new[0], pad_log2phy(new[1], 24), new[2])
    fresh = moe_experts(apply_placement(v3_model.params, cfg, *new), cfg)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), moved, fresh))
    assert not np.array_equal(old[0], new[0])
