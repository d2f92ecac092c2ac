"""`hcfjax info` on DeepSeek's config.json files as shipped (tests/fixtures/configs/): parameter counts against the
published totals, bytes per scheme against hand counts, and KV capacity against the capacity simulator."""

from __future__ import annotations

import json
import math

import pytest
from conftest import FIXTURES

from hcfjax.cli import main
from hcfjax.config import ConfigError, ModelConfig, QuantConfig
from hcfjax.info import plan_fit, read_config
from hcfjax.sim.config import load_config
from hcfjax.sim.deployment import Deployment, Pool
from hcfjax.sim.weights import INT4_BYTES, count, fp8_bytes, holds_float_heads, main_weights, mtp_weights, total_bytes

CONFIGS = FIXTURES / "configs"
V3, R1, V2, V2_LITE = (CONFIGS / n for n in ("deepseek-v3", "deepseek-r1", "deepseek-v2", "deepseek-v2-lite"))
FP8_BLOCK = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def test_shipped_configs_are_read():
    """V2 and V2-Lite parse as they are; V3 and R1 (the same file but for transformers_version) carry DeepSeek's fp8
    block, which ModelConfig reads as the fp8 scheme, as `hcfjax.load` keeps such checkpoints."""
    v2, lite = ModelConfig.from_json(V2), ModelConfig.from_json(V2_LITE)
    assert (v2.n_routed_experts, v2.topk_method, v2.n_group, v2.topk_group) == (160, "group_limited_greedy", 8, 3)
    assert (lite.q_lora_rank, lite.n_routed_experts, lite.num_mtp_layers) == (None, 64, 0)
    assert lite.rope.type == "yarn" and lite.rope.mscale_all_dim == 0.707
    v3 = read_config(V3 / "config.json")
    assert (v3.num_hidden_layers, v3.n_routed_experts, v3.num_mtp_layers, v3.first_k_dense_replace) == (61, 256, 1, 3)
    assert (v3.topk_method, v3.scoring_func, v3.rope.factor) == ("noaux_tc", "sigmoid", 40.0)
    assert read_config(R1) == v3 == ModelConfig.from_json(V3)
    raw = {n: json.loads((p / "config.json").read_text()) for n, p in (("v3", V3), ("r1", R1))}
    assert {k for k in raw["v3"] if raw["v3"][k] != raw["r1"].get(k)} == {"transformers_version"}
    assert read_config(V2).quantization is None


@pytest.mark.parametrize("path", [V3, R1], ids=["v3", "r1"])
def test_model_config_reads_the_shipped_fp8_block(path):
    """ModelConfig.from_json takes V3's and R1's config.json as shipped: the fp8 scheme, with the block's format,
    and config.json's quantization_config written back as it was."""
    cfg = ModelConfig.from_json(path)
    q = cfg.quantization
    assert q.scheme == "fp8" and (q.experts, q.linear, q.kv_cache_dtype) == ("fp8", "fp8", None)
    assert (q.fp8.fmt, q.fp8.activation_scheme, q.fp8.weight_block_size, q.fp8.scale_fmt) == (
        "e4m3",
        "dynamic",
        (128, 128),
        None,
    )
    assert cfg.to_dict()["quantization_config"] == FP8_BLOCK
    assert json.loads((path / "config.json").read_text())["quantization_config"] == FP8_BLOCK


@pytest.mark.parametrize(
    "path, total, active",
    [(V3, 671e9, 37e9), (V2, 236e9, 21e9), (V2_LITE, 15.7e9, 2.4e9)],
    ids=["v3", "v2", "v2-lite"],
)
def test_parameters_match_the_published_totals(path, total, active):
    """DeepSeek's model cards (671B / 37B, 236B / 21B, 15.7B / 2.4B): totals to their rounding; parameters per
    token within 2.5% (published with two significant digits; a token reads one embedding row)."""
    cfg = read_config(path)
    assert count(main_weights(cfg)) == pytest.approx(total, rel=0.002)
    assert count(main_weights(cfg), active=True) == pytest.approx(active, rel=0.025)


