"""Sharding plans on 8 fake CPU devices: prefill TP + EP with jit shardings, decode attention-DP x EP with explicit
EP dispatch (the dense exchange here; tests/test_ep.py checks the ragged one) and mock rows for idle ranks. Every
plan must reproduce the single-device model."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hcfjax  # noqa: E402
from sharding.forward import decode_plan_logits, pad_rows, prefill_logits
from sharding.plans import decode_plan, param_specs, prefill_plan, shard_params
from tests.conftest import FIXTURES, PARITY, rel_err
from tests.engine_helpers import xla_compiles


@pytest.fixture(scope="module", params=PARITY)
def case(request):
    model = hcfjax.load(FIXTURES / request.param, dtype=jnp.float32)
    return model, np.load(FIXTURES / request.param / "reference.npz")


def on_host(params):
    """params as numpy arrays, for shard_params: jax.device_put slices a host array into the plan's shards in place,
    where a device array is sliced by a small compiled program per shape and slicing (~160 compiles, ~7 s of this
    file). The placement, and so the arrays each device holds, are the same."""
    return jax.tree.map(np.asarray, params)


def test_eight_devices_are_available():
    assert len(jax.devices()) == 8


@pytest.mark.parametrize("tp,ep", [(4, 2), (2, 4), (4, 1)])
def test_prefill_plan_matches_single_device(case, tp, ep):
    model, ref = case
    if model.cfg.n_routed_experts % ep or model.cfg.num_attention_heads % tp:
        pytest.skip("shape not divisible by this plan")
    plan = prefill_plan(tp, ep)
    params = shard_params(on_host(model.params), plan)
    lg = prefill_logits(plan, params, model.cfg, ref["ids"])
    assert rel_err(lg, ref["logits"]) < 1e-4
    # the plan really splits the weights
    kv_b = params["segments"][0]["attn"]["kv_b"]
    assert kv_b.addressable_shards[0].data.shape[2] == model.cfg.num_attention_heads // tp


@pytest.mark.parametrize("ranks,rows", [(8, 3), (4, 8), (2, 5)])
def test_decode_plan_with_explicit_ep_matches_single_device(case, ranks, rows):
    """rows < ranks leaves ranks with only mock rows; they must not change the real rows' results."""
    model, ref = case
    if model.cfg.n_routed_experts % ranks:
        pytest.skip("experts not divisible by the ranks")
    plan = decode_plan(ranks)
    params = shard_params(on_host(model.params), plan)
    experts = params["segments"][-1]["mlp"]["experts"]["gate"]
    assert experts.addressable_shards[0].data.shape[1] == model.cfg.n_routed_experts // ranks
    ids = np.concatenate([ref["ids"]] * 3)[:rows]
    want = np.concatenate([ref["logits"]] * 3)[:rows]
    lg = decode_plan_logits(plan, params, model.cfg, ids)
    assert lg.shape == want.shape and rel_err(lg, want) < 1e-4


def test_rule_tables():
    model = hcfjax.load(FIXTURES / "tiny_v3", dtype=jnp.float32)
    specs = param_specs(model.params, prefill_plan(4, 2))
    assert specs["segments"][1]["mlp"]["experts"]["gate"] == jax.sharding.PartitionSpec(None, "ep", None, "tp")
    assert specs["segments"][0]["attn"]["o"] == jax.sharding.PartitionSpec(None, "tp", None)
    assert specs["mtp"][0]["layer"]["attn"]["q_b"] == jax.sharding.PartitionSpec(None, "tp", None)
    assert specs["embed"] == jax.sharding.PartitionSpec()
    dspecs = param_specs(model.params, decode_plan(8))
    assert dspecs["segments"][0]["attn"]["kv_b"] == jax.sharding.PartitionSpec()
    with pytest.raises(ValueError, match="dp == ep"):
        decode_plan(4, 2)
    with pytest.raises(ValueError, match="not divisible"):
        shard_params(model.params, prefill_plan(8, 1) if model.cfg.num_attention_heads % 8 else prefill_plan(3, 1))


def test_mock_row_padding():
    x, b = pad_rows(np.ones((3, 4), np.int32), 8)
    assert x.shape == (8, 4) and b == 3 and x[3:].sum() == 0


