"""`hcfjax quantize`: a bf16/fp8 checkpoint -> a quantised one (w4a16, w4a8, w4a8c8, w8a8, fp8).

What each scheme does (config.QUANT_SCHEMES; tensor_specs.QUANTIZABLE and HEADS name the linears):
  w4a16   routed experts int4 (group 128 along K, symmetric), bf16 activations; everything else as it was.
  w4a8    routed experts int4, per-token dynamic int8 activations; everything else as it was.
  w4a8c8  w4a8 experts; the other linears (dense and shared-expert MLPs, MLA's q_a/kv_a down projections, its
          per-head q_b (or q) and o as one linear over the heads each, the MTP combiner) int8 per output channel
          with int8 activations; the int8 latent KV cache (`quantization_config.kv_cache_dtype`, see
          `default_cache_dtype`).
  w8a8    every linear of w4a8c8's, experts included, int8 per output channel with int8 activations.
  fp8     DeepSeek-V3's own format (hcfjax/fp8.py, LINEARS): MLA's projections but kv_b, and every
          MLP, experts included, e4m3 with one scale per 128 x 128 block; e4m3 activations per token and 128
          channels. The checkpoint is DeepSeek's layout (`weight_scale_inv`, quant_method "fp8").
Kept in the model dtype by every scheme: embeddings, LM heads, routers, norms, and MLA's per-head kv_b (its absorbed
decode folds kv_b into the query and the output); by w4a16 and w4a8 all but the experts, and by fp8 the MTP
combiner (bf16 in DeepSeek's checkpoints). Checkpoints written before q_b / q / o were quantised by the int schemes
(no `quantization_config.heads`) load with them in the model dtype, as written.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from hcfjax import fp8
from hcfjax.checkpoint import SHARD_BYTES, QuantizedReads, ignored_tensor, match_sources, read_weight
from hcfjax.config import ModelConfig, QuantConfig
from hcfjax.model import Model
from hcfjax.quant import QWeight, quantize_as
from hcfjax.safetensors_files import Planned, write_shards
from hcfjax.tensor_specs import get_path, quantized_specs, tensor_specs


def quantize_model(model: Model, scheme: str, group_size: int = 128) -> Model:
    """The model with its weights quantised per `scheme`; its config carries the `quantization_config`. Weights
    that are quantised already (made so by `slice_quantizer`) are kept."""
    if model.cfg.quantization is not None:
        raise ValueError(f"the model is already quantised ({model.cfg.quantization.scheme})")
    qcfg = QuantConfig.for_scheme(scheme, group_size)
    has_mtp = "mtp" in model.params and len(model.params["mtp"]) > 0
    params = _copy_tree(model.params)
    for w, s in _quantized_weights(model.cfg, qcfg, has_mtp).items():
        weight = get_path(model.params, w)
        if not isinstance(weight, (QWeight, fp8.Fp8Weight)):
            get_path(params, w[:-1])[w[-1]] = _quantize_weight(weight, s, group_size, len(s.index))
    return dataclasses.replace(model, cfg=dataclasses.replace(model.cfg, quantization=qcfg), params=params)


def slice_quantizer(cfg: ModelConfig, scheme: str, group_size: int = 128):
    """each(path, x) for `model.init_params`: a slice of a stacked weight (or a whole unstacked one) quantised as
    `quantize_model` would quantise it in the stack, anything else as it is."""
    weights = _quantized_weights(cfg, QuantConfig.for_scheme(scheme, group_size), mtp=True)

    def each(path, x):
        s = weights.get(path)
        if s is None:
            return x
        return _quantize_weight(x, s, group_size, max(len(s.index) - 1, 0))  # init_params slices stacked ones

    return each


def _quantized_weights(cfg: ModelConfig, qcfg: QuantConfig, mtp: bool) -> dict:
    """params path of each weight the scheme quantises -> the TensorSpec of its quantised part."""
    specs = quantized_specs(tensor_specs(cfg, mtp=mtp), qcfg)
    return {s.path[:-1]: s for s in specs if s.quant}


def _quantize_weight(w, spec, group_size: int, lead: int):
    """The weight w [..., K, N...] (the params' shape, per-head outputs split, after `lead` stacking dims) quantised
    as spec.quant says: as one [K, N] linear (a per-head weight's heads flattened)."""
    return _quantize_slices(w.reshape(*w.shape[: lead + 1], -1), spec.quant, group_size)


def _quantize_slices(w, how, group_size: int):
    """w [..., K, N] quantised one leading slice at a time (a layer's experts), each slice by one compiled program:
    the float temporaries (an f32 copy and its blocks) are one slice's, not the stack's, which for a layer stack of
    experts would not fit beside the model on a GPU. A stack of single weights ([L, K, N]) goes whole: its
    temporaries are a few layers' dense weights."""
    if w.ndim <= 3:
        return quantize_as(w, how, group_size)
    parts = [quantize_as(w[i], how, group_size) for i in range(w.shape[0])]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *parts)


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
    model loaded in bf16, saved with `save`. A DeepSeek fp8 checkpoint (its fp8 `quantization_config`) is read
    dequantised for the int schemes; for the fp8 scheme its fp8 weights and scales are copied as they are (what
    `save` writes for it loaded natively)."""
    from hcfjax.api import DEFAULT_MODEL, TOKENIZER_FILES, read_config, write_config

    src, out = Path(DEFAULT_MODEL if src is None else src), Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{str(out)!r} is a file, not a directory to write the checkpoint to")
    if out.exists() and src.exists() and out.resolve() == src.resolve():
        raise ValueError(f"{str(out)!r} is the source checkpoint's directory: writing there would destroy it")
    cfg, index = read_config(src, fp8="native" if scheme == "fp8" else "dequantize")
    copy = cfg.quantization is not None and cfg.quantization.scheme == scheme == "fp8"
    if cfg.quantization is not None and not copy:
        raise ValueError(f"the model is already quantised ({cfg.quantization.scheme})")
    qcfg = cfg.quantization if copy else QuantConfig.for_scheme(scheme, group_size)
    specs = tensor_specs(cfg)  # as stored: an fp8 checkpoint's fp8 parts when it is copied
    sources = match_sources(src, index, specs, lambda n: ignored_tensor(cfg, n))
    bf16 = np.dtype(jnp.bfloat16)
    qspecs = {s.name: s for s in (specs if copy else quantized_specs(specs, qcfg))}
    planned = [
        Planned(s.name, np.dtype(s.dtype) if s.dtype else np.dtype(np.float32) if s.fp32 else bf16, s.shape)
        for s in qspecs.values()
    ]
    # made from the float tensors read as bf16, as `load` makes them; quantized_specs' order puts each scale right
    # after its values
    reads = None if copy else QuantizedReads(list(qspecs.values()), sources, bf16, group_size, lambda source: None)

    def values(t: Planned) -> np.ndarray:
        s = qspecs[t.name]
        if reads is not None and s.path in reads.parts:
            part = reads.part(s)  # QWeight scales [K/G, N] -> the checkpoint's [N, K/G]; an Fp8Weight's as they are
            return part.T if s.linear else part
        return read_weight(sources[s.name]).astype(t.dtype)

    out.mkdir(parents=True, exist_ok=True)
    write_shards(out, planned, values, shard_bytes)
    qcfg = dataclasses.replace(cfg, quantization=qcfg)
    write_config(qcfg, out, jnp.bfloat16)
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and (src / name).resolve() != (out / name).resolve():
            shutil.copy(src / name, out / name)
    return qcfg
