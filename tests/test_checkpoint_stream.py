"""Streaming load and quantise: peak host memory stays a few tensors on a generated multi-shard checkpoint (bf16,
and DeepSeek's fp8 with block scales, dequantised or kept fp8), a sharding plan gets each device exactly its slices,
and quantising an fp8 checkpoint tensor by tensor gives what quantising the loaded model gives."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import hcfjax
from hcfjax import fp8
from hcfjax.checkpoint import FP8_BLOCK, dequantize_fp8
from hcfjax.config import ModelConfig, QuantConfig
from hcfjax.quantize import quantize_checkpoint, quantize_model
from hcfjax.random_model import PRESETS
from hcfjax.safetensors_files import read_index, read_tensor
from hcfjax.tensor_specs import quantized_specs, tensor_specs
from tests.conftest import FIXTURES
from tests.test_checkpoint import fp8_copy

# Small vocabulary, wide layers, many experts: 250 MB in bf16, cheap to make. Its largest tensor is the dense MLP's
# [1024, 1024]; its largest stacked param (a MoE segment's expert gates, 3 x 48 x [256, 1024]) is 18x that. The fp8
# variant's config.json leaves out DeepSeek's fp8 `quantization_config`, so its weights are dequantised on load;
# fp8-native is the same shards beside a config.json with the block, loaded as fp8.
WIDE = dict(
    PRESETS["tiny-v3"],
    vocab_size=512,
    hidden_size=1024,
    intermediate_size=1024,
    moe_intermediate_size=256,
    num_hidden_layers=4,
    first_k_dense_replace=1,
    num_nextn_predict_layers=0,
    n_routed_experts=48,
    num_attention_heads=8,
    q_lora_rank=256,
    kv_lora_rank=128,
    qk_nope_head_dim=64,
    qk_rope_head_dim=32,
    v_head_dim=64,
    torch_dtype="bfloat16",
)


def write_checkpoint(out: Path, fp8: bool, files: int = 5, seed: int = 0) -> None:
    """Random bits in every tensor of WIDE's name table, in `files` shards with an index. fp8: the linears (not the
    router or LM head) as e4m3 with one float32 weight_scale_inv per 128 x 128 block, as DeepSeek-V3 ships them."""
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(WIDE))
    rng = np.random.default_rng(seed)
    specs = tensor_specs(ModelConfig.from_dict(WIDE))
    per_file = math.ceil(sum(math.prod(s.shape) for s in specs) / files)
    shards, size = [{}], 0
    for s in specs:
        n = math.prod(s.shape)
        if size >= per_file * len(shards):
            shards.append({})
        if fp8 and s.linear and not s.fp32 and s.name != "lm_head.weight":
            # random sign, mantissa and exponent below 8: finite e4m3 values (NaN is all ones)
            bits = rng.integers(0, 256, n, np.uint8) & 0xBF
            shards[-1][s.name] = bits.view(ml_dtypes.float8_e4m3fn).reshape(s.shape)
            blocks = tuple(-(-d // FP8_BLOCK) for d in s.shape)
            shards[-1][s.name + "_scale_inv"] = rng.uniform(1e-3, 1e-2, blocks).astype(np.float32)
        elif s.fp32:
            shards[-1][s.name] = rng.standard_normal(s.shape, np.float32)
        else:  # bf16 with a random sign and mantissa, magnitudes 1/128 to 1/64
            bits = (rng.integers(0, 1 << 16, n, np.uint16) & 0x807F) | 0x3C00
            shards[-1][s.name] = bits.view(ml_dtypes.bfloat16).reshape(s.shape)
        size += n
    weight_map = {}
    for i, tensors in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    root = tmp_path_factory.mktemp("wide")
    write_checkpoint(root / "bf16", fp8=False)
    write_checkpoint(root / "fp8", fp8=True)
    (root / "fp8-native").mkdir()
    for f in (root / "fp8").iterdir():
        if f.name != "config.json":
            (root / "fp8-native" / f.name).symlink_to(f)
    block = QuantConfig.for_scheme("fp8").to_dict()
    (root / "fp8-native" / "config.json").write_text(json.dumps({**WIDE, "quantization_config": block}))
    return root


# Runs in a fresh process: the baseline is its resident memory once jax and hcfjax are imported and one program is
# compiled (XLA's compiler start-up); the peak is VmHWM, reset to the current RSS just before the work.
MEASURE = """
import json, sys
import jax, jax.numpy as jnp
import hcfjax
from hcfjax import fp8
from hcfjax.quantize import quantize_checkpoint

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