PLAN_PROMPTS = [[5, 9, 2, 33, 7], [8] * 13, [100, 3]]


@pytest.fixture(scope="module")
def single_device(v3_model):
    """generate's tokens for PLAN_PROMPTS on one device, 8 each: the planned runs' reference (a row's greedy tokens
    do not depend on the rows beside it, so the prompts given twice give them twice)."""
    return hcfjax.generate(v3_model, PLAN_PROMPTS, max_new_tokens=8, stop_token_ids=[]).tokens


@pytest.mark.parametrize("prefill,decode,copies", [((4, 2), 8, 1), (None, 4, 2)])
def test_generation_under_the_plans_matches_single_device(v3_model, single_device, prefill, decode, copies):
    """Prefill under TP x EP, KV hand-off, decode under attention-DP x EP with idle ranks on mock rows. A second
    call with the same plans (another limit in the same power of two) compiles nothing."""
    from sharding.generate import generate_planned
    from tests.engine_helpers import xla_compiles

    prompts = PLAN_PROMPTS * copies
    plans = (decode_plan(decode), prefill_plan(*prefill) if prefill else None)
    got = generate_planned(v3_model, prompts, *plans, max_new_tokens=8, stop_token_ids=[])
    assert got.tokens == single_device * copies
    assert got.stats["mock_rows"] == -len(prompts) % decode
    with xla_compiles() as compiles:
        again = generate_planned(v3_model, prompts, *plans, max_new_tokens=5, stop_token_ids=[])
    assert compiles == [] and again.tokens == [row[:5] for row in got.tokens]


def test_cli_runs_under_plans(capsys, monkeypatch):
    import hcfjax
    from hcfjax import cli
    from hcfjax.serving.config import parse_meshes

    args = [
        "generate",
        "--model",
        str(FIXTURES / "tiny_v3"),
        "--prompt",
        "x",
        "--dtype",
        "float32",
        "--max-new-tokens",
        "4",
        "--mesh",
        "prefill:tp=2,ep=2",
        "--mesh",
        "decode:dp=4,ep=4",
    ]
    with pytest.raises(SystemExit):
        cli.main(args[:1] + ["--mesh"])  # argparse: missing value
    assert cli.main(args) == 2  # a string prompt needs a tokenizer, which this fixture lacks
    assert "tokenizer" in capsys.readouterr().err
    seen = {}
    fake = lambda model, *a, **kw: seen.update(kw, model=model) or hcfjax.GenerationResult([[1]], None, {})  # noqa: E731
    monkeypatch.setattr(hcfjax, "generate", fake)
    assert cli.main(args) == 0  # the plans reach hcfjax.generate
    assert (seen["decode_plan"].ranks, dict(seen["prefill_plan"].mesh.shape)) == (4, {"tp": 2, "ep": 2})
    experts = seen["model"].params["segments"][1]["mlp"]["experts"]["gate"]  # loaded onto the decode plan
    assert experts.sharding == seen["decode_plan"].param_sharding(
        ("segments", 1, "mlp", "experts", "gate"), experts.shape
    )
    assert parse_meshes(["prefill:tp=4,ep=2", "decode:dp=4,ep=4"]) == {
        "prefill": {"tp": 4, "ep": 2},
        "decode": {"dp": 4, "ep": 4},
    }
    for bad in (["decode:dp=x"], ["prefill:tp=2"], ["decode:tp=2"], ["middle:dp=2"]):
        with pytest.raises(ValueError):
            parse_meshes(bad)


