"""The capacity simulator's cost model against hand-computed cases, and the works a plan's steps compute."""

from __future__ import annotations

import math

import pytest

from hcfjax.engine.shapes import decode_bucket
from hcfjax.sim import Deployment, Pool
from hcfjax.sim.cost import CostModel, Work, tokens_per_step
from hcfjax.sim.deployment import model_config
from hcfjax.sim.gpus import DEEPSEEK_KERNELS, Efficiency, gpu
from hcfjax.sim.instances import new_request
from hcfjax.sim.weights import LayerParams
from hcfjax.sim.work import EngineShapes, actual_works

IDEAL = Efficiency(1, 1, 1, 1, 1, 1, 1, 1, 0.0)  # the datasheet, no overheads
V3 = model_config("deepseek-v3")


# -- cost model -------------------------------------------------------------------------------------------------------
def test_decode_attention_is_the_kv_read_on_h800():
    """One request, 4096 cached positions, bf16 cache: FLOPs 2 H (2C + R) per key, bytes (C + R) x 2 per key."""
    cm = CostModel(V3, gpu("H800"), IDEAL)
    w = Work(tokens=1, logits=1, dec_pairs=4096, dec_kv=4096)
    flops = 4096 * 2 * 128 * (2 * 512 + 64)
    nbytes = 4096 * 576 * 2
    per_layer = max(flops / 989e12, nbytes / 3.35e12)
    assert per_layer == nbytes / 3.35e12  # memory-bound at one query token
    assert cm.step([w]).parts["attn_decode"] == pytest.approx(61 * per_layer)


def test_mtp_verify_tokens_make_h20_attention_compute_bound():
    """3 query tokens (MTP-2 verify) x 128 heads on the H20: 148 TFLOP/s against 4 TB/s, compute wins."""
    cm = CostModel(V3, gpu("H20"), IDEAL)
    w = Work(tokens=3, logits=3, dec_pairs=3 * 4096, dec_kv=4096)
    flops = 3 * 4096 * 2 * 128 * (2 * 512 + 64)
    assert cm.step([w]).parts["attn_decode"] == pytest.approx(61 * flops / 148e12)


def test_lm_head_and_routed_experts_by_hand():
    cfg = model_config("tiny-v3")
    cm = CostModel(cfg, gpu("H200"), IDEAL)
    d, v = cfg.hidden_size, cfg.vocab_size
    parts = cm.step([Work(tokens=1, logits=1)]).parts
    assert parts["lm_head"] == pytest.approx(max(2 * d * v / 989e12, d * v * 2 / 4.8e12))
    # one token hits k experts: their weights are read, 3 D F each, bf16
    f, k = cfg.moe_intermediate_size, cfg.num_experts_per_tok
    n_moe = cfg.num_hidden_layers - cfg.first_k_dense_replace
    expect = max(2 * k * 3 * d * f / 989e12, k * 3 * d * f * 2 / 4.8e12)
    assert parts["moe_routed"] == pytest.approx(n_moe * expect)


def test_int4_experts_read_a_quarter_of_bf16_bytes_plus_scales():
    bf16 = CostModel(V3, gpu("H20"), IDEAL)
    w4 = CostModel(V3, gpu("H20"), IDEAL, quant="w4a8c8")
    w = [Work(tokens=1, logits=1)]
    int4 = 0.5 + 4 / 128  # bytes per parameter: float32 group scales
    assert w4.step(w).parts["moe_routed"] / bf16.step(w).parts["moe_routed"] == pytest.approx(int4 / 2)
    assert w4.kv_bytes(1, layers=1) == 576 + 8 and bf16.kv_bytes(1, layers=1) == 576 * 2


