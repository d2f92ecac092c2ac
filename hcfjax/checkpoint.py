"""Checkpoints in the HuggingFace / DeepSeek layout: `load_params` and `save_params`, and the checks between a
config and the tensors a checkpoint holds (counts, MTP presence, dtypes). What each tensor is, by name, is
`hcfjax.tensor_specs`'s table.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from hcfjax import fp8
from hcfjax.config import ModelConfig, QuantConfig
from hcfjax.quant import quantize_as
from hcfjax.safetensors_files import DTYPE_NAMES, CheckpointError, TensorEntry, read_index, read_tensor
from hcfjax.streaming import Stacked, fill_params
from hcfjax.tensor_specs import (
    TensorSpec,
    get_path,
    quantized_specs,
    quantized_weight,
    scale_part,
    stacked_shapes,
    tensor_specs,
    to_pytree,
)

_log = logging.getLogger(__name__)

FP8_BLOCK = fp8.BLOCK  # DeepSeek's fp8 checkpoints: one weight_scale_inv per 128 x 128 block


FP8_AS_FLOAT_HINT = " (config.json's quantization_config says fp8; hcfjax.load(..., fp8='dequantize') reads floats)"


# ---- reading ---------------------------------------------------------------------------------------------------


def checkpoint_headers(path: Path) -> dict[str, TensorEntry]:
    """name -> TensorEntry (file, dtype, shape) of every tensor in the checkpoint, read and checked from the file
    headers and the index (safetensors_files.read_index)."""
    return read_index(path)


def layer_counts(names) -> tuple[int, int]:
    """(decoder layers, main and MTP; routed experts per layer) that tensor names hold, from their numbers."""
    layers = experts = 0
    for name in names:
        parts = name.split(".")
        if name.startswith("model.layers.") and parts[2].isdigit():
            layers = max(layers, int(parts[2]) + 1)
            if parts[3:5] == ["mlp", "experts"] and len(parts) > 5 and parts[5].isdigit():
                experts = max(experts, int(parts[5]) + 1)
    return layers, experts


def check_counts(cfg: ModelConfig, names, where: Path) -> None:
    """The config's layer and expert counts, which set the size of its name table (tensor_specs), against the
    tensors the checkpoint holds, before that table is built: a config naming more than the checkpoint has is
    refused (CheckpointError naming both); fewer is found as unexpected tensors when the weights are read."""
    layers, experts = layer_counts(names)
    main, mtp = cfg.num_hidden_layers, cfg.num_mtp_layers
    if main > layers:
        raise CheckpointError(f"config.json has num_hidden_layers={main}, checkpoint {where} has {layers} layers")
    if mtp and main < layers < main + mtp:  # (none at all: the MTP layers are absent, which load() allows)
        raise CheckpointError(
            f"config.json has num_nextn_predict_layers={mtp}, checkpoint {where} has {layers - main} MTP layers"
        )
    moe = any(cfg.is_moe_layer(i) for i in range(min(main + mtp, layers)))
    if moe and cfg.n_routed_experts > experts:
        raise CheckpointError(
            f"config.json has n_routed_experts={cfg.n_routed_experts}, checkpoint {where} has {experts} experts"
        )


def mtp_names(cfg: ModelConfig) -> list[str]:
    """Checkpoint names of the MTP layers' weights, in name-table order (quantised weights by their values' names:
    match_sources checks their scales and dtypes)."""
    cfg = dataclasses.replace(cfg, quantization=None)
    main = {s.name for s in tensor_specs(cfg, mtp=False)}
    return [s.name for s in tensor_specs(cfg, mtp=True) if s.name not in main]


def mtp_present(cfg: ModelConfig, names, where: Path) -> bool:
    """Whether a checkpoint holding `names` has its MTP layers: all of them (True) or none (False). Transformers
    writes `num_nextn_predict_layers` but never saves the MTP layer, and re-uploads often drop it; a partly present
    MTP layer is a broken checkpoint, named."""
    want = mtp_names(cfg)
    missing = [n for n in want if n not in names]
    if len(missing) == len(want):
        return False
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise CheckpointError(
            f"checkpoint {where} has part of its MTP layers: lacks {', '.join(repr(n) for n in missing[:3])}{more}"
        )
    return True


# Model dtypes `dtype="auto"` may pick: config.json's torch_dtype names, and safetensors' names for them.
AUTO_DTYPES = ("bfloat16", "float16", "float32")
_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def checkpoint_dtype(path: Path, headers: dict[str, TensorEntry]) -> jnp.dtype:
    """The checkpoint's own dtype: config.json's `torch_dtype` (`dtype` in newer transformers), else the
    embedding's stored dtype (fp8 checkpoints keep it in bf16)."""
    config = json.loads((path / "config.json").read_text())
    name = config.get("torch_dtype") or config.get("dtype")
    source = "config.json's torch_dtype"
    if name is None:
        embed = headers.get("model.embed_tokens.weight")
        stored = embed.dtype if embed else None
        name = _SAFETENSORS_DTYPES.get(stored, stored)
        source = "its model.embed_tokens.weight"
    name = str(name).removeprefix("torch.")
    if name not in AUTO_DTYPES:
        raise CheckpointError(
            f'dtype="auto": checkpoint {path} has dtype {name!r} ({source}), not one of {AUTO_DTYPES}'
        )
    return jnp.dtype(name)


