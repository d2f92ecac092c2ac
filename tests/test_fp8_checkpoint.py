"""DeepSeek fp8 checkpoints (e4m3 weights, `weight_scale_inv` per 128 x 128 block, config.json's fp8
`quantization_config`), made here in DeepSeek's layout: `hcfjax.load` keeps them fp8 and runs them as w8a8 fp8
(hcfjax/fp8.py), close to the same checkpoint dequantised; `fp8="dequantize"` keeps the float path."""

import inspect
import json
import json.decoder
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import hcfjax
from hcfjax import fp8
from hcfjax.checkpoint import CheckpointError
from hcfjax.cli import main as cli_main
from hcfjax.random_model import preset_config, random_model
from hcfjax.safetensors_files import read_index, read_tensor
from hcfjax.tensor_specs import get_path, tensor_specs
from tests.test_checkpoint import quantize_fp8_blocks
from tests.test_fp8 import V3_FP8_BLOCK

# The linears DeepSeek-V3 ships in fp8 (each with a weight_scale_inv): MLA's projections and every MLP's (dense,
# shared expert, routed experts). The router (mlp.gate), embeddings, norms, LM heads and eh_proj are bf16.
DEEPSEEK_FP8 = re.compile(
    r"self_attn\.(q_a_proj|q_b_proj|q_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)\.weight$|mlp\.(.+\.)?(gate|up|down)_proj\.weight$"
)