def test_fp8_is_priced_as_deepseek_stores_it_at_the_int8_rate():
    """fp8 experts: one byte and a float32 scale per 128 x 128 block, so one token's decode reads FP8_BYTES / 2 of
    bf16's expert bytes; a prefill chunk is compute-bound and runs at the int8 rate, as w8a8's does."""
    from hcfjax.sim.weights import FP8_BYTES

    bf16, fp8, w8a8 = (CostModel(V3, gpu("H20"), IDEAL, quant=q) for q in (None, "fp8", "w8a8"))
    one = [Work(tokens=1, logits=1)]
    assert fp8.step(one).parts["moe_routed"] / bf16.step(one).parts["moe_routed"] == pytest.approx(FP8_BYTES / 2)
    chunk = [Work(tokens=8192, pre_tokens=8192)]
    for part in ("moe_routed", "attn_proj"):
        got = fp8.step(chunk).parts[part]
        assert got == pytest.approx(w8a8.step(chunk).parts[part]) and got < bf16.step(chunk).parts[part], part


def test_q_b_and_o_run_at_their_formats_rate():
    """w4a8c8 holds MLA's q_b and o in int8, so a prefill chunk (compute-bound) runs them at the int8 rate; a
    checkpoint that holds them in bf16 (float_heads) runs them at bf16's: every layer's attn_proj differs by their
    FLOPs at the one rate and at the other, and nothing else does."""
    g, t, heads = gpu("H20"), 8192, LayerParams.of(V3).heads
    int8, held = (CostModel(V3, g, IDEAL, quant="w4a8c8", float_heads=f).step([Work(t, t)]) for f in (False, True))
    gap = V3.num_hidden_layers * 2 * t * heads * (1 / g.flops(False) - 1 / g.flops(True))
    assert held.parts["attn_proj"] - int8.parts["attn_proj"] == pytest.approx(gap)
    assert held.seconds - int8.seconds == pytest.approx(gap)


def test_all_to_all_matches_deepep_low_latency_at_ep16():
    """DeepEP's README (H800, CX7 400 Gb/s, 128 tokens per rank, top-8, fp8 dispatch, bf16 combine), EP16:
    dispatch 118 us + combine 195 us."""
    cm = CostModel(V3, gpu("H800"), DEEPSEEK_KERNELS, quant="w4a8", dp=16, ep=16)
    assert cm._all_to_all(128) == pytest.approx(313e-6, rel=0.15)
    assert CostModel(V3, gpu("H800"), DEEPSEEK_KERNELS, dp=8, ep=1)._all_to_all(128) == 0.0


def test_imbalance_slows_the_busiest_rank_and_tp_splits_work():
    w = [Work(tokens=64, logits=64)] * 8
    even = CostModel(V3, gpu("H20"), IDEAL, quant="w4a8c8", dp=8, ep=8, imbalance=1.0).step(w).parts["moe_routed"]
    hot = CostModel(V3, gpu("H20"), IDEAL, quant="w4a8c8", dp=8, ep=8, imbalance=1.5).step(w).parts["moe_routed"]
    assert hot > even
    one = CostModel(V3, gpu("H20"), IDEAL, quant="w4a8c8").step([Work(tokens=8192, pre_tokens=8192)])
    eight = CostModel(V3, gpu("H20"), IDEAL, quant="w4a8c8", tp=8).step([Work(tokens=8192, pre_tokens=8192)])
    assert eight.parts["attn_proj"] == pytest.approx(one.parts["attn_proj"] / 8)
    assert eight.parts["tp_all_reduce"] > 0 and "tp_all_reduce" not in one.parts


def test_transfer_and_speculation():
    cm = CostModel(V3, gpu("H20"), DEEPSEEK_KERNELS, quant="w4a8c8", spec_k=2)
    nbytes = cm.kv_bytes(1000)
    assert nbytes == 1000 * (61 + 2) * 584
    assert cm.transfer_seconds(nbytes) == pytest.approx(40e-6 + nbytes / (50e9 * 0.9))
    assert tokens_per_step([0.85, 0.65]) == pytest.approx(1 + 0.85 + 0.85 * 0.65)