def dequantize_fp8(w: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """DeepSeek fp8 e4m3 weight [out, in] with one scale per 128 x 128 block -> float32."""
    rows, cols = w.shape
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), FP8_BLOCK, 0), FP8_BLOCK, 1)[:rows, :cols]
    return w.astype(np.float32) * s


# Tensors that real checkpoints carry but this project derives or shares.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def ignored_tensor(cfg: ModelConfig, name: str) -> bool:
    """Whether checkpoint tensor `name` is one the model derives or shares, and so is skipped."""
    if name.endswith(_IGNORED_SUFFIXES):
        return True
    # DeepSeek-V3 ships a copy of the embedding inside each MTP layer; the model shares the main one.
    if name.startswith("model.layers.") and name.endswith(".embed_tokens.weight"):
        return int(name.split(".")[2]) >= cfg.num_hidden_layers
    return False


@dataclasses.dataclass(frozen=True)
class Source:
    """Where a name-table tensor lies in the checkpoint, with its fp8 block scales when it is fp8."""

    entry: TensorEntry
    scale_inv: TensorEntry | None = None


_FLOATS = ("BF16", "F16", "F32", "F64")
_FP8 = "F8_E4M3"
_SCALE_INV = ".weight_scale_inv"


def match_sources(path: Path, index: dict[str, TensorEntry], specs: list[TensorSpec], skip) -> dict[str, Source]:
    """name -> Source for every spec, after checking the whole checkpoint against the name table: no unexpected
    tensor (unless skip(name)), none missing, every shape as the config says, every dtype one the spec can take.
    Quantised parts take their exact dtype: an Fp8Weight's `q` e4m3, its `scale_inv` the f32 weight_scale_inv beside
    it, each a source of its own (fp8.checkpoint_specs). A float spec takes a float, or (a linear) fp8 e4m3 beside a
    weight_scale_inv of one scale per 128 x 128 block, which read_weight dequantises. Errors name the tensor and
    its file; nothing has been read or placed when they are raised."""
    by_name = {s.name: s for s in specs}
    sources = {}
    for name, e in index.items():
        spec, weight = by_name.get(name), name.removesuffix("_scale_inv")
        if spec is None and name.endswith(_SCALE_INV) and weight in by_name:  # the scales of a weight read as floats
            w = index.get(weight)
            if w is not None and w.dtype != _FP8:
                raise CheckpointError(f"tensor {e.where} scales {w.where}, which is {w.dtype}, not fp8 ({_FP8})")
            continue
        if spec is None:
            if skip(weight):
                continue
            raise CheckpointError(f"unexpected tensor {e.where} at {path} (not in the name table for this config)")
        if e.shape != spec.shape:
            raise CheckpointError(f"tensor {e.where} has shape {e.shape}, config expects {spec.shape}")
        scale = index.get(name + "_scale_inv") if name.endswith(".weight") else None
        if spec.dtype is not None:
            want = DTYPE_NAMES[np.dtype(spec.dtype)]
            if e.dtype != want:
                hint = FP8_AS_FLOAT_HINT if spec.quant == fp8.QUANT and e.dtype in _FLOATS else ""
                raise CheckpointError(
                    f"tensor {e.where} has dtype {e.dtype}; this quantised checkpoint needs {want}{hint}"
                )
        elif e.dtype == _FP8 and spec.linear:
            if scale is None:
                raise CheckpointError(f"fp8 tensor {e.where} has no {name}_scale_inv beside it")
            blocks = fp8.scale_shape(*e.shape)
            if scale.shape != blocks or scale.dtype not in _FLOATS:
                raise CheckpointError(
                    f"tensor {scale.where} is {scale.dtype} {scale.shape}; fp8 {name!r} {e.shape} needs one float "
                    f"scale per {FP8_BLOCK} x {FP8_BLOCK} block: {blocks}"
                )
        elif e.dtype not in _FLOATS:
            fp8_too = f", or {_FP8} with a weight_scale_inv" if spec.linear else ""
            raise CheckpointError(
                f"tensor {e.where} has dtype {e.dtype}; expected one of {', '.join(_FLOATS)}{fp8_too}"
            )
        sources[name] = Source(e, scale if spec.dtype is None and e.dtype == _FP8 else None)
    missing = [s.name for s in specs if s.name not in sources]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint {path} lacks tensor {missing[0]!r}{more}")
    return sources


