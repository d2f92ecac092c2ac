"""`hcfjax quantize`: a bf16/fp8 checkpoint -> a quantised one (w4a16, w4a8, w4a8c8, w8a8).

What each scheme does (config.QUANT_SCHEMES; checkpoint.QUANTIZABLE names the linears):
  w4a16   routed experts int4 (group 128 along K, symmetric), bf16 activations; everything else as it was.
  w4a8    routed experts int4, per-token dynamic int8 activations; everything else as it was.
  w4a8c8  w4a8 experts; the other `x @ W` linears (dense and shared-expert MLPs, MLA's q_a/kv_a down projections,
          the MTP combiner) int8 per output channel with int8 activations; the int8 latent KV cache
          (`quantization_config.kv_cache_dtype`, see `default_cache_dtype`).
  w8a8    every `x @ W` linear, experts included, int8 per output channel with int8 activations.
Kept in the model dtype by every scheme: embeddings, LM heads, routers, norms, and MLA's per-head q_b/kv_b/o (einsums
in attention.py; its absorbed decode folds kv_b into the query and the output).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from hcfjax.checkpoint import (
    SHARD_BYTES,
    get_path,
    ignored_tensor,
    match_sources,
    quantized_specs,
    read_weight,
    tensor_specs,
)
from hcfjax.config import ModelConfig, QuantConfig
from hcfjax.model import Model
from hcfjax.quant import quantize
from hcfjax.safetensors_files import Planned, write_shards


def quantize_model(model: Model, scheme: str, group_size: int = 128) -> Model:
    """The model with its weights quantised per `scheme`; its config carries the `quantization_config`."""
    if model.cfg.quantization is not None:
        raise ValueError(f"the model is already quantised ({model.cfg.quantization.scheme})")
    qcfg = QuantConfig.for_scheme(scheme, group_size)
    has_mtp = "mtp" in model.params and len(model.params["mtp"]) > 0
    specs = quantized_specs(tensor_specs(model.cfg, mtp=has_mtp), qcfg)
    params = _copy_tree(model.params)
    done = set()
    for s in specs:
        if s.quant and s.path not in done:
            done.add(s.path)
            w = s.path[:-1]
            bits, act = s.quant
            get_path(params, w[:-1])[w[-1]] = quantize(get_path(model.params, w), bits, act, group_size)
    return dataclasses.replace(model, cfg=dataclasses.replace(model.cfg, quantization=qcfg), params=params)


def _copy_tree(tree):
    if isinstance(tree, dict):
        return {k: _copy_tree(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_copy_tree(v) for v in tree]
    return tree


CACHE_DTYPES = ("auto", "float", "int8")


def cache_dtype_for(model: Model, name: str):
    """The KV cache dtype a config's cache_dtype names: auto (the checkpoint's scheme's: int8 for w4a8c8, else the
    model's dtype), float (the model's dtype, whatever the scheme) or int8."""
    if name not in CACHE_DTYPES:
        raise ValueError(f"cache_dtype must be one of {CACHE_DTYPES}, got {name!r}")
    return default_cache_dtype(model, {"auto": None, "float": model.dtype, "int8": jnp.int8}[name])


def default_cache_dtype(model: Model, requested=None):
    """The KV cache dtype to run `model` with: `requested` if given, int8 when the checkpoint's quantisation scheme
    says so (w4a8c8), else the model's dtype."""
    if requested is not None:
        return requested
    q = model.cfg.quantization
    return jnp.int8 if q is not None and q.kv_cache_dtype == "int8" else model.dtype


def quantize_checkpoint(
    src: str | Path | None, out: str | Path, scheme: str, group_size: int = 128, shard_bytes: int = SHARD_BYTES
) -> ModelConfig:
    """Writes `src` (a checkpoint directory, bf16/f32 or fp8 block-scaled; None: the embedded model) quantised per
    `scheme` to `out`, with `quantization_config` in its config.json, which `hcfjax.load` reads back. -> its config.

    Streams: the source is checked whole first (as `load` checks it), then each output tensor is read (fp8
    dequantised), cast to bf16, quantised where the scheme says, and written into shards of up to `shard_bytes` at
    once, so host memory holds a few tensors, never the model. The values are those of `quantize_model` on the
    model loaded in bf16, saved with `save`."""
    from hcfjax.api import DEFAULT_MODEL, TOKENIZER_FILES, read_config, write_config

    src, out = Path(DEFAULT_MODEL if src is None else src), Path(out)
    cfg, index = read_config(src)
    if cfg.quantization is not None:
        raise ValueError(f"the model is already quantised ({cfg.quantization.scheme})")
    qcfg = QuantConfig.for_scheme(scheme, group_size)
    specs = tensor_specs(cfg)
    sources = match_sources(src, index, specs, lambda n: ignored_tensor(cfg, n))
    bf16 = np.dtype(jnp.bfloat16)
    qspecs = {s.name: s for s in quantized_specs(specs, qcfg)}
    planned = [
        Planned(s.name, np.dtype(s.dtype) if s.dtype else np.dtype(np.float32) if s.fp32 else bf16, s.shape)
        for s in qspecs.values()
    ]
    scales = {}  # a quantised weight's scales, written right after its values (quantized_specs' order)

    def values(t: Planned) -> np.ndarray:
        s = qspecs[t.name]
        if s.quant:
            w = read_weight(sources[s.name]).T.astype(bf16)  # [K, N], as `load` makes it
            qw = quantize(jnp.asarray(w), *s.quant, group_size)
            scales[s.path[:-1] + ("scale",)] = qw.scale
            return np.asarray(qw.q)
        if s.path in scales:
            return np.asarray(scales.pop(s.path)).T  # [K/G, N] -> the checkpoint's [N, K/G]
        return read_weight(sources[s.name]).astype(t.dtype)

    out.mkdir(parents=True, exist_ok=True)
    write_shards(out, planned, values, shard_bytes)
    qcfg = dataclasses.replace(cfg, quantization=qcfg)
    write_config(qcfg, out, jnp.bfloat16)
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and (src / name).resolve() != (out / name).resolve():
            shutil.copy(src / name, out / name)
    return qcfg