def test_weights_fit_and_pages_follow_hbm():
    dep = Deployment(prefill=Pool(tp=8, ep=8), decode=Pool(dp=8, ep=8))
    cost = dep.cost_model(dep.decode)
    assert 60e9 < cost.weight_bytes_per_gpu() < 80e9  # ~330 GB of int4 experts over 8, attention replicated
    pages = dep.pages_per_rank(dep.decode, cost)
    assert pages == int((96e9 * 0.9 - cost.weight_bytes_per_gpu() - 4e9) // cost.kv_bytes(64))
    with pytest.raises(ValueError, match="does not fit"):
        dep.pages_per_rank(Pool(tp=2, ep=2), dep.cost_model(Pool(tp=2, ep=2)))


def test_weight_bytes_per_gpu_are_what_the_plans_place_on_a_device():
    """bf16 tiny-v3 with its MTP layer, placed by the real plans on 8 CPU devices: the bytes device 0 holds equal the
    cost model's weights per GPU (prefill TP2 x EP4 is a pool of tp=2, dp=4; decode is dp=8, ep=8), and the
    parameter count equals the checkpoint name table's."""
    import jax
    import jax.numpy as jnp

    from hcfjax.model import init_params
    from hcfjax.sim.weights import count, main_weights, mtp_weights
    from hcfjax.tensor_specs import tensor_specs
    from sharding.plans import decode_plan, prefill_plan

    cfg = model_config("tiny-v3")
    assert count(main_weights(cfg) + mtp_weights(cfg)) == sum(math.prod(s.shape) for s in tensor_specs(cfg))
    params = init_params(cfg, jax.random.key(0), jnp.bfloat16)
    device = jax.devices()[0]
    for plan, pool in ((prefill_plan(tp=2, ep=4), dict(tp=2, dp=4, ep=4)), (decode_plan(dp=8), dict(dp=8, ep=8))):
        placed = plan.place_params(params)
        held = sum(s.data.nbytes for x in jax.tree.leaves(placed) for s in x.addressable_shards if s.device == device)
        cost = CostModel(cfg, gpu("H200"), IDEAL, spec_k=1, **pool)
        assert cost.weight_bytes_per_gpu() == held, plan.name
    assert CostModel(cfg, gpu("H200"), IDEAL, dp=8, ep=8).weight_bytes_per_gpu() < held  # no MTP without drafts


# -- what a plan computes ---------------------------------------------------------------------------------------------
def _plan(chunks_reqs, decode_reqs):
    from hcfjax.engine.scheduler import Chunk, StepPlan

    return StepPlan([Chunk(r, s, n, f) for r, s, n, f in chunks_reqs], decode_reqs)


def test_actual_and_engine_works():
    a, b = new_request("a", 100, 8, 0.0), new_request("b", 300, 8, 0.0)
    a.rank, a.cached_bound, a.slot, b.rank = 1, 50, 5, 0
    plan = _plan([(b, 0, 200, False)], [a])
    w = actual_works(plan, dp=2)
    assert (w[1].tokens, w[1].dec_pairs, w[1].dec_kv) == (1, 50, 50)
    assert (w[0].tokens, w[0].pre_pairs, w[0].logits) == (200, 200 * 201 // 2, 0)
    shapes = EngineShapes(ranks=1, slots=32, keys=4160, max_rows=2, token_budget=256, min_bucket=64)
    (e,) = shapes.works(plan)
    assert e.tokens == 8 + 256 and e.dec_kv == 8 * 4160  # 8 rows hold the one request; the whole page table
    assert e.pre_pairs == 256 * 4160 and e.logits == 8 + 1
    a.slot = 20  # wherever its slot: the runner packs the decoding requests into the first rows
    many = [new_request(str(i), 100, 8, 0.0) for i in range(9)]
    assert [shapes.decode_rows(plan), shapes.decode_rows(_plan([], many))] == [8, 16]
    crowd = [new_request(str(i), 100, 8, 0.0) for i in range(23)]
    assert shapes.decode_rows(_plan([], crowd)) == 24  # the runner's decode_bucket: 3 x 8, not 32
    for least in (1, 4, 8):  # the smallest size of the form 2^k or 3 x 2^k, a multiple of `least`, that holds n
        sizes = sorted({m for k in range(10) for m in (1 << k, 3 << k) if m % least == 0})
        assert all(decode_bucket(n, least) == next(m for m in sizes if m >= n) for n in range(1, 300))
    assert shapes.decode_rows(_plan([(b, 0, 200, False)], [])) == 0
    step = shapes.step_shapes
    assert step.tokens(65) == 128 and step.tokens(10) == 64 and step.rows(3) == 2
