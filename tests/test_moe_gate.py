"""DeepSeek-V2's MoE gate against a numpy rendering of DeepSeek's own modelling code (modeling_deepseek.py's
MoEGate), for both values of norm_topk_prob; transformers' V2 router ignores the flag, so it cannot be the reference."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hcfjax.moe import route, router_logits
from hcfjax.random_model import preset_config


def deepseek_v2_gate(x, weight, cfg):
    """DeepSeek-V2's MoEGate.forward in numpy: x [N, D], weight [E, D] -> (topk_idx [N, K], topk_weight [N, K])."""
    logits = x.astype(np.float64) @ weight.astype(np.float64).T
    scores = np.exp(logits - logits.max(-1, keepdims=True))
    scores /= scores.sum(-1, keepdims=True)  # softmax
    n, e = scores.shape
    if cfg.topk_method == "group_limited_greedy":
        group_scores = scores.reshape(n, cfg.n_group, -1).max(-1)
        group_idx = np.argsort(-group_scores, -1)[:, : cfg.topk_group]
        group_mask = np.zeros_like(group_scores)
        np.put_along_axis(group_mask, group_idx, 1, -1)
        score_mask = np.repeat(group_mask, e // cfg.n_group, -1)
        scores = np.where(score_mask > 0, scores, 0.0)
    topk_idx = np.argsort(-scores, -1)[:, : cfg.num_experts_per_tok]
    topk_weight = np.take_along_axis(scores, topk_idx, -1)
    # norm gate to sum 1, or scale: one or the other
    if cfg.num_experts_per_tok > 1 and cfg.norm_topk_prob:
        topk_weight = topk_weight / (topk_weight.sum(-1, keepdims=True) + 1e-20)
    else:
        topk_weight = topk_weight * cfg.routed_scaling_factor
    return topk_idx, topk_weight


def by_expert(ids, weights):
    """Each row's (expert, weight) pairs ordered by expert, so top-k orders need not agree."""
    order = np.argsort(ids, -1)
    return np.take_along_axis(ids, order, -1), np.take_along_axis(weights, order, -1)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
@pytest.mark.parametrize(
    "gate",
    [
        dict(topk_method="greedy", n_group=1, topk_group=1, num_experts_per_tok=3),
        dict(topk_method="group_limited_greedy", n_group=4, topk_group=2, num_experts_per_tok=3),
        dict(topk_method="greedy", n_group=1, topk_group=1, num_experts_per_tok=1),
    ],
)
def test_v2_gate_follows_deepseeks_code(gate, norm_topk_prob):
    base = preset_config("v2-lite")
    cfg = dataclasses.replace(base, norm_topk_prob=norm_topk_prob, routed_scaling_factor=16.0, **gate)
    assert cfg.model_type == "deepseek_v2"
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, cfg.hidden_size)).astype(np.float32)
    weight = rng.normal(size=(cfg.n_routed_experts, cfg.hidden_size)).astype(np.float32) * 0.02
    want_ids, want_w = by_expert(*deepseek_v2_gate(x, weight, cfg))
    w, ids = route({"router": jnp.asarray(weight.T)}, cfg, jnp.asarray(x))
    got_ids, got_w = by_expert(np.asarray(ids), np.asarray(w))
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-4, atol=1e-7)
    scaled = not (norm_topk_prob and cfg.num_experts_per_tok > 1)
    # normalised rows sum to 1 (not 16); scaled rows keep the softmax mass times 16
    assert np.allclose(got_w.sum(-1), 1.0, rtol=1e-5) != scaled


@settings(max_examples=40, deadline=None)
@given(
    st.integers(1, 8),
    st.integers(1, 6),
    st.integers(1, 70),
    st.integers(0, 2**32 - 1),
    st.booleans(),
)
def test_pairwise_sort_orders_copies_as_a_stable_argsort(e, k, n, seed, pairwise):
    """hcfjax.moe.by_expert (a decode step's copies ordered by expert without a GPU sort, or an argsort) is
    argsort(stable) of the expert ids, with an EP plan's padding ids (the expert count and above) last, and pos its
    inverse. expert_counts is the bincount of the real ids."""
    from hcfjax import moe

    ids = np.random.default_rng(seed).integers(0, e + 3, n * k).astype(np.int32)  # e and above: padding
    order, pos = moe.by_expert(jnp.asarray(ids), e, pairwise)
    np.testing.assert_array_equal(np.asarray(order), np.argsort(np.minimum(ids, e), kind="stable"))
    np.testing.assert_array_equal(np.asarray(order)[np.asarray(pos)], np.arange(n * k))
    counts = moe.expert_counts(jnp.asarray(ids), e)
    np.testing.assert_array_equal(np.asarray(counts), np.bincount(ids, minlength=e + 3)[:e])


@pytest.mark.parametrize("d", [96, 128, 384, 1024])
def test_router_logits_in_slices_are_the_product(d):
    """router_logits sums the products of 128-wide slices of D: the float32 product x @ w all the same."""
    rng = np.random.default_rng(d)
    x, w = rng.standard_normal((5, d), np.float32), rng.standard_normal((d, 16), np.float32)
    got = np.asarray(router_logits(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w)))  # bf16 activations, as the model's
    want = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64) @ w.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