jax.jit(lambda x: x + 1)(jnp.ones(3)).block_until_ready()
base = status("VmRSS")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
job, src, out = sys.argv[1:4]
if job == "load":
    m = hcfjax.load(src)
    held = sum(x.nbytes for x in jax.tree.leaves(m.params))
    down = m.params["segments"][1]["mlp"]["experts"]["down"]
    kept = isinstance(down, fp8.Fp8Weight)
    if isinstance(down, fp8.Fp8Weight):  # the last expert's alone, [F, D] (a whole stacked one would count)
        down = fp8.dequantize(fp8.Fp8Weight(down.q[-1, -1], down.scale_inv[-1, -1]))[None, None]
    probe = [float(jnp.abs(down[-1, -1].astype(jnp.float32)).sum()), float(down[-1, -1, 3, 5].astype(jnp.float32))]
else:
    quantize_checkpoint(src, out, "w8a8", shard_bytes=32 << 20)
    held, probe, kept = 0, None, None
print(json.dumps({"excess": status("VmHWM") - base - held, "probe": probe, "fp8": kept}))
"""


def measure(job: str, src: Path, out: Path | None = None) -> dict:
    """Runs MEASURE with XLA's default optimisation, as users load (the suite's level 0, set in conftest.py for
    compile time, turns XLA:CPU's in-place fp8 updates into loops over the whole param)."""
    flags = os.environ.get("XLA_FLAGS", "").replace("--xla_backend_optimization_level=0", "").strip()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(Path(__file__).parents[1]), "XLA_FLAGS": flags}
    run = subprocess.run(
        [sys.executable, "-c", MEASURE, job, str(src), str(out)], capture_output=True, text=True, env=env, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def host_bound(path: Path) -> tuple[int, int]:
    """(bound, model bytes in bf16). The bound: 4 copies of the largest tensor in float32 (the widest a tensor gets
    on its way: read, dequantised, laid out, converted) plus 64 MB for XLA's compiled load programs and allocator
    slack. A load that holds the model on the host holds its bf16 bytes."""
    headers = read_index(path)
    largest = max(math.prod(e.shape) for e in headers.values()) * 4
    bf16 = sum(math.prod(e.shape) for n, e in headers.items() if not n.endswith("_scale_inv")) * 2
    return 4 * largest + (64 << 20), bf16


@pytest.mark.parametrize("variant", ["bf16", "fp8", "fp8-native"])
def test_load_peak_host_memory_is_a_few_tensors(wide, variant):
    """On CPU the devices' memory is the process's own, so the loaded params' bytes are subtracted from the peak:
    what remains is what loading held on the host. Holding the model there (as a load that stacks params on the
    host first does) would exceed the bound by the largest stacked param, 75 MB here (fp8-native: 38 MB)."""
    src = wide / variant
    got = measure("load", src)
    if variant == "fp8-native":
        assert got["fp8"], "the fp8 weights were dequantised"
    bound, model = host_bound(src)
    assert model > 200 << 20
    assert got["excess"] < bound, (got, bound)
    assert got["excess"] < model / 4
    # the last expert's down projection, as stored (fp8: dequantised with its block scales)
    name = f"model.layers.{WIDE['num_hidden_layers'] - 1}.mlp.experts.{WIDE['n_routed_experts'] - 1}.down_proj.weight"
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    if variant == "bf16":
        with safe_open(str(src / index[name]), "numpy") as f:
            want = f.get_tensor(name)
    else:
        entries = read_index(src)
        want = dequantize_fp8(read_tensor(entries[name]), read_tensor(entries[name + "_scale_inv"]))
    want = want.T if variant == "fp8-native" else want.T.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_allclose(got["probe"], [np.abs(want).sum(), want[3, 5]], rtol=1e-5)


def test_quantize_streams_shards(wide, tmp_path):
    """`hcfjax quantize` from the fp8 checkpoint to w8a8 holds a few tensors, not the model, and writes shards of
    the size asked as it goes."""
    src, out = wide / "fp8", tmp_path / "w8a8"
    got = measure("quantize", src, out)
    bound, model = host_bound(src)
    assert got["excess"] < bound, (got, bound)
    assert got["excess"] < model / 4
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    cfg = ModelConfig.from_dict(WIDE)
    assert list(weight_map) == [s.name for s in quantized_specs(tensor_specs(cfg), QuantConfig.for_scheme("w8a8"))]
    files = sorted(out.glob("*.safetensors"))
    assert len(files) == len(set(weight_map.values())) > 2
    assert all(f.stat().st_size < (32 << 20) + (1 << 20) for f in files)


@pytest.fixture(scope="module")
def tiny_fp8(tmp_path_factory):
    return fp8_copy(tmp_path_factory.mktemp("fp8"))[0]


@pytest.fixture(scope="module")
def tiny_fp8_native(tiny_fp8, tmp_path_factory):
    """tiny_fp8's shards beside a config.json with DeepSeek's fp8 block: loaded as fp8."""
    out = tmp_path_factory.mktemp("fp8-native")
    for f in tiny_fp8.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    config = json.loads((tiny_fp8 / "config.json").read_text())
    config["quantization_config"] = QuantConfig.for_scheme("fp8").to_dict()
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("source", ["bf16", "fp8-native"])
@pytest.mark.parametrize("plan_args", [("decode", 8), ("prefill", 2, 4)])
def test_plan_load_places_each_device_its_slices(plan_args, source, request):
    """Loading under a plan gives every param the plan's sharding, each device holding exactly the slices that
    placing the single-device model would give it (experts over EP, heads and expert widths over TP; fp8 parts as
    the plan places them)."""
    from sharding.plans import decode_plan, prefill_plan, shard_params

    plan = decode_plan(*plan_args[1:]) if plan_args[0] == "decode" else prefill_plan(*plan_args[1:])
    src = FIXTURES / "tiny_v3" if source == "bf16" else request.getfixturevalue("tiny_fp8_native")
    ref = shard_params(hcfjax.load(src, dtype=jnp.float32).params, plan)
    got = hcfjax.load(src, dtype=jnp.float32, plan=plan).params
    experts = got["segments"][1]["mlp"]["experts"]["gate"]  # [L, E, D, F]
    if source == "bf16":
        ep = plan.mesh.shape["ep"]
        assert all(s.data.shape[1] == experts.shape[1] // ep for s in experts.addressable_shards)
    else:
        assert isinstance(experts, fp8.Fp8Weight) and experts.q.dtype == jnp.float8_e4m3fn
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(ref), strict=True):
        assert a.sharding == b.sharding and a.dtype == b.dtype, path
        for sa, sb in zip(a.addressable_shards, b.addressable_shards, strict=True):
            assert sa.device == sb.device and sa.index == sb.index, path
            np.testing.assert_array_equal(np.asarray(sa.data), np.asarray(sb.data), err_msg=str(path))


@pytest.mark.parametrize("scheme", ["w4a16", "w4a8", "w4a8c8", "w8a8", "fp8"])
def test_quantize_from_fp8_equals_quantising_the_loaded_model(tiny_fp8, tmp_path, scheme):
    """Streaming an fp8 checkpoint through `quantize_checkpoint` gives what quantising the model loaded in bf16
    gives, for every scheme (small shards: several files)."""
    cfg = quantize_checkpoint(tiny_fp8, tmp_path / scheme, scheme, shard_bytes=64 << 10)
    assert cfg.quantization.scheme == scheme and len(list((tmp_path / scheme).glob("*.safetensors"))) > 2
    got = hcfjax.load(tmp_path / scheme)
    want = quantize_model(hcfjax.load(tiny_fp8), scheme)
    assert got.cfg == want.cfg
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got.params), jax.tree.leaves(want.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))