def write_fp8_checkpoint(model, out) -> list[str]:
    """`model` as DeepSeek ships V3: its fp8 linears quantised per 128 x 128 block (scale_inv = amax / 448) beside
    their float32 weight_scale_inv, two shards with an index (a weight and its scale in one shard), and config.json
    with the fp8 quantization_config. Returns the names written in fp8."""
    hcfjax.save(model, out)
    tensors = {}
    for f in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(f))
        f.unlink()
    quantised, shards = [], [{}, {}]
    for i, name in enumerate(sorted(tensors)):
        shard = shards[i % 2]
        if DEEPSEEK_FP8.search(name):
            shard[name], shard[name + "_scale_inv"] = quantize_fp8_blocks(tensors[name].astype(np.float32))
            quantised.append(name)
        else:
            shard[name] = tensors[name]
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file(shard, out / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": V3_FP8_BLOCK}, indent=1))
    return quantised


# A tiny V3: MLA with q_lora (the N = 160 of kv_a is a partial block), a dense layer, MoE layers with a shared
# expert, one MTP layer. Every token goes to every expert (top-4 of 4): no expert choice can flip between the fp8 and
# the float run, so their difference is the fp8 rounding of activations alone.
TINY_V3 = dict(
    hidden_size=256,
    intermediate_size=256,
    moe_intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=2,
    q_lora_rank=128,
    kv_lora_rank=128,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=64,
    n_routed_experts=4,
    num_experts_per_tok=4,
    n_group=1,
    topk_group=1,
)


@pytest.fixture(scope="module")
def random_fp8(tmp_path_factory):
    """(path, fp8 tensor names) of a random tiny-V3 fp8 checkpoint."""
    out = tmp_path_factory.mktemp("fp8") / "tiny-v3-fp8"
    names = write_fp8_checkpoint(random_model(preset_config("tiny-v3", **TINY_V3), seed=0, dtype=jnp.float32), out)
    return out, names


def file_tensor(path, name) -> np.ndarray:
    """A tensor as the checkpoint at `path` stores it (fp8 as e4m3)."""
    return read_tensor(read_index(path)[name])


def test_fp8_checkpoint_stays_fp8(random_fp8):
    path, names = random_fp8
    model = hcfjax.load(path, dtype=jnp.float32)
    assert model.cfg.quantization.scheme == "fp8" and model.cfg.quantization.fp8.weight_block_size == (128, 128)
    specs = {s.name: s for s in tensor_specs(model.cfg)}
    # Attention in 3 layers and the MTP layer, the dense MLP, experts and shared expert of 2 MoE layers and the MTP's.
    assert len(names) == 5 * 4 + 3 + 3 * (4 + 1) * 3
    kept = 0
    for name in names:
        if "kv_b_proj" in name:  # dequantised on load: held as W_UK and W_UV
            s = specs[name]
            assert not isinstance(get_path(model.params, s.path[:-1])[s.path[-1]], fp8.Fp8Weight), name
            continue
        q, scale = specs[name], specs[name + "_scale_inv"]
        w = get_path(model.params, q.path[:-1])
        assert isinstance(w, fp8.Fp8Weight), name
        assert w.q.dtype == jnp.float8_e4m3fn and w.scale_inv.dtype == jnp.float32
        # The checkpoint's values and scales as shipped, bit for bit.
        # (indexed on the host: an index of a device array compiles a program per shape)
        np.testing.assert_array_equal(np.asarray(w.q)[q.index].view(np.uint8), file_tensor(path, name).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(w.scale_inv)[scale.index], file_tensor(path, name + "_scale_inv"))
        kept += 1
    assert kept == len(names) - 4  # every fp8 linear but kv_b (3 layers and the MTP layer)
    p = model.params
    float_leaves = [p["embed"], p["lm_head"], p["mtp"][0]["eh_proj"], p["segments"][1]["mlp"]["router"]]
    assert all(leaf.dtype == jnp.float32 for leaf in float_leaves)
    plain = hcfjax.load(path, dtype=jnp.float32, fp8="dequantize")
    assert plain.cfg.quantization is None
    assert not any(isinstance(x, fp8.Fp8Weight) for x in jax.tree.leaves(plain.params, is_leaf=_is_fp8))


def _is_fp8(x) -> bool:
    return isinstance(x, fp8.Fp8Weight)


def rel_rms(a, b) -> float:
    return float(np.sqrt(((a - b) ** 2).mean() / (b**2).mean()))


def test_random_fp8_checkpoint_logits_close_to_dequantised(random_fp8):
    """The same weights, fp8 activations against float ones. e4m3 keeps 4 significant bits: a rounded activation is
    off by up to 2^-4 of itself (2-3% rms of a matmul's input), and each layer chains seven such roundings (q_a, q_b,
    kv_a, o, gate/up, down), the attention scores' through a softmax; over this random model's 3 layers the logits
    move by 0.11 rms relative (measured; a wrong block scale or head split moves them by about 1). Random weights
    leave small top-1 margins (median 0.24 logit, against 0.1 rms of change), so the greedy runs may part: each
    token native fp8 picks must be within 0.5 logit of the dequantised model's best after the same prefix (logits
    of about unit spread); the trained model's test below compares whole runs."""
    path, _ = random_fp8
    native = hcfjax.load(path, dtype=jnp.float32)
    plain = hcfjax.load(path, dtype=jnp.float32, fp8="dequantize")
    tokens = [list(range(2, 40))]
    a, b = np.asarray(hcfjax.forward(native, tokens)), np.asarray(hcfjax.forward(plain, tokens))
    assert rel_rms(a, b) < 0.15
    assert (a.argmax(-1) == b.argmax(-1)).mean() > 0.7
    got = hcfjax.generate(native, tokens, max_new_tokens=8).tokens[0]
    rows = np.asarray(hcfjax.forward(plain, [tokens[0] + got]))[0, len(tokens[0]) - 1 : -1]  # [8, vocab]
    gaps = rows.max(-1) - rows[np.arange(len(got)), got]
    assert gaps.max() < 0.5, gaps


def test_save_writes_deepseeks_fp8_layout(random_fp8, tmp_path):
    path, _ = random_fp8
    model = hcfjax.load(path)
    hcfjax.save(model, tmp_path / "again")
    config = json.loads((tmp_path / "again" / "config.json").read_text())
    assert config["quantization_config"] == V3_FP8_BLOCK
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    with safe_open(str(tmp_path / "again" / "model.safetensors"), "numpy") as f:
        assert f.get_slice(name).get_dtype() == "F8_E4M3"
        np.testing.assert_array_equal(f.get_tensor(name + "_scale_inv"), file_tensor(path, name + "_scale_inv"))
    again = hcfjax.load(tmp_path / "again")
    assert equal_trees(model.params, again.params) and again.cfg == model.cfg


def equal_trees(a, b) -> bool:
    """Every leaf of two pytrees equal, compared in numpy (jnp.array_equal compiles two programs per leaf shape)."""
    return all(jax.tree.leaves(jax.tree.map(lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), a, b)))