def read_weight(source: Source) -> np.ndarray:
    """A checkpoint tensor as stored (fp8 with block scales: dequantised to float32)."""
    t = read_tensor(source.entry)
    return t if source.scale_inv is None else dequantize_fp8(t, read_tensor(source.scale_inv))


def load_params(
    path: str | Path,
    cfg: ModelConfig,
    dtype=jnp.bfloat16,
    mtp: bool = True,
    sharding=None,
    index=None,
    quantize: QuantConfig | None = None,
) -> dict:
    """Streams a checkpoint into the params pytree on its devices (arrays of `dtype`; router in f32; quantised
    parts as stored).

    The whole checkpoint is checked against the name table first (match_sources), so a bad one fails, naming file
    and tensor, before anything is read or placed. Then each param is filled on its devices one checkpoint tensor at
    a time (hcfjax/streaming.py), in the files' order. fp8 e4m3 weights with `weight_scale_inv` stay fp8, with their
    scales, where the config's quantization_config is DeepSeek's fp8 block (fp8.checkpoint_specs), and are
    dequantised as they are read otherwise. sharding(path, shape) -> jax.sharding.Sharding places each param (a
    plan's `param_sharding`; None: the default device): each device receives only its slices, and a process reads
    only the tensors its own devices hold. Host memory holds a few checkpoint tensors at a time, never the model.
    index: the checkpoint's read_index, when the caller has it. quantize: quantise the float weights as that scheme
    says as they are read, each weight as `hcfjax.quantize.quantize_model` would in the model loaded in `dtype`, so
    the devices never hold the float model (the host holds at most one param's scales besides).
    """
    path = Path(path)
    index = read_index(path) if index is None else index
    check_counts(cfg, index, path)  # before the name table, whose size the counts set
    specs = tensor_specs(cfg, mtp=mtp)
    sources = match_sources(path, index, specs, lambda n: ignored_tensor(cfg, n) or (not mtp and _is_mtp_name(cfg, n)))
    np_dtype = np.dtype(jnp.dtype(dtype))
    read = {"tensors": 0, "bytes": 0}

    def count(source: Source) -> None:
        read["tensors"] += 1
        read["bytes"] += source.entry.end - source.entry.begin

    quantized = None
    if quantize is not None:
        cfg = dataclasses.replace(cfg, quantization=quantize)
        specs = quantized_specs(specs, quantize)
        quantized = QuantizedReads(specs, sources, np_dtype, quantize.group_size, count)
    fixed = {s.path: np.dtype(s.dtype) for s in specs if s.dtype}
    stacked = {
        p: Stacked(shape, np.dtype(fixed.get(p, np.float32 if fp32 else np_dtype)), {})
        for p, (shape, fp32) in stacked_shapes(specs).items()
    }
    for s in specs:
        stacked[s.path].items[s.index] = s

    def params_layout(spec: TensorSpec) -> np.ndarray:
        if quantized is not None and spec.path in quantized.parts:
            return quantized.part(spec)
        t = read_weight(sources[spec.name])
        count(sources[spec.name])
        return spec.to_params(t).astype(stacked[spec.path].dtype, order="C")

    largest = max(math.prod(s.shape) * stacked[s.path].dtype.itemsize for s in specs)
    whole = {p for p, st in stacked.items() if math.prod(st.shape) * st.dtype.itemsize <= largest}  # fill_params'

    def file_order(spec: TensorSpec) -> tuple:
        if quantized is None or spec.path not in quantized.parts:
            e = sources[spec.name].entry
            return e.file.name, e.begin, 0
        if spec.path in quantized.scales:
            # scales right after the values whose read made them; scales placed whole after their last-read values
            items = stacked[spec.path].items.values() if spec.path in whole else [spec]
            return *max((e.file.name, e.begin) for e in (quantized.source(i).entry for i in items)), 1
        e = quantized.source(spec).entry
        return e.file.name, e.begin, 0

    params = fill_params(stacked, params_layout, sharding, file_order, stage_bytes=largest)
    _log.info("read %d of %d tensors (%.3g GB) from %s", read["tensors"], len(sources), read["bytes"] / 1e9, path)
    return _assembled(params, specs, cfg)