def test_v3_with_its_mtp_module_is_the_checkpoints_685b():
    """DeepSeek-V3's checkpoint: 671B main model + 11.5B MTP module (excluding the embedding and head it shares,
    which the checkpoint stores again) = 685B."""
    cfg = read_config(V3)
    mtp = count(mtp_weights(cfg))
    table = cfg.vocab_size * cfg.hidden_size  # the embedding (and the head): the checkpoint's layer 61 holds both
    assert mtp - table == pytest.approx(11.5e9, rel=0.015)
    assert count(main_weights(cfg)) + mtp + table == pytest.approx(685e9, rel=0.002)


def test_bytes_per_scheme_follow_hand_counts():
    """DeepSeek-V3's weights counted by hand from its architecture: 58 MoE layers of 256 routed experts and one
    shared, 3 dense layers, MLA's q_a / kv_a down projections and its per-head q_b / o in all 61."""
    cfg = read_config(V3)
    main = main_weights(cfg)
    n = count(main)
    experts = 58 * 256 * 3 * 7168 * 2048
    linear = 3 * 3 * 7168 * 18432 + 58 * 3 * 7168 * 2048 + 61 * 7168 * (1536 + 576)  # w8a8 under w4a8c8
    heads = 61 * (1536 * 128 * 192 + 128 * 128 * 7168)  # q_b and o: w8a8 under w4a8c8 too, fp8 under fp8
    routers = 58 * (256 * 7168 + 256)  # float32 in memory; bf16 weight + float32 bias in the checkpoint
    bf16 = 2 * n + 2 * routers
    assert total_bytes(main, None) == bf16
    assert total_bytes(main, "w4a16") == total_bytes(main, "w4a8") == pytest.approx(bf16 - experts * (2 - INT4_BYTES))
    assert total_bytes(main, "w4a8c8") == pytest.approx(total_bytes(main, "w4a16") - linear - heads)
    assert total_bytes(main, "w8a8") == pytest.approx(bf16 - experts - linear - heads)
    # fp8 quantises the same linears (hcfjax/fp8.py's LINEARS), not kv_b
    kv_b = 61 * 512 * 128 * (128 + 128)
    assert total_bytes(main, "fp8") == pytest.approx(bf16 - (experts + linear + heads) * (2 - (1 + 4 / 128**2)))
    unquantised = 2 * 129280 * 7168 + 61 * (2 * 7168 + 1536 + 512) + 7168  # embedding, head, norms
    fp8 = n - unquantised - routers  # one byte each, with a float32 scale per 128 x 128 block
    assert fp8_bytes(main) == pytest.approx(fp8 * (1 + 4 / 128**2) + 2 * unquantised + 2 * routers + 2 * 58 * 256)
    # what hcfjax holds of DeepSeek's fp8 checkpoint: kv_b in bf16 (absorbed into the query and output), routers f32
    held = fp8_bytes(main) + kv_b * (2 - (1 + 4 / 128**2)) + 2 * 58 * 256 * 7168
    assert total_bytes(main, "fp8") == pytest.approx(held)
    # the MTP module (one MoE layer): as the main model's layers, and its combiner [2D -> D] kept bf16 by fp8 (as
    # DeepSeek ships it) but int8 under w4a8c8, with its q_a / kv_a, q_b / o and shared expert
    mtp = mtp_weights(cfg)
    fp8_gap = 512 * 128 * 256 * (2 - (1 + 4 / 128**2)) + 2 * 256 * 7168  # one layer's kv_b and router
    assert total_bytes(mtp, "fp8") - fp8_bytes(mtp) == pytest.approx(fp8_gap)
    int8 = 2 * 7168 * 7168 + 7168 * (1536 + 576) + heads // 61 + 3 * 7168 * 2048  # one byte saved each
    routed = 256 * 3 * 7168 * 2048 * (2 - INT4_BYTES)
    assert total_bytes(mtp, None) - total_bytes(mtp, "w4a8c8") == pytest.approx(int8 + routed)


def _simulator_tokens(path, gpu, quant, gpus, spec_k=0):
    """The simulator's KV tokens per decode GPU for a PD deployment whose decode pool is DP = EP = gpus."""
    pools = dict(prefill=Pool(tp=8, ep=8), decode=Pool(dp=gpus, ep=gpus))
    dep = Deployment(model=str(path), gpu=gpu, quant=quant, acceptance=(0.8,) * spec_k, **pools)
    return dep.pages_per_rank(dep.decode, dep.cost_model(dep.decode, read_config(path))) * dep.decode.page_size


