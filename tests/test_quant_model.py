"""A quantised model end to end: the embedded model quantised in memory (hcfjax/quantize.py) and through
`hcfjax quantize` to a checkpoint `hcfjax.load` reads back."""

from __future__ import annotations

import inspect
import json
import json.decoder

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hcfjax
from hcfjax import quant
from hcfjax.cli import main as cli_main
from hcfjax.quantize import default_cache_dtype, quantize_model


@pytest.fixture(scope="module")
def embedded():
    model = hcfjax.load()
    tokens = model.tokenizer.encode(inspect.getsource(json.decoder)).ids[:256]
    return model, [tokens], np.asarray(hcfjax.forward(model, [tokens]))


# Measured on this window (json/decoder.py, 256 tokens): relative RMS logit error vs bf16 about 0.050 (w4a16),
# 0.052 (w4a8c8), 0.017 (w8a8); bf16 vs f32 weights is 0.006. Top-1 agreement 0.91-0.93 (int4), 0.98 (w8a8).
@pytest.mark.parametrize("scheme, tol, agree", [("w4a16", 0.08, 0.85)])
def test_quantized_embedded_model_logits(embedded, scheme, tol, agree):
    model, tokens, ref = embedded
    q = quantize_model(model, scheme)
    experts = q.params["segments"][1]["mlp"]["experts"]
    assert isinstance(experts["gate"], quant.QWeight) and experts["gate"].bits == (4 if scheme[1] == "4" else 8)
    lg = np.asarray(hcfjax.forward(q, tokens))
    rel = float(np.sqrt(((lg - ref) ** 2).mean() / (ref**2).mean()))
    assert rel < tol, rel
    assert (lg.argmax(-1) == ref.argmax(-1)).mean() > agree


def test_quantize_cli_load_round_trip(embedded, tmp_path, capsys):
    model, tokens, ref = embedded
    out = tmp_path / "w4a8c8"
    assert cli_main(["quantize", "--out", str(out), "--scheme", "w4a8c8"]) == 0
    assert "w4a8c8" in capsys.readouterr().out
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["scheme"] == "w4a8c8"
    loaded = hcfjax.load(out)
    assert loaded.cfg.quantization.kv_cache_dtype == "int8" and default_cache_dtype(loaded) == jnp.int8
    direct = quantize_model(model, "w4a8c8")
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(direct.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # On disk the scales keep the checkpoint's output-major [N, K/G]; in params they are [K/G, N] (quant.py).
    from safetensors.numpy import load_file

    gate = loaded.params["segments"][1]["mlp"]["experts"]["gate"]
    disk = load_file(str(out / "model.safetensors"))
    name = f"model.layers.{loaded.cfg.first_k_dense_replace}.mlp.experts.0.gate_proj.weight_scale"
    np.testing.assert_array_equal(disk[name].T, np.asarray(gate.scale[0, 0]))
    attn = loaded.params["segments"][0]["attn"]
    for name in ("q_a", "q_b", "o"):  # MLA's per-head q_b and o as one int8 linear over the heads each
        assert isinstance(attn[name], quant.QWeight) and attn[name].bits == 8 and attn[name].act == "int8", name
    cfg = loaded.cfg
    assert attn["q_b"].shape[-2:] == (cfg.q_lora_rank, cfg.num_attention_heads * cfg.qk_head_dim)
    assert not isinstance(attn["kv_b"], quant.QWeight)  # folded into the absorbed decode: stays bf16
    lg = np.asarray(hcfjax.forward(loaded, tokens))
    rel = float(np.sqrt(((lg - ref) ** 2).mean() / (ref**2).mean()))
    assert rel < 0.08, rel
    assert cli_main(["quantize", "--model", str(out), "--out", str(tmp_path / "again"), "--scheme", "w4a16"]) == 2


def test_quantize_refuses_to_write_over_its_source(tmp_path, capsys):
    """--out naming the source checkpoint's directory (by another spelling too) or a file is refused before anything
    is written: the source's bytes stay as they were."""
    import shutil

    src = tmp_path / "src"
    shutil.copytree(hcfjax.DEFAULT_MODEL, src)
    before = {p.name: p.read_bytes() for p in src.iterdir() if p.is_file()}
    for out in (src, tmp_path / "src" / ".." / "src"):
        assert cli_main(["quantize", "--model", str(src), "--out", str(out), "--scheme", "w8a8"]) == 2
        assert "source checkpoint" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in src.iterdir() if p.is_file()} == before
    (tmp_path / "afile").write_text("x")
    assert cli_main(["quantize", "--model", str(src), "--out", str(tmp_path / "afile"), "--scheme", "w8a8"]) == 2
    assert "is a file" in capsys.readouterr().err