def _rewrite(path, edit) -> None:
    """Rewrites each shard whose tensors edit(tensors) changed (it returns True)."""
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "numpy") as h:
            names = list(h.keys())
        tensors = {n: file_tensor(path, n) for n in names}
        if edit(tensors):
            save_file(tensors, f, metadata={"format": "pt"})


def test_scale_of_the_wrong_shape_is_named(random_fp8, tmp_path):
    dst = tmp_path / "bad"
    shutil.copytree(random_fp8[0], dst)
    victim = "model.layers.2.mlp.experts.1.up_proj.weight_scale_inv"

    def shrink(tensors):
        if victim in tensors:
            tensors[victim] = tensors[victim][:, :1].copy()  # [1, 2] -> [1, 1]
            return True
        return False

    _rewrite(dst, shrink)
    # native: the scale is a tensor of the name table, of the wrong shape; dequantize: the scale of an fp8 weight
    named = re.escape(repr(victim)) + r" in model-\d{5}-of-00002\.safetensors .*\(1, 1\).*\(1, 2\)"
    for mode in ("native", "dequantize"):
        with pytest.raises(CheckpointError, match=named):
            hcfjax.load(dst, fp8=mode)


def test_fp8_linear_stored_as_float_is_named(random_fp8, tmp_path):
    dst = tmp_path / "mixed"
    shutil.copytree(random_fp8[0], dst)
    victim = "model.layers.0.mlp.down_proj.weight"

    def dequantise(tensors):
        if victim in tensors:
            scale = tensors.pop(victim + "_scale_inv")
            tensors[victim] = tensors[victim].astype(np.float32) * np.repeat(np.repeat(scale, 128, 0), 128, 1)
            return True
        return False

    _rewrite(dst, dequantise)
    index = dst / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"]
    del weight_map[victim + "_scale_inv"]
    index.write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=re.escape(victim) + ".*fp8='dequantize'"):
        hcfjax.load(dst)
    assert hcfjax.load(dst, fp8="dequantize").cfg.quantization is None


def test_quantize_from_an_fp8_checkpoint(random_fp8, tmp_path, capsys):
    path, _ = random_fp8
    assert cli_main(["quantize", "--model", str(path), "--out", str(tmp_path / "w8a8"), "--scheme", "w8a8"]) == 0
    w8a8 = hcfjax.load(tmp_path / "w8a8")
    assert w8a8.cfg.quantization.scheme == "w8a8"
    assert cli_main(["quantize", "--model", str(path), "--out", str(tmp_path / "fp8"), "--scheme", "fp8"]) == 0
    kept, native = hcfjax.load(tmp_path / "fp8"), hcfjax.load(path)
    assert equal_trees(kept.params, native.params)
    assert "wrote fp8 checkpoint" in capsys.readouterr().out


def test_serving_reports_the_fp8_scheme(random_fp8):
    from hcfjax.engine import Engine, EngineConfig
    from hcfjax.kernels import engine_summary
    from hcfjax.serving.config import load_model

    engine = Engine(load_model(str(random_fp8[0])), EngineConfig(max_slots=1, num_pages=4, page_size=16))
    assert engine_summary(engine).startswith("fp8 weights (e4m3, 128x128 block scales, dynamic e4m3 activations)")
    assert "fp8 block-scaled experts" in engine_summary(engine)
    assert load_model(str(random_fp8[0]), scheme="w4a8").cfg.quantization.scheme == "w4a8"  # from the dequantised


