"""A checkpoint directory's files: the index (model.safetensors.index.json), the safetensors headers and the
tensors, read one at a time (fp8 e4m3 ones with their block scales). Every check here names the broken file or
tensor with a CheckpointError: an index that is not a map of tensors to files beside it, a file that is not
safetensors, a tensor in two files or not where the index says, and a config counting more layers or experts than
the files hold (before the name table, whose size those counts set, is built)."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open

from hcfjax.config import ModelConfig

FP8_BLOCK = 128  # DeepSeek's fp8 checkpoints: one weight_scale_inv per 128 x 128 block


class CheckpointError(ValueError):
    """A checkpoint that does not match its config: missing, unexpected or misshapen tensors, named."""


INDEX_FILE = "model.safetensors.index.json"


def read_index(path: Path) -> dict[str, str] | None:
    """The weight_map of the checkpoint's index (tensor name -> file name beside it), or None without an index;
    CheckpointError, naming the index, for one that is not JSON of that form."""
    index = path / INDEX_FILE
    if not index.is_file():
        return None
    try:
        d = json.loads(index.read_text())
    except ValueError as e:  # not JSON, or not UTF-8
        raise CheckpointError(f"{index} is not valid JSON: {e}") from None
    weight_map = d.get("weight_map") if isinstance(d, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index} has no weight_map object of tensor names and files")
    for name, file in weight_map.items():
        if not isinstance(file, str) or file in ("", ".", "..") or "/" in file or "\\" in file:
            raise CheckpointError(f"{index}: weight_map maps {name!r} to {file!r:.60}, not a file beside the index")
    return weight_map


def checkpoint_files(path: Path) -> list[Path]:
    weight_map = read_index(path)
    if weight_map is not None:
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    missing = [f for f in files if not f.is_file()]
    if missing or not files:
        named = f" named by {INDEX_FILE}" if weight_map is not None else ""
        raise CheckpointError(
            f"no safetensors weights at {path}" + (f" (missing {missing[0].name}{named})" if missing else "")
        )
    return files


def checkpoint_headers(path: Path) -> dict[str, dict]:
    """name -> safetensors header entry (dtype, shape) of every tensor in the checkpoint, read from file headers.
    CheckpointError for a tensor held by two files, or one the index maps to a file that does not hold it."""
    out, owner = {}, {}
    for file in checkpoint_files(path):
        header, _ = _read_header(file)
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if name in owner:
                raise CheckpointError(f"tensor {name!r} is in both {owner[name]} and {file.name} (in {path})")
            out[name], owner[name] = entry, file.name
    for name, file in (read_index(path) or {}).items():
        if owner.get(name) != file:
            raise CheckpointError(f"{path / INDEX_FILE} maps tensor {name!r} to {file}, which does not hold it")
    return out


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


# Model dtypes `dtype="auto"` may pick: config.json's torch_dtype names, and safetensors' names for them.
AUTO_DTYPES = ("bfloat16", "float16", "float32")
_SAFETENSORS_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def checkpoint_dtype(path: Path, headers: dict[str, dict]) -> jnp.dtype:
    """The checkpoint's own dtype: config.json's `torch_dtype` (`dtype` in newer transformers), else the
    embedding's stored dtype (fp8 checkpoints keep it in bf16)."""
    config = json.loads((path / "config.json").read_text())
    name = config.get("torch_dtype") or config.get("dtype")
    source = "config.json's torch_dtype"
    if name is None:
        embed = headers.get("model.embed_tokens.weight", {})
        name = _SAFETENSORS_DTYPES.get(embed.get("dtype"), embed.get("dtype"))
        source = "its model.embed_tokens.weight"
    name = str(name).removeprefix("torch.")
    if name not in AUTO_DTYPES:
        raise CheckpointError(
            f'dtype="auto": checkpoint {path} has dtype {name!r} ({source}), not one of {AUTO_DTYPES}'
        )
    return jnp.dtype(name)


def _read_header(file: Path) -> tuple[dict, int]:
    """(safetensors header, where the data starts); CheckpointError naming a file that is not safetensors."""
    size = file.stat().st_size
    with open(file, "rb") as fh:
        head = fh.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        try:
            if not 2 <= n <= size - 8:
                raise ValueError(f"a header of {n} bytes in a file of {size}")
            header = json.loads(fh.read(n))
            entries = [v for k, v in header.items() if k != "__metadata__"] if isinstance(header, dict) else [None]
            if not all(isinstance(v, dict) and isinstance(v.get("shape"), list) for v in entries):
                raise ValueError("the header is not a table of tensors")
        except ValueError as e:  # (json's errors are ValueErrors)
            raise CheckpointError(f"{file} is not a safetensors file: {e}") from None
        return header, 8 + n


def _read_fp8(file: Path, name: str) -> np.ndarray:
    """safetensors' numpy reader has no float8 type: map the tensor's bytes and view them as e4m3."""
    header, start = _read_header(file)
    info = header[name]
    begin, end = info["data_offsets"]
    raw = np.memmap(file, dtype=np.uint8, mode="r", offset=start + begin, shape=(end - begin,))
    return np.asarray(raw).view(ml_dtypes.float8_e4m3fn).reshape(info["shape"])


def dequantize_fp8(w: np.ndarray, scale_inv: np.ndarray) -> np.ndarray:
    """DeepSeek fp8 e4m3 weight [out, in] with one scale per 128 x 128 block -> float32."""
    rows, cols = w.shape
    s = np.repeat(np.repeat(scale_inv.astype(np.float32), FP8_BLOCK, 0), FP8_BLOCK, 1)[:rows, :cols]
    return w.astype(np.float32) * s


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, callable, callable]]:
    """(name, load(), load_scale_inv() or None) for every tensor in the files, one at a time."""
    for file in files:
        with safe_open(str(file), "numpy") as f:
            names = set(f.keys())
            for name in sorted(names):
                if name.endswith(".weight_scale_inv"):
                    continue
                fp8 = f.get_slice(name).get_dtype() == "F8_E4M3"
                load = (lambda n=name, file=file: _read_fp8(file, n)) if fp8 else (lambda n=name, f=f: f.get_tensor(n))
                scale_name = name[: -len("weight")] + "weight_scale_inv"
                scale = (lambda n=scale_name, f=f: f.get_tensor(n)) if scale_name in names else None
                if fp8 and scale is None:
                    raise CheckpointError(f"fp8 tensor {name} has no {scale_name} beside it in {file.name}")
                yield name, load, scale
