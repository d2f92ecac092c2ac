"""Bad checkpoints fail whole, before anything is placed, with an error naming the file and the tensor: truncated
shards, wrong dtypes, an index that disagrees with its files (or is missing), fp8 scales of the wrong shape."""

import json
import os
import struct

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import hcfjax
from hcfjax.checkpoint import CheckpointError
from tests.test_checkpoint import copy_fixture, quantize_fp8_blocks

SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
INDEX = "model.safetensors.index.json"


def fails_whole(path, *fragments) -> str:
    """Loads `path`, expecting a CheckpointError whose message holds every fragment, and no new device array alive
    (the error's traceback keeps alive whatever the load had placed)."""
    before = {id(a) for a in jax.live_arrays()}
    with pytest.raises(CheckpointError) as err:
        hcfjax.load(path)
    placed = [a.shape for a in jax.live_arrays() if id(a) not in before]
    assert not placed, f"{len(placed)} arrays placed before the error"
    msg = str(err.value)
    for f in fragments:
        assert f in msg, msg
    return msg


def header(file) -> dict:
    with open(file, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(n))


def edit(file, change) -> None:
    tensors = load_file(file)
    change(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def test_truncated_shard_names_the_first_tensor_cut(tmp_path):
    dst = copy_fixture(tmp_path)
    entries = {k: v for k, v in header(dst / SHARD2).items() if k != "__metadata__"}
    last = max(entries, key=lambda k: entries[k]["data_offsets"][1])
    size = (dst / SHARD2).stat().st_size
    with open(dst / SHARD2, "r+b") as fh:
        fh.truncate(size - 16)
    fails_whole(dst, SHARD2, "truncated", repr(last))
    with open(dst / SHARD2, "r+b") as fh:
        fh.truncate(100)  # inside the JSON header
    fails_whole(dst, SHARD2, "truncated", "header needs")


def test_wrong_dtype_is_named(tmp_path):
    dst = copy_fixture(tmp_path)
    name = "model.layers.0.mlp.gate_proj.weight"
    file = dst / json.loads((dst / INDEX).read_text())["weight_map"][name]
    edit(file, lambda t: t.__setitem__(name, t[name].astype(np.int32)))
    fails_whole(dst, repr(name), file.name, "I32", "F8_E4M3 with a weight_scale_inv")


def test_index_naming_a_missing_file(tmp_path):
    dst = copy_fixture(tmp_path)
    (dst / SHARD2).unlink()
    on_shard2 = sorted(n for n, f in json.loads((dst / INDEX).read_text())["weight_map"].items() if f == SHARD2)
    fails_whole(dst, f"missing {SHARD2}", INDEX, repr(on_shard2[0]))


def test_index_listing_a_tensor_its_file_lacks(tmp_path):
    dst = copy_fixture(tmp_path)
    name = sorted(load_file(dst / SHARD1))[5]
    edit(dst / SHARD1, lambda t: t.pop(name))
    fails_whole(dst, INDEX, repr(name), SHARD1, "lacks it")


def test_missing_index_with_a_missing_shard(tmp_path):
    dst = copy_fixture(tmp_path)
    (dst / INDEX).unlink()
    assert hcfjax.load(dst).cfg.num_hidden_layers == 5  # the shards alone are a checkpoint
    (dst / SHARD2).unlink()
    fails_whole(dst, f"no {INDEX}", f"missing {SHARD2} of 2")


def fp8_weight(dst, name, scale_shape=None):
    """Rewrites `name` as fp8 + weight_scale_inv (scales of `scale_shape` when given), beside it and in the index."""
    index = json.loads((dst / INDEX).read_text())
    file = index["weight_map"][name]

    def to_fp8(t):
        q, s = quantize_fp8_blocks(t[name].astype(np.float32))
        t[name] = q
        t[name + "_scale_inv"] = s if scale_shape is None else np.ones(scale_shape, np.float32)

    edit(dst / file, to_fp8)
    index["weight_map"][name + "_scale_inv"] = file
    (dst / INDEX).write_text(json.dumps(index))
    return file


def test_fp8_scale_of_the_wrong_shape(tmp_path):
    dst = copy_fixture(tmp_path)
    name = "model.layers.2.mlp.experts.3.down_proj.weight"  # [64, 32]: one 128 x 128 block
    file = fp8_weight(dst, name, scale_shape=(2, 1))
    fails_whole(dst, repr(name + "_scale_inv"), file, "(2, 1)", "(1, 1)")


def test_fp8_scale_beside_a_float_weight(tmp_path):
    dst = copy_fixture(tmp_path)
    name = "model.layers.0.self_attn.o_proj.weight"
    index = json.loads((dst / INDEX).read_text())
    file = index["weight_map"][name]
    edit(dst / file, lambda t: t.__setitem__(name + "_scale_inv", np.ones((1, 1), np.float32)))
    index["weight_map"][name + "_scale_inv"] = file
    (dst / INDEX).write_text(json.dumps(index))
    fails_whole(dst, repr(name + "_scale_inv"), repr(name), file, "not fp8")


def test_serve_fails_with_the_tensor_while_its_steps_compile(tmp_path):
    """hcfjax serve compiles its steps while the weights load: a tensor that fails the load (the headers alone look
    right) ends the command with the error naming it, exit status 2, not a server without weights."""
    import subprocess
    import sys

    dst = copy_fixture(tmp_path)
    name = "model.layers.0.mlp.gate_proj.weight"
    file = dst / json.loads((dst / INDEX).read_text())["weight_map"][name]
    edit(file, lambda t: t.__setitem__(name, t[name].astype(np.int32)))
    cmd = [sys.executable, "-m", "hcfjax.cli", "serve", "--model", str(dst), "--port", "0", "--compile-cache", "off"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 2, done.stderr[-2000:]
    assert "error:" in done.stderr and repr(name) in done.stderr and "Traceback" not in done.stderr
    assert "ready" not in done.stdout