class QuantizedReads:
    """A float checkpoint's weights quantised as they are read (load_params' `quantize`, `hcfjax quantize`). Each
    quantised weight is two tensors (`quantized_specs`: its values `q` and its scales, in the params' layout); one
    read of the float tensor makes both, and the part not asked for yet waits here until it is (both callers ask
    for each scale right after the values it comes with; a part asked for first is made by a read of its own, so
    any order gives the same weights)."""

    def __init__(self, specs: list[TensorSpec], sources: dict, dtype: np.dtype, group: int, on_read):
        self.sources, self.dtype, self.group, self.on_read = sources, dtype, group, on_read
        self.values = {(s.path[:-1], s.index): s for s in specs if s.quant}  # (weight path, index) -> its values
        self.parts: dict[tuple, tuple[tuple, str]] = {}  # a part's param path -> (its weight's path, its field)
        for (w, _), s in self.values.items():
            self.parts[s.path] = (w, "q")
            self.parts[w + (scale_part(s.quant),)] = (w, scale_part(s.quant))
        self.scales = {p for p, (_, field) in self.parts.items() if field != "q"}
        self._made: dict[tuple, dict[str, np.ndarray]] = {}  # (weight path, index) -> its parts not yet taken

    def source(self, spec: TensorSpec):
        """The float tensor a part is made from."""
        return self.sources[self.values[self.parts[spec.path][0], spec.index].name]

    def part(self, spec: TensorSpec) -> np.ndarray:
        w, field = self.parts[spec.path]
        key = (w, spec.index)
        if key not in self._made:
            values, source = self.values[key], self.source(spec)
            self.on_read(source)
            made = quantize_as(jnp.asarray(read_weight(source).T.astype(self.dtype)), values.quant, self.group)
            scale = scale_part(values.quant)
            self._made[key] = {"q": np.asarray(made.q), scale: np.asarray(getattr(made, scale))}
        parts = self._made[key]
        out = parts.pop(field)
        if not parts:
            del self._made[key]
        return out


def params_shapes(cfg: ModelConfig, dtype=jnp.bfloat16, mtp: bool = True) -> dict:
    """The pytree load_params returns for a checkpoint of `cfg`, as jax.ShapeDtypeStructs (nothing read): what a
    server compiles its steps for while the weights load."""
    specs = tensor_specs(cfg, mtp=mtp)
    np_dtype = np.dtype(jnp.dtype(dtype))
    fixed = {s.path: np.dtype(s.dtype) for s in specs if s.dtype}
    flat = {
        p: jax.ShapeDtypeStruct(shape, fixed.get(p, np.float32 if fp32 else np_dtype))
        for p, (shape, fp32) in stacked_shapes(specs).items()
    }
    return _assembled(flat, specs, cfg)


def _assembled(flat: dict[tuple, object], specs: list[TensorSpec], cfg: ModelConfig) -> dict:
    """{path: leaf} with each quantised weight's parts joined into its pytree type -> the params pytree."""
    for s in specs:
        if s.quant and s.path in flat:
            w = s.path[:-1]
            flat[w] = quantized_weight(flat, w, s.quant, cfg)
    return to_pytree(flat)


def _is_mtp_name(cfg: ModelConfig, name: str) -> bool:
    return name.startswith("model.layers.") and int(name.split(".")[2]) >= cfg.num_hidden_layers


# ---- writing ---------------------------------------------------------------------------------------------------

SHARD_BYTES = 2 * 1024**3


def save_params(params: dict, cfg: ModelConfig, path: str | Path, dtype=None) -> None:
    """Writes params as DeepSeek-layout safetensors (sharded above 2 GiB, with an index), tensor by tensor."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    has_mtp = "mtp" in params and len(params["mtp"]) > 0
    specs = tensor_specs(cfg, mtp=has_mtp)
    host = {}  # one device->host copy per stacked param, reused by its slices
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for s in specs:
        if s.path not in host:
            host[s.path] = np.asarray(jax.device_get(get_path(params, s.path)))
        t = host[s.path][s.index]
        t = s.to_checkpoint(t)
        if dtype is not None and not s.fp32 and s.dtype is None:
            t = t.astype(np.dtype(jnp.dtype(dtype)))
        t = np.ascontiguousarray(t)
        if size + t.nbytes > SHARD_BYTES and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][s.name] = t
        size += t.nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    if len(shards) > 1:
        total = sum(t.nbytes for sh in shards for t in sh.values())
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
        )