def test_a_checkpoint_with_float_heads_loads_them_as_written(embedded, tmp_path):
    """A w4a8c8 checkpoint written before the int schemes quantised MLA's q_b and o (no `heads` in its
    quantization_config, those weights in bf16 on disk) loads them as written; its logits differ from the scheme's
    with int8 heads, both within the scheme's error."""
    import dataclasses

    model, tokens, ref = embedded
    q = quantize_model(model, "w4a8c8")
    params = jax.tree.map(lambda x: x, q.params, is_leaf=lambda x: isinstance(x, quant.QWeight))
    for seg, float_seg in zip(params["segments"], model.params["segments"], strict=True):
        seg["attn"]["q_b"], seg["attn"]["o"] = float_seg["attn"]["q_b"], float_seg["attn"]["o"]
    for mtp, float_mtp in zip(params.get("mtp", []), model.params.get("mtp", []), strict=True):
        mtp["layer"]["attn"]["q_b"], mtp["layer"]["attn"]["o"] = (float_mtp["layer"]["attn"][k] for k in ("q_b", "o"))
    qcfg = dataclasses.replace(q.cfg.quantization, heads=None)
    old = dataclasses.replace(q, cfg=dataclasses.replace(q.cfg, quantization=qcfg), params=params)
    hcfjax.save(old, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization_config"]["heads"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded = hcfjax.load(tmp_path)
    assert loaded.cfg == old.cfg and loaded.cfg.quantization.heads is None
    attn = loaded.params["segments"][1]["attn"]
    assert not isinstance(attn["q_b"], quant.QWeight) and attn["q_b"].dtype == jnp.bfloat16
    assert isinstance(attn["q_a"], quant.QWeight)
    for a, b in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(old.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    lg, lq = np.asarray(hcfjax.forward(loaded, tokens)), np.asarray(hcfjax.forward(q, tokens))
    assert not np.array_equal(lg, lq)  # the heads' int8 weights do change the logits
    for x in (lg, lq):
        assert float(np.sqrt(((x - ref) ** 2).mean() / (ref**2).mean())) < 0.08


def test_random_model_quantised_as_made_equals_quantising_it_after(monkeypatch):
    """random_model(scheme=...) quantises the large weights slice by slice as it makes them (the float model never
    whole on the device): the same weights as making the float model and quantising it, bit for bit."""
    from hcfjax import fp8
    from hcfjax import model as model_module
    from hcfjax import random_model as random_module
    from hcfjax.random_model import preset_config, random_model

    monkeypatch.setattr(model_module, "_SHARED_DRAW", 100_000)  # its experts count as large
    quantized = lambda x: isinstance(x, (quant.QWeight, fp8.Fp8Weight))  # noqa: E731
    as_made, real = [], random_module.slice_quantizer

    def spy(*args):
        each = real(*args)

        def record(path, x):
            y = each(path, x)
            if quantized(y):
                as_made.append(path)
            return y

        return record

    monkeypatch.setattr(random_module, "slice_quantizer", spy)
    cfg = preset_config(
        "tiny-v3", num_hidden_layers=2, first_k_dense_replace=1, q_lora_rank=128, kv_lora_rank=128, hidden_size=128
    )
    floats = random_model(cfg, seed=1)
    for scheme in ("w4a8c8", "fp8"):
        as_made.clear()
        made, after = random_model(cfg, seed=1, scheme=scheme), quantize_model(floats, scheme)
        assert made.cfg == after.cfg and made.cfg.quantization.scheme == scheme
        assert ("segments", 1, "mlp", "experts", "gate") in as_made  # quantised slice by slice, not afterwards
        assert jax.tree.structure(made.params) == jax.tree.structure(after.params)
        for a, b in zip(jax.tree.leaves(made.params), jax.tree.leaves(after.params), strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory):
    """A random bf16 checkpoint whose stacked experts outweigh its largest tensor, so a load places their values
    and scales one position at a time; the MTP layer's experts and everything else are placed whole."""
    from hcfjax.random_model import preset_config, random_model

    cfg = preset_config("tiny-v3", num_hidden_layers=9, first_k_dense_replace=1, n_routed_experts=64)
    path = tmp_path_factory.mktemp("moe-bf16")
    hcfjax.save(random_model(cfg, seed=2), path)
    return path


@pytest.mark.parametrize("scheme", ["w4a8c8", "fp8"])
def test_load_quantises_as_it_reads_what_quantising_the_loaded_model_gives(
    moe_checkpoint, tmp_path, monkeypatch, scheme
):
    """hcfjax.load(scheme=...) quantises each float tensor as it reads it (the devices never hold the float model):
    bit for bit quantize_model on the model loaded in bf16, also placed by a plan, whether a quantised param is
    placed whole or position by position (w4a8c8, on a checkpoint whose experts' values and scales both outweigh
    its largest tensor; fp8 on the embedded model, placed whole); a checkpoint quantised to the scheme already
    loads as it is, one quantised to another is refused."""
    from hcfjax.checkpoint import QuantizedReads
    from sharding.plans import prefill_plan

    where = moe_checkpoint if scheme == "w4a8c8" else None
    waiting, part = [], QuantizedReads.part

    def watched(self, spec):  # what waits on the host after each part: scales only, never a weight's values
        out = part(self, spec)
        waiting.append([field for parts in self._made.values() for field in parts])
        return out

    monkeypatch.setattr(QuantizedReads, "part", watched)
    made = hcfjax.load(where, scheme=scheme)
    assert waiting and not any("q" in fields for fields in waiting)
    monkeypatch.undo()
    want = quantize_model(hcfjax.load(where), scheme)
    placed = hcfjax.load(where, scheme=scheme, plan=prefill_plan(tp=2, ep=2))
    assert made.cfg == want.cfg == placed.cfg and made.cfg.quantization.scheme == scheme
    if where is not None:
        largest = 2 * 258 * made.cfg.hidden_size  # the embedding, in bf16: params above it are placed per position
        layers = (made.params["segments"][1], made.params["mtp"][0]["layer"])
        gate, mtp_gate = (layer["mlp"]["experts"]["gate"] for layer in layers)
        assert min(gate.q.nbytes, gate.scale.nbytes) > largest >= mtp_gate.scale.nbytes
    for model in (made, placed):
        assert jax.tree.structure(model.params) == jax.tree.structure(want.params)
        for a, b in zip(jax.tree.leaves(model.params), jax.tree.leaves(want.params), strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    hcfjax.save(hcfjax.load(scheme=scheme), tmp_path)
    assert hcfjax.load(tmp_path, scheme=scheme).cfg.quantization.scheme == scheme
    other = "w4a16" if scheme == "fp8" else "fp8"
    with pytest.raises(ValueError, match=f"quantised already \\({scheme}\\), not to {other}"):
        hcfjax.load(tmp_path, scheme=other)