def test_routing_through_eplb_replicas_gives_the_same_outputs():
    """16 experts placed into 24 physical slots (hot experts replicated) over 8 ranks: same logits as without."""
    from sharding.eplb import apply_placement, rebalance_experts
    from tests.test_eplb import zipf_loads

    model = hcfjax.load(FIXTURES / "tiny_v3", dtype=jnp.float32)
    ref = np.load(FIXTURES / "tiny_v3" / "reference.npz")
    n_moe = sum(model.cfg.is_moe_layer(i) for i in range(model.cfg.num_hidden_layers))
    phy2log, log2phy, logcnt = rebalance_experts(zipf_loads(n_moe, 16, seed=3), 24, 4, 2, 8)
    assert logcnt.max() > 1  # some expert really is replicated
    placed = apply_placement(model.params, model.cfg, phy2log, log2phy, logcnt)
    plan = decode_plan(8)
    lg = decode_plan_logits(plan, shard_params(on_host(placed), plan), model.cfg, ref["ids"])
    assert rel_err(lg, ref["logits"]) < 1e-4
    # a different placement has the same shapes (no recompilation) and the same outputs
    phy2, log2, cnt2 = rebalance_experts(zipf_loads(n_moe, 16, seed=4), 24, 4, 2, 8)
    placed2 = apply_placement(model.params, model.cfg, phy2, log2, cnt2)
    assert jax.tree.map(jnp.shape, placed2) == jax.tree.map(jnp.shape, placed)
    with xla_compiles() as compiles:
        lg2 = decode_plan_logits(plan, shard_params(on_host(placed2), plan), model.cfg, ref["ids"])
    assert rel_err(lg2, ref["logits"]) < 1e-4 and compiles == []


@pytest.mark.parametrize("scheme", ["w4a8", "w8a8"])
def test_quantised_weights_split_like_the_weights_they_stand_for(scheme):
    """A quantised weight's parts (q output-major, scale K-group-major) are split as the weight would be: routed
    experts over ep in both plans, the MLPs over tp in prefill; and the planned forwards match one device."""
    from hcfjax.quant import QWeight
    from hcfjax.quantize import quantize_model

    model = quantize_model(hcfjax.load(FIXTURES / "tiny_v3", dtype=jnp.float32), scheme)
    ref = np.load(FIXTURES / "tiny_v3" / "reference.npz")
    P = jax.sharding.PartitionSpec
    gate, down = (model.params["segments"][1]["mlp"]["experts"][w] for w in ("gate", "down"))
    specs = param_specs(model.params, prefill_plan(2, 4))
    experts, dense = specs["segments"][1]["mlp"]["experts"], specs["segments"][0]["mlp"]
    assert experts["gate"].q == P(None, "ep", "tp", None) and experts["down"].q == P(None, "ep", None, "tp")
    assert experts["gate"].scale == P(None, "ep", None, "tp")
    assert experts["down"].scale == P(None, "ep", None if down.scale.shape[-2] == 1 else "tp", None)
    if isinstance(model.params["segments"][0]["mlp"]["gate"], QWeight):  # w8a8 quantises the dense MLP too
        assert dense["gate"].q == P(None, "tp", None) and dense["down"].q == P(None, None, "tp")
        attn = specs["segments"][1]["attn"]  # and MLA's q_b and o, held flattened: their heads over tp
        assert attn["q_b"].q == P(None, "tp", None) and attn["o"].q == P(None, None, "tp")
    dspecs = param_specs(model.params, decode_plan(4))["segments"][1]["mlp"]["experts"]
    assert dspecs["gate"].q == dspecs["gate"].scale == P(None, "ep", None, None)

    single = decode_plan_logits(decode_plan(1), model.params, model.cfg, ref["ids"])
    plan = decode_plan(4)
    params = shard_params(on_host(model.params), plan)
    held = params["segments"][1]["mlp"]["experts"]["gate"].q.addressable_shards[0].data.shape
    assert held[1] == gate.q.shape[1] // 4  # each rank holds its own experts
    # (int8 activations: float noise from other batch shapes can flip a rounding, so not the float plans' 1e-4)
    assert rel_err(decode_plan_logits(plan, params, model.cfg, ref["ids"]), single) < 3e-3
    plan = prefill_plan(2, 4)
    lg = prefill_logits(plan, shard_params(on_host(model.params), plan), model.cfg, ref["ids"])
    # w8a8 quantises the dense layers' activations before the routers: a rounding that flips moves a token's
    # experts, so this random model's logits move as much under a 1e-6 relative change of its input on one device
    # (about 7%); the plan must stay within that floor
    embed = model.params["embed"]
    noisy = dict(model.params, embed=embed * (1 + 1e-6 * jax.random.normal(jax.random.key(3), embed.shape)))
    floor = rel_err(prefill_logits(prefill_plan(1, 1), noisy, model.cfg, ref["ids"]), single)
    assert floor < 0.15  # (0.2% and 8% here: the yardstick itself cannot grow to let anything pass)
    assert rel_err(lg, single) < max(3e-3, 2 * floor), floor


