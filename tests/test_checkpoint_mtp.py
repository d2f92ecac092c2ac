"""Checkpoints without their MTP layers (as transformers saves DeepSeek-V3) and `dtype="auto"`."""

import json
import warnings

import jax
import jax.numpy as jnp
import pytest
from safetensors.numpy import load_file, save_file

import hcfjax
from hcfjax.checkpoint import CheckpointError
from hcfjax.engine import Engine, EngineConfig
from hcfjax.speculative import SpeculativeConfig
from tests.test_checkpoint import copy_fixture


def strip_tensors(path, keep) -> list[str]:
    """Deletes the tensors `keep(name)` rejects from every shard and from the index; returns their names."""
    dropped = []
    for f in sorted(path.glob("*.safetensors")):
        tensors = load_file(f)
        dropped += [n for n in tensors if not keep(n)]
        save_file({n: t for n, t in tensors.items() if keep(n)}, f, metadata={"format": "pt"})
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if keep(n)}
    index_file.write_text(json.dumps(index))
    return sorted(dropped)


def mtp_layer_prefix(path) -> str:
    """DeepSeek stores MTP layer k as decoder layer num_hidden_layers + k."""
    return f"model.layers.{json.loads((path / 'config.json').read_text())['num_hidden_layers']}."


@pytest.fixture
def stripped(tmp_path):
    """tiny_v3 (config.json: num_nextn_predict_layers=1) with its MTP layer's tensors deleted, as transformers
    saves it."""
    dst = copy_fixture(tmp_path)
    prefix = mtp_layer_prefix(dst)
    assert json.loads((dst / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert strip_tensors(dst, lambda n: not n.startswith(prefix))
    return dst


def test_checkpoint_without_mtp_loads_the_main_model_with_one_warning(stripped, v3_model):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m = hcfjax.load(stripped, dtype=jnp.float32)
    assert [str(w.message) for w in caught if "MTP" in str(w.message)] == [str(caught[0].message)]
    assert "num_nextn_predict_layers=1" in str(caught[0].message)
    assert m.cfg.num_mtp_layers == 0 and "mtp" not in m.params
    full = {k: v for k, v in v3_model.params.items() if k != "mtp"}
    assert all(jax.tree.leaves(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), full, m.params)))
    # What it saves says 0 MTP layers, and loads again without a warning.
    hcfjax.save(m, stripped.parent / "again")
    assert json.loads((stripped.parent / "again" / "config.json").read_text())["num_nextn_predict_layers"] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert hcfjax.load(stripped.parent / "again", dtype=jnp.float32).cfg.num_mtp_layers == 0


def test_mtp_true_requires_the_mtp_layers(stripped):
    with pytest.raises(CheckpointError, match="no MTP layer tensors.*mtp=True"):
        hcfjax.load(stripped, mtp=True)


def test_mtp_false_gives_a_config_without_mtp_layers():
    from tests.conftest import FIXTURES

    m = hcfjax.load(FIXTURES / "tiny_v3", dtype=jnp.float32, mtp=False)
    assert m.cfg.num_mtp_layers == 0 and "mtp" not in m.params


def test_partly_present_mtp_layer_is_named(tmp_path):
    dst = copy_fixture(tmp_path)
    prefix = mtp_layer_prefix(dst)
    victims = (prefix + "eh_proj.weight", prefix + "self_attn.kv_a_layernorm.weight")
    dropped = strip_tensors(dst, lambda n: n not in victims)
    assert dropped == sorted(victims)
    for mtp in (None, True):
        with pytest.raises(CheckpointError, match="part of its MTP") as e:
            hcfjax.load(dst, mtp=mtp)
        assert all(v in str(e.value) for v in victims)


def test_speculative_decoding_on_a_model_without_mtp_is_a_clear_error(stripped):
    with pytest.warns(UserWarning, match="MTP"):
        m = hcfjax.load(stripped, dtype=jnp.float32)
    with pytest.raises(ValueError, match="needs MTP layers"):
        hcfjax.generate(m, [[1, 2, 3]], max_new_tokens=2, speculative=SpeculativeConfig())
    with pytest.raises(ValueError, match="needs MTP layers"):
        Engine(m, EngineConfig(max_slots=1, speculative=SpeculativeConfig()))


def test_dtype_auto_is_the_checkpoints(v3_model, tmp_path):
    from tests.conftest import FIXTURES

    assert hcfjax.load(FIXTURES / "tiny_v3", dtype="auto").dtype == jnp.float32  # torch_dtype: float32
    assert hcfjax.load(FIXTURES / "tiny_v3").dtype == jnp.bfloat16  # the default stays bf16
    bf16 = tmp_path / "bf16"
    hcfjax.save(v3_model, bf16, dtype=jnp.bfloat16)
    assert hcfjax.load(bf16, dtype="auto").dtype == jnp.bfloat16
    # Without torch_dtype in config.json: the stored tensors say.
    config = json.loads((bf16 / "config.json").read_text())
    del config["torch_dtype"]
    (bf16 / "config.json").write_text(json.dumps(config))
    assert hcfjax.load(bf16, dtype="auto").dtype == jnp.bfloat16
    config["torch_dtype"] = "int8"
    (bf16 / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="'int8'"):
        hcfjax.load(bf16, dtype="auto")


def test_cli_generate_runs_with_dtype_auto(tmp_path, capsys, monkeypatch):
    from hcfjax import cli
    from hcfjax.random_model import preset_config, random_model

    path = tmp_path / "tiny"
    hcfjax.save(random_model(preset_config("tiny-v3", num_hidden_layers=1), seed=3, dtype=jnp.float32), path)
    loaded = []
    load = hcfjax.load
    monkeypatch.setattr(hcfjax, "load", lambda *a, **k: loaded.append(load(*a, **k)) or loaded[-1])
    args = ["generate", "--model", str(path), "--prompt", "def f(x):", "--max-new-tokens", "2", "--dtype", "auto"]
    assert cli.main(args) == 0
    assert capsys.readouterr().out.startswith("def f(x):")
    assert loaded[0].dtype == jnp.float32
