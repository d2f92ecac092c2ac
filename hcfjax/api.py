"""load / save: a checkpoint directory in the HuggingFace layout <-> Model."""

from __future__ import annotations

import dataclasses
import json
import shutil
import warnings
from pathlib import Path

import jax.numpy as jnp
from tokenizers import Tokenizer

from hcfjax.checkpoint import (
    CheckpointError,
    check_counts,
    checkpoint_dtype,
    checkpoint_headers,
    load_params,
    mtp_present,
    params_shapes,
    save_params,
)
from hcfjax.config import ModelConfig, QuantConfig
from hcfjax.model import Model

# The embedded model: a small DeepSeek-V3-architecture model trained on the Python standard library, with one jointly
# trained MTP layer (train_mtp/pretrain.py made it; docs/results.md has its numbers).
DEFAULT_MODEL = str(Path(__file__).parent / "assets" / "stdlib-v3")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


FP8_MODES = ("native", "dequantize")


def load(
    path: str | Path | None = None,
    dtype=jnp.bfloat16,
    mtp: bool | None = None,
    plan=None,
    fp8: str = "native",
    scheme: str | None = None,
) -> Model:
    """Loads config.json, the safetensors weights (bf16/fp16/fp32, or fp8 e4m3 with block scales) and
    tokenizer.json (if present) from a checkpoint directory; no path loads the embedded DEFAULT_MODEL.

    dtype: the model's dtype (a jnp dtype or its name), or "auto" for the checkpoint's own (config.json's
    torch_dtype, else its stored embedding's).
    mtp: None loads the MTP layers where the checkpoint has them, and warns where config.json names MTP layers that
    the checkpoint lacks (transformers never saves them); True requires them; False skips them. The returned
    config counts only the MTP layers loaded.
    plan: a sharding plan (sharding.plans) to place the weights for: each device receives only its slices of each
    param, and each process reads only the tensors its own devices hold. None: the default device.
    fp8: for checkpoints whose config.json carries DeepSeek's fp8 `quantization_config` (V3, R1): "native" keeps
    the weights fp8 with their block scales and runs them as w8a8 fp8 linears and experts (hcfjax/fp8.py);
    "dequantize" turns them into `dtype` as they are read (the config then says no quantisation). fp8 tensors in a
    checkpoint without that block are always dequantised.

    scheme: quantise a float checkpoint's weights to this scheme as they are read (hcfjax.quantize: what
    quantize_model gives on the model loaded in `dtype`), so the devices hold only the quantised model; a checkpoint
    quantised to it already loads as it is (pass fp8="dequantize" to quantise an fp8 checkpoint to an int scheme).
    ValueError for another quantised one.

    Loading streams: the checkpoint is checked whole first (a bad one fails naming file and tensor, with nothing
    placed), then read tensor by tensor straight onto the devices, so host memory holds a few tensors, not the model.
    """
    path = Path(DEFAULT_MODEL if path is None else path)
    cfg, headers = read_config(path, mtp, fp8)
    if isinstance(dtype, str) and dtype == "auto":
        dtype = checkpoint_dtype(path, headers)
    # mtp=False also skips MTP tensors the checkpoint holds; otherwise any past the config's layers are unexpected.
    sharding = None if plan is None else plan.param_sharding
    quantize = _quantize_to(cfg, scheme)
    params = load_params(path, cfg, jnp.dtype(dtype), mtp is not False, sharding, headers, quantize)
    cfg = cfg if quantize is None else dataclasses.replace(cfg, quantization=quantize)
    tok_file = path / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tok_file)) if tok_file.is_file() else None
    return Model(cfg, params, tokenizer, str(path))


def _quantize_to(cfg: ModelConfig, scheme: str | None) -> QuantConfig | None:
    """The quantisation `load(scheme=...)` applies as it reads a checkpoint of `cfg`: None where it applies none
    (no scheme, or the checkpoint's own); ValueError for a checkpoint quantised to another scheme."""
    if scheme is None or (cfg.quantization is not None and cfg.quantization.scheme == scheme):
        return None
    if cfg.quantization is not None:
        raise ValueError(f"the checkpoint is quantised already ({cfg.quantization.scheme}), not to {scheme}")
    return QuantConfig.for_scheme(scheme)