def test_a_q_without_q_lora_is_one_int8_linear_its_heads_over_tp():
    """V2-Lite's q (no q_lora) under w8a8: one int8 linear over the heads [D -> H*K], its q split by heads over tp in
    the prefill plan, and the planned forward matches one device (a misplaced head would move every position)."""
    from hcfjax.quant import QWeight
    from hcfjax.quantize import quantize_model

    model = quantize_model(hcfjax.load(FIXTURES / "tiny_v2_lite", dtype=jnp.float32), "w8a8")
    cfg, ref = model.cfg, np.load(FIXTURES / "tiny_v2_lite" / "reference.npz")
    q = model.params["segments"][1]["attn"]["q"]
    assert isinstance(q, QWeight) and q.shape[-2:] == (cfg.hidden_size, cfg.num_attention_heads * cfg.qk_head_dim)
    plan, P = prefill_plan(2, 2), jax.sharding.PartitionSpec
    spec = param_specs(model.params, plan)["segments"][1]["attn"]["q"]
    assert spec.q == P(None, "tp", None) and spec.scale == P(None, None, "tp")
    single = prefill_logits(prefill_plan(1, 1), model.params, cfg, ref["ids"])
    # (int8 activations: float noise from the split products can flip a rounding, about 3e-3 here)
    assert rel_err(prefill_logits(plan, shard_params(on_host(model.params), plan), cfg, ref["ids"]), single) < 1e-2


def test_fp8_weights_split_like_the_weights_they_stand_for():
    """An Fp8Weight's q splits as its weight does (heads of the flattened q_b over tp, experts over ep), its block
    scales along the stacking dims alone; the decode plan's forward (experts over EP in a shard_map) and the
    prefill plan's match one device."""
    from hcfjax.quantize import quantize_model

    model = quantize_model(hcfjax.load(FIXTURES / "tiny_v3", dtype=jnp.float32), "fp8")
    ref = np.load(FIXTURES / "tiny_v3" / "reference.npz")
    P = jax.sharding.PartitionSpec
    specs = param_specs(model.params, prefill_plan(2, 4))["segments"][1]
    experts, attn = specs["mlp"]["experts"], specs["attn"]
    assert experts["gate"].q == P(None, "ep", "tp", None) and experts["down"].q == P(None, "ep", None, "tp")
    assert experts["gate"].scale_inv == experts["down"].scale_inv == P(None, "ep", None, None)
    q_b = "q_b" if model.cfg.q_lora_rank else "q"
    assert attn[q_b].q == P(None, "tp", None) and attn["o"].q == P(None, None, "tp")
    dspecs = param_specs(model.params, decode_plan(4))["segments"][1]["mlp"]["experts"]
    assert dspecs["gate"].q == dspecs["gate"].scale_inv == P(None, "ep", None, None)

    single = decode_plan_logits(decode_plan(1), model.params, model.cfg, ref["ids"])
    plan = decode_plan(4)
    params = shard_params(on_host(model.params), plan)
    gate = params["segments"][1]["mlp"]["experts"]["gate"]
    assert gate.q.addressable_shards[0].data.shape[1] == gate.q.shape[1] // 4  # each rank holds its own experts
    assert gate.scale_inv.addressable_shards[0].data.shape[1] == gate.q.shape[1] // 4
    # Float noise from other batch shapes can flip an e4m3 rounding (a step of 1/16 where int8's is 1/127), which
    # then moves the row's later positions through attention: most positions match exactly, the rest closely. A
    # misplaced expert or scale moves every position.
    for planned, logits in ((plan, decode_plan_logits), (prefill_plan(2, 4), prefill_logits)):
        got = logits(planned, shard_params(on_host(model.params), planned), model.cfg, ref["ids"])
        same = np.abs(np.asarray(got) - np.asarray(single)).max(-1) < 1e-4  # [B, T]
        assert same.mean() > 0.85 and rel_err(got, single) < 2e-2, planned.name