@pytest.fixture(scope="module")
def embedded_fp8(tmp_path_factory):
    """The embedded (trained) model as an fp8 checkpoint in DeepSeek's layout."""
    out = tmp_path_factory.mktemp("fp8") / "stdlib-v3-fp8"
    model = hcfjax.load(dtype=jnp.float32)
    write_fp8_checkpoint(model, out)
    return out, model.tokenizer


# Measured on this window (json/decoder.py, 256 tokens): fp8 against the same checkpoint dequantised, relative RMS
# logit error 0.031 and top-1 agreement 0.94, in float32 and in bf16 alike (bf16 against float32 weights: 0.008). The
# logits of one position move by 0.4 at most (median over positions): where the float model's top two are closer
# than that, fp8 may pick the other one, as any change of precision may (the window's 64th token: 13.725 against
# 13.723, margin 0.18); where they are a logit apart (62% of positions) it never did.
def test_trained_model_in_fp8_keeps_its_predictions(embedded_fp8):
    path, tokenizer = embedded_fp8
    native = hcfjax.load(path, dtype=jnp.float32)
    plain = hcfjax.load(path, dtype=jnp.float32, fp8="dequantize")
    tokens = tokenizer.encode(inspect.getsource(json.decoder)).ids[:256]
    a, b = np.asarray(hcfjax.forward(native, [tokens]))[0], np.asarray(hcfjax.forward(plain, [tokens]))[0]
    assert rel_rms(a, b) < 0.05
    assert (a.argmax(-1) == b.argmax(-1)).mean() > 0.9
    top2 = np.sort(b, axis=-1)[:, -2:]
    decisive = top2[:, 1] - top2[:, 0] > 1.0
    assert decisive.mean() > 0.5
    np.testing.assert_array_equal(a.argmax(-1)[decisive], b.argmax(-1)[decisive])
    # A short greedy run, through prefill and the paged decode steps.
    prompt = [tokens[:128]]
    got = hcfjax.generate(native, prompt, max_new_tokens=8).tokens
    assert got == hcfjax.generate(plain, prompt, max_new_tokens=8).tokens


def test_cli_generate_runs_fp8_or_dequantised(random_fp8, capsys, monkeypatch):
    from hcfjax import cli

    loaded = []
    load = hcfjax.load
    monkeypatch.setattr(hcfjax, "load", lambda *a, **k: loaded.append(load(*a, **k)) or loaded[-1])
    for mode in ("native", "dequantize"):
        args = ["generate", "--model", str(random_fp8[0]), "--prompt", "def f(x):", "--max-new-tokens", "2"]
        assert cli.main([*args, "--fp8", mode]) == 0
        assert capsys.readouterr().out.startswith("def f(x):")
    assert [m.cfg.quantization and m.cfg.quantization.scheme for m in loaded] == ["fp8", None]


def test_fp8_shapes_without_reading_equal_what_loads(random_fp8):
    """load_shapes of a DeepSeek fp8 checkpoint: Fp8Weights of the stored shapes, or floats with fp8="dequantize"."""
    from hcfjax.api import load_shapes

    path, _ = random_fp8
    for mode in ("native", "dequantize"):
        shapes, loaded = load_shapes(path, fp8=mode), hcfjax.load(path, fp8=mode)
        leaves = lambda t: [(tuple(x.shape), jnp.dtype(x.dtype)) for x in jax.tree.leaves(t)]  # noqa: E731
        assert jax.tree.structure(shapes.params) == jax.tree.structure(loaded.params), mode
        assert leaves(shapes.params) == leaves(loaded.params) and shapes.cfg == loaded.cfg, mode