def load_shapes(
    path: str | Path | None = None,
    dtype=jnp.bfloat16,
    mtp: bool | None = None,
    fp8: str = "native",
    scheme: str | None = None,
) -> Model:
    """The Model `load` returns, with its params as jax.ShapeDtypeStructs on no device: from config.json and the
    safetensors headers alone, checked as `load` checks them before it reads a tensor (no warning: `load` gives
    it), with `scheme` as load's (the quantised params' shapes). A server compiles its steps for these while `load`
    reads the weights."""
    path = Path(DEFAULT_MODEL if path is None else path)
    cfg, headers = read_config(path, mtp, fp8, warn=False)
    if (quantize := _quantize_to(cfg, scheme)) is not None:
        cfg = dataclasses.replace(cfg, quantization=quantize)
    if isinstance(dtype, str) and dtype == "auto":
        dtype = checkpoint_dtype(path, headers)
    tok_file = path / "tokenizer.json"
    tokenizer = Tokenizer.from_file(str(tok_file)) if tok_file.is_file() else None
    return Model(cfg, params_shapes(cfg, jnp.dtype(dtype), mtp is not False), tokenizer, str(path))


def read_config(
    path: Path, mtp: bool | None = None, fp8: str = "native", stacklevel: int = 3, warn: bool = True
) -> tuple[ModelConfig, dict]:
    """config.json's ModelConfig counting the MTP layers that `load(path, mtp=mtp)` loads, and saying no
    quantisation where `fp8="dequantize"` reads DeepSeek's fp8 weights as floats; and the checkpoint's tensor index
    (checkpoint_headers). Warns (at `stacklevel`; unless not `warn`) where config.json names MTP layers the
    checkpoint lacks and mtp is None."""
    if fp8 not in FP8_MODES:
        raise ValueError(f"fp8={fp8!r}: expected one of {FP8_MODES}")
    if not path.is_dir():
        raise FileNotFoundError(f"model path {str(path)!r} is not a directory")
    cfg = ModelConfig.from_json(path)
    if fp8 == "dequantize" and cfg.quantization is not None and cfg.quantization.fp8 is not None:
        cfg = dataclasses.replace(cfg, quantization=None)
    headers = checkpoint_headers(path)
    check_counts(cfg, headers, path)
    if cfg.num_mtp_layers and mtp is not False and not mtp_present(cfg, headers, path):
        if mtp:
            raise CheckpointError(
                f"checkpoint {path} has no MTP layer tensors (config.json says num_nextn_predict_layers="
                f"{cfg.num_mtp_layers}); mtp=True requires them"
            )
        if warn:
            warnings.warn(
                f"checkpoint {path} has no MTP layer tensors though config.json says num_nextn_predict_layers="
                f"{cfg.num_mtp_layers}: loading the main model alone (speculative decoding needs MTP layers)",
                stacklevel=stacklevel,
            )
        cfg = _without_mtp(cfg)
    return (_without_mtp(cfg) if mtp is False else cfg), headers


def write_config(cfg: ModelConfig, path: Path, dtype) -> None:
    """config.json for `cfg` with `dtype` as its torch_dtype."""
    d = cfg.to_dict()
    d["torch_dtype"] = str(jnp.dtype(dtype))
    (path / "config.json").write_text(json.dumps(d, indent=1))


def save(model: Model, path: str | Path, dtype=None) -> None:
    """Writes config.json, safetensors weights and the tokenizer files, loadable by `load` and by transformers."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    if "mtp" not in model.params and cfg.num_mtp_layers:
        cfg = _without_mtp(cfg)
    write_config(cfg, path, dtype or model.dtype)
    save_params(model.params, cfg, path, dtype=dtype)
    if model.tokenizer is not None:
        model.tokenizer.save(str(path / "tokenizer.json"))
    if model.path:
        for name in TOKENIZER_FILES[1:]:
            src = Path(model.path) / name
            if src.is_file() and src.resolve() != (path / name).resolve():
                shutil.copy(src, path / name)


def _without_mtp(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(cfg, num_mtp_layers=0)
