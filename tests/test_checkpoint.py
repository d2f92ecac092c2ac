"""Checkpoint loading and saving: round trips, fp8 block dequantisation, sharded files, and clear errors."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import hcfjax
from hcfjax.checkpoint import FP8_BLOCK, CheckpointError, dequantize_fp8
from hcfjax.config import ConfigError, ModelConfig
from hcfjax.tensor_specs import get_path, tensor_specs
from tests.conftest import FIXTURES, rel_err


def copy_fixture(tmp_path, name="tiny_v3"):
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    (dst / "reference.npz").unlink()
    return dst


def test_save_load_round_trip_is_exact(v3_model, tmp_path):
    hcfjax.save(v3_model, tmp_path / "out")
    again = hcfjax.load(tmp_path / "out", dtype=jnp.float32)
    assert again.cfg == v3_model.cfg
    same = jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), v3_model.params, again.params)
    assert all(jax.tree.leaves(same))
    # The written names are DeepSeek's, one tensor per expert, exactly the fixture's set.
    written = set(load_file(tmp_path / "out" / "model.safetensors"))
    index = json.loads((FIXTURES / "tiny_v3" / "model.safetensors.index.json").read_text())
    assert written == set(index["weight_map"])


def test_load_without_mtp(tmp_path):
    m = hcfjax.load(FIXTURES / "tiny_v3", dtype=jnp.float32, mtp=False)
    assert "mtp" not in m.params


def quantize_fp8_blocks(w: np.ndarray):
    """Reference DeepSeek fp8 quantisation: per 128x128 block, scale_inv = amax / 448."""
    rows, cols = w.shape
    nr, nc = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    scale = np.zeros((nr, nc), np.float32)
    q = np.zeros_like(w, dtype=ml_dtypes.float8_e4m3fn)
    for i in range(nr):
        for j in range(nc):
            blk = w[i * FP8_BLOCK : (i + 1) * FP8_BLOCK, j * FP8_BLOCK : (j + 1) * FP8_BLOCK]
            s = max(float(np.abs(blk).max()), 1e-12) / 448.0
            scale[i, j] = s
            q[i * FP8_BLOCK : (i + 1) * FP8_BLOCK, j * FP8_BLOCK : (j + 1) * FP8_BLOCK] = (blk / s).astype(q.dtype)
    return q, scale


@pytest.mark.parametrize("n,v", [(16, 16), (8, 24)])
def test_kv_b_held_as_w_uk_and_w_uv(n, v):
    """kv_b_proj [H * (N + V), C] holds each head's N key rows, then its V value rows: params keep them as
    [2, H, C, max(N, V)], W_UK then W_UV, the shorter zero-padded, and writing them back restores the tensor."""
    cfg = ModelConfig.from_json(FIXTURES / "tiny_v3" / "config.json")
    cfg = dataclasses.replace(cfg, qk_nope_head_dim=n, v_head_dim=v)
    (spec,) = [s for s in tensor_specs(cfg) if s.name == "model.layers.0.self_attn.kv_b_proj.weight"]
    h, c = cfg.num_attention_heads, cfg.kv_lora_rank
    t = np.random.default_rng(0).standard_normal(spec.shape).astype(np.float32)
    p = spec.to_params(t)
    assert p.shape == (2, h, c, max(n, v))
    heads = t.reshape(h, n + v, c)
    np.testing.assert_array_equal(p[0, :, :, :n], heads[:, :n].transpose(0, 2, 1))  # W_UK [H, C, N]
    np.testing.assert_array_equal(p[1, :, :, :v], heads[:, n:].transpose(0, 2, 1))  # W_UV [H, C, V]
    assert not p[0, :, :, n:].any() and not p[1, :, :, v:].any()
    np.testing.assert_array_equal(spec.to_checkpoint(p), t)


@pytest.mark.parametrize("n,v", [(16, 16), (8, 24), (24, 8)])
def test_kv_b_halves_of_a_stack_row_are_the_rows(n, v):
    """In the layer loop kv_b is a StackRow of the stacked [L, 2, H, C, max(N, V)]: attention.up_weights slices W_UK
    and W_UV out of the stack at a traced row, the same arrays as from that row taken alone."""
    from hcfjax.attention import up_weights
    from hcfjax.layers import StackRow

    cfg = ModelConfig.from_json(FIXTURES / "tiny_v3" / "config.json")
    cfg = dataclasses.replace(cfg, qk_nope_head_dim=n, v_head_dim=v)
    shape = (3, 2, cfg.num_attention_heads, cfg.kv_lora_rank, max(n, v))
    stack = jnp.asarray(np.random.default_rng(1).standard_normal(shape), jnp.bfloat16)
    halves = jax.jit(lambda s, row: up_weights({"kv_b": StackRow(s, row)}, cfg))
    for row in range(3):
        got, want = halves(stack, jnp.int32(row)), up_weights({"kv_b": stack[row]}, cfg)
        assert [g.shape for g in got] == [(*shape[2:4], n), (*shape[2:4], v)]
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_fp8_block_dequantisation():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(300, 200)).astype(np.float32) * np.linspace(0.01, 3, 200)
    q, s = quantize_fp8_blocks(w)
    back = dequantize_fp8(q, s)
    assert back.shape == w.shape
    assert rel_err(back, w) < 0.05  # e4m3 has 3 mantissa bits
    # each block is scaled by its own factor: a wrong block mapping would be off by the ratio of scales
    assert np.allclose(back[:128, :128], q[:128, :128].astype(np.float32) * s[0, 0])
    assert np.allclose(back[256:, 128:], q[256:, 128:].astype(np.float32) * s[2, 1])


def fp8_copy(tmp_path) -> tuple:
    """tiny_v3 with its projections rewritten as fp8 + weight_scale_inv, as DeepSeek ships V3 -> (path, name ->
    the dequantised weight)."""
    dst = copy_fixture(tmp_path)
    expected = {}
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        out = {}
        for name, t in tensors.items():
            if t.ndim == 2 and name.endswith(("proj.weight", "proj_with_mqa.weight")):
                q, s = quantize_fp8_blocks(t.astype(np.float32))
                out[name], out[name + "_scale_inv"] = q, s
                expected[name] = dequantize_fp8(q, s)
            else:
                out[name] = t
        save_file(out, f)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    for name in expected:
        index["weight_map"][name + "_scale_inv"] = index["weight_map"][name]
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    return dst, expected


def test_fp8_checkpoint_loads_dequantised(tmp_path):
    """Loading an fp8 checkpoint dequantises each weight with its block scales."""
    dst, expected = fp8_copy(tmp_path)
    fp8 = hcfjax.load(dst, dtype=jnp.float32)
    specs = {s.name: s for s in tensor_specs(fp8.cfg)}
    assert len(expected) > 100  # attention, dense, expert and MTP projections
    for name, want in expected.items():
        s = specs[name]
        got = s.to_checkpoint(np.asarray(get_path(fp8.params, s.path)[s.index]))
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=name)


def _edit_first_shard(path, edit):
    f = sorted(path.glob("*.safetensors"))[0]
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f)


def test_missing_tensor_is_named(tmp_path):
    dst = copy_fixture(tmp_path)
    victim = {}

    def drop(t):
        victim["name"] = sorted(t)[3]
        del t[victim["name"]]

    _edit_first_shard(dst, drop)
    with pytest.raises(CheckpointError, match=victim["name"].replace(".", r"\.")):
        hcfjax.load(dst)


def test_wrong_shape_is_named(tmp_path):
    dst = copy_fixture(tmp_path)
    _edit_first_shard(dst, lambda t: t.__setitem__("lm_head.weight", np.zeros((3, 3), np.float32)))
    with pytest.raises(CheckpointError, match=r"lm_head\.weight.*\(3, 3\)"):
        hcfjax.load(dst)


def test_unexpected_tensor_is_named(tmp_path):
    dst = copy_fixture(tmp_path)
    _edit_first_shard(dst, lambda t: t.__setitem__("model.layers.0.mystery.weight", np.zeros(3, np.float32)))
    with pytest.raises(CheckpointError, match=r"mystery"):
        hcfjax.load(dst)


def test_missing_shard_and_bad_path(tmp_path):
    dst = copy_fixture(tmp_path)
    sorted(dst.glob("*.safetensors"))[1].unlink()
    with pytest.raises(CheckpointError, match="missing model-00002"):
        hcfjax.load(dst)
    with pytest.raises(FileNotFoundError):
        hcfjax.load(tmp_path / "nowhere")


BASE = json.loads((FIXTURES / "tiny_v3" / "config.json").read_text())


@pytest.mark.parametrize(
    "key,value,pattern",
    [
        ("topk_method", "mystery", "topk_method='mystery'"),
        ("scoring_func", "relu", "scoring_func='relu'"),
        ("hidden_act", "gelu", "hidden_act='gelu'"),
        ("model_type", "llama", "model_type='llama'"),
        ("n_group", 3, "not divisible by n_group=3"),
        ("num_experts_per_tok", 9, "exceeds the 8 experts of topk_group=2 groups"),
        ("rope_scaling", {"type": "dynamic", "factor": 2.0}, "rope_scaling.type='dynamic'"),
        ("kv_lora_rank", None, "kv_lora_rank"),
    ],
)
def test_bad_config_values_are_named(key, value, pattern):
    with pytest.raises(ConfigError, match=pattern.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig.from_dict({**BASE, key: value})


def test_rope_parameters_key_equals_rope_scaling():
    """transformers writes `rope_parameters` (with rope_theta inside); DeepSeek writes `rope_scaling`."""
    d = dict(BASE)
    rp = dict(d.pop("rope_scaling"), rope_theta=d.pop("rope_theta"), rope_type="yarn")
    rp.pop("type")
    assert ModelConfig.from_dict({**d, "rope_parameters": rp}) == ModelConfig.from_dict(BASE)


def test_config_round_trip():
    cfg = ModelConfig.from_dict(BASE)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.layer_segments == ((0, 2, False), (2, 3, True))


def shapes_of(tree):
    return jax.tree.structure(tree), [(tuple(x.shape), jnp.dtype(x.dtype)) for x in jax.tree.leaves(tree)]


def test_shapes_without_reading_equal_what_loads(tmp_path):
    """What a server compiles for while its weights load (hcfjax serve): hcfjax.api.load_shapes from config.json and
    the headers, and serving.config.load_model(shapes_only=True) with a scheme (load_shapes) or a preset (by
    jax.eval_shape), have
    the structure, shapes, dtypes and config of what load / load_model return: the embedded model in bf16 and,
    without its MTP layer, in f32; a w4a8c8 checkpoint; the embedded model quantised to w4a8c8 in memory; a random
    preset in w4a8."""
    from hcfjax.api import load_shapes
    from hcfjax.quantize import quantize_model
    from hcfjax.serving.config import load_model

    for kw in (dict(), dict(dtype=jnp.float32, mtp=False)):
        shapes, loaded = load_shapes(**kw), hcfjax.load(**kw)
        assert shapes.cfg == loaded.cfg and shapes_of(shapes.params) == shapes_of(loaded.params), kw
        assert not any(isinstance(x, jax.Array) for x in jax.tree.leaves(shapes.params))
    hcfjax.save(quantize_model(hcfjax.load(), "w4a8c8"), tmp_path / "q")
    shapes, loaded = load_shapes(tmp_path / "q"), hcfjax.load(tmp_path / "q")
    assert shapes.cfg == loaded.cfg and shapes_of(shapes.params) == shapes_of(loaded.params)
    for args in ((None, None, "w4a8c8"), (None, "tiny-v3", "w4a8"), (str(tmp_path / "q"), None, None)):
        shapes, loaded = load_model(*args, shapes_only=True), load_model(*args)
        assert shapes.cfg == loaded.cfg and shapes_of(shapes.params) == shapes_of(loaded.params), args
    with pytest.raises(ValueError, match="does not exist"):
        load_model(str(tmp_path / "nothing"), shapes_only=True)


def test_loading_compiles_nothing_per_tensor():
    """A load compiles a few programs for its stacked params (their zeros and the write of a slot), none per
    tensor: a tensor goes to its device as read (jnp.asarray of a host array compiles a program per shape)."""
    from tests.engine_helpers import xla_compiles

    jax.clear_caches()  # (the file's other loads compiled the same shapes; last in the file, so none recompiles)
    with xla_compiles() as compiles:
        m = hcfjax.load(FIXTURES / "tiny_v3", dtype=jnp.float32)
    assert len(jax.tree.leaves(m.params)) > 30
    assert set(compiles) <= {"jit(broadcast_in_dim)", "jit(_write_slot)", "jit(convert_element_type)"}, compiles
    assert len(compiles) <= 10, compiles