@pytest.mark.parametrize("gpu", ["H20", "H200"])
@pytest.mark.parametrize("gpus", [8, 16])
@pytest.mark.parametrize(
    "path, scheme", [(V3, "w4a8c8"), (V2_LITE, "w4a8c8"), (V2_LITE, "bf16")], ids=["v3", "v2-lite-w4a8c8", "v2-lite"]
)
def test_kv_tokens_per_gpu_are_the_simulators(path, scheme, gpus, gpu):
    cfg = read_config(path)
    fit = plan_fit(cfg, f"decode:dp={gpus}", gpu, scheme, context=4096)
    cache = {c.dtype: c for c in fit.caches}["int8" if scheme == "w4a8c8" else "bf16"]
    assert cache.tokens == _simulator_tokens(path, gpu, None if scheme == "bf16" else scheme, gpus)
    # The tokens fill the budget to within a page; the budget is what the weights leave of 0.9 of the HBM.
    hbm = {"H20": 96e9, "H200": 141e9}[gpu]
    assert fit.kv_budget == pytest.approx(0.9 * hbm - fit.weight_bytes - 4e9)
    assert cache.tokens * cache.bytes_per_token <= fit.kv_budget < (cache.tokens + 64) * cache.bytes_per_token
    assert cache.bytes_per_token == cfg.num_hidden_layers * (576 + 8 if cache.dtype == "int8" else 576 * 2)
    assert cache.requests == cache.tokens // 4096
    # Per GPU: all but the routed experts (attention-DP replicates them), 1/gpus of the experts.
    main = main_weights(cfg)
    experts = total_bytes([w for w in main if w.kind == "experts"], None if scheme == "bf16" else scheme)
    assert fit.expert_bytes == pytest.approx(experts / gpus)
    assert fit.weight_bytes == pytest.approx(
        total_bytes(main, None if scheme == "bf16" else scheme) - experts * (1 - 1 / gpus)
    )


def test_v3_in_bf16_does_not_fit_eight_h20s_and_the_reference_deployment_agrees():
    """bf16 V3 (1.34 TB) leaves nothing on 8 x 96 GB; the reference deployment (hcfjax/sim/configs/reference-h20.yaml:
    w4a8c8 with MTP-2 on DP8) gets the same tokens from the shipped config as the simulator gets from its preset."""
    cfg = read_config(V3)
    fit = plan_fit(cfg, "decode:dp=8", "H20", "bf16", context=4096)
    assert fit.kv_budget < 0 and all(c.tokens == 0 for c in fit.caches)
    dep = load_config(CONFIGS.parent.parent.parent / "hcfjax/sim/configs/reference-h20.yaml").deployment
    ref = dep.pages_per_rank(dep.decode, dep.cost_model(dep.decode)) * dep.decode.page_size
    fit = plan_fit(cfg, "decode:dp=8,ep=8", "H20", "w4a8c8", context=4096, spec_k=2)
    assert {c.dtype: c.tokens for c in fit.caches}["int8"] == ref == _simulator_tokens(V3, "H20", "w4a8c8", 8, 2)


def test_cli_prints_the_tables(capsys):
    assert (
        main(["info", str(V3), "--scheme", "w4a8c8", "--gpu", "H200", "--mesh", "decode:dp=16", "--context", "8192"])
        == 0
    )
    out = capsys.readouterr().out
    fit = plan_fit(read_config(V3), "decode:dp=16", "H200", "w4a8c8", context=8192)
    int8 = fit.caches[1]
    per = f"{int8.requests:,} per rank, {int8.requests * 16:,} in all"
    for text in (
        "shipped as fp8 e4m3, 128x128 blocks",
        "main model                  671.03 B     36.63 B",
        "MTP (1 module)",
        "fp8 (as shipped)",
        "decode:dp=16,ep=16 on 16 x H200 (141 GB), w4a8c8 weights",
        f"int8    {int8.bytes_per_token:>14,.0f}{int8.tokens:>15,}   {per}",
    ):
        assert text in out, text
    assert main(["info", str(R1), "--gpu", "H200"]) == 0  # held as shipped: the fp8 scheme
    assert "decode:dp=8,ep=8 on 8 x H200 (141 GB), fp8 weights" in capsys.readouterr().out
    assert main(["info", "--preset", "v2-lite", "--mesh", "prefill:tp=2,ep=2", "--mesh", "decode:dp=4"]) == 0
    out = capsys.readouterr().out
    assert "prefill:tp=2,ep=2 on 4 x H20" in out and "decode:dp=4,ep=4 on 4 x H20" in out and "15.71 B" in out


def test_a_checkpoint_with_float_heads_is_priced_as_it_holds_them(tmp_path, capsys):
    """A w4a8c8 checkpoint written without `quantization_config.heads` holds MLA's q_b and o in bf16, as it loads
    them: one byte more per parameter of theirs on every GPU of the decode plan (it replicates them), in `hcfjax
    info` and in a simulated deployment of it. Quantising anything else to a scheme gives them in its format."""
    cfg = read_config(V3)
    d = cfg.to_dict()
    d["quantization_config"] = QuantConfig.for_scheme("w4a8c8").to_dict()
    (tmp_path / "config.json").write_text(json.dumps(d))
    int8_heads = plan_fit(read_config(tmp_path), "decode:dp=8", "H200", "w4a8c8", context=4096)
    del d["quantization_config"]["heads"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    old = read_config(tmp_path)
    assert holds_float_heads(old, "w4a8c8") and not holds_float_heads(old, "w8a8")
    assert not holds_float_heads(cfg, "w4a8c8") and not holds_float_heads(read_config(V2_LITE), "w4a8c8")
    fit = plan_fit(old, "decode:dp=8", "H200", "w4a8c8", context=4096)
    q_b = cfg.q_lora_rank * cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    o = cfg.num_attention_heads * cfg.v_head_dim * cfg.hidden_size
    assert fit.weight_bytes - int8_heads.weight_bytes == pytest.approx(cfg.num_hidden_layers * (q_b + o))
    assert fit.caches[1].tokens < int8_heads.caches[1].tokens
    pool = Pool(dp=8, ep=8)
    sim = Deployment(model=str(tmp_path), gpu="H200", quant="w4a8c8", mode="colocated", colocated=pool)
    assert sim.cost_model(pool).weight_bytes_per_gpu() == pytest.approx(fit.weight_bytes)
    assert main(["info", str(tmp_path), "--gpu", "H200"]) == 0
    out = capsys.readouterr().out
    assert "quantised by hcfjax: w4a8c8, MLA's q_b / o in bf16" in out and "w4a8c8 (q_b / o bf16)" in out
    assert f"{fit.caches[1].tokens:,}" in out and f"{int8_heads.caches[1].tokens:,}" not in out


def test_bad_input_is_a_clear_error(tmp_path, capsys):
    def error(*argv):
        assert main(["info", *argv]) == 2
        return capsys.readouterr().err

    assert "no config.json at" in error(str(tmp_path / "missing"))
    d = json.loads((V2_LITE / "config.json").read_text())
    del d["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert "required key 'hidden_size' is missing" in error(str(tmp_path)) and str(tmp_path) in error(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    assert "is not valid JSON" in error(str(tmp_path / "config.json"))
    assert "dp == ep" in error(str(V2_LITE), "--mesh", "decode:dp=8,ep=4")
    assert "needs MTP layers" in error(str(V2_LITE), "--speculative", "1")
    assert "--context 163841 is longer than" in error(str(V2_LITE), "--context", "163841")
    assert main(["info"]) == 0  # the embedded model's context (2,048) is the default's bound
    assert "requests of 2,048 tokens" in capsys.readouterr().out
    assert "not both" in error(str(V3), "--preset", "v2-lite")
    d = json.loads((V2_LITE / "config.json").read_text())
    d["quantization_config"] = QuantConfig.for_scheme("w4a8c8").to_dict()  # quantised by hcfjax: one scheme only
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert "quantised already (w4a8c8), not to w8a8" in error(str(tmp_path), "--scheme", "w8a8")
    assert main(["info", str(tmp_path), "--scheme", "w4a8c8"]) == 0
    with pytest.raises(ConfigError, match="JSON list"):
        (tmp_path / "config.json").write_text("[]")
        read_config(tmp_path)
    assert math.isfinite(plan_fit(read_config(V2_LITE), "prefill:tp=1", "H20", "bf16", 1).kv_budget)
