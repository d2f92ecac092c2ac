"""Checkpoints in the HuggingFace / DeepSeek layout: the one name table, `load_params` and `save_params`.

Every tensor a checkpoint may hold is described by a `TensorSpec` made from the config by `tensor_specs`: its
checkpoint name, where it goes in the params pytree, and its shape. Linear weights are [out, in] in checkpoints and
[in, out] (reshaped per head where useful) in params, so einsums read left to right.  Layers of one kind are stacked
along a leading axis per run of layers (`ModelConfig.layer_segments`) so that the forward pass is a `lax.scan`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from hcfjax import fp8
from hcfjax.config import ModelConfig, QuantConfig
from hcfjax.quant import QWeight, group_size

FP8_BLOCK = fp8.BLOCK  # DeepSeek's fp8 checkpoints: one weight_scale_inv per 128 x 128 block


class CheckpointError(ValueError):
    """A checkpoint that does not match its config: missing, unexpected or misshapen tensors, named."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str  # checkpoint name
    path: tuple  # params pytree path
    index: tuple[int, ...]  # position inside the stacked param (layer in segment, expert)
    shape: tuple[int, ...]  # checkpoint shape
    pshape: tuple[int, ...]  # params shape of this slice
    linear: bool  # [out, in] in the checkpoint, [in, out] (then reshaped to pshape) in params
    fp32: bool = False  # kept in float32 whatever the model dtype (router)
    dtype: str | None = None  # stored and loaded in exactly this dtype (the parts of a quantised weight)
    quant: tuple[int, str] | None = None  # (bits, activations) on the `q` part of a quantised weight


def _linear(name, path, index, d_in, pshape_out) -> TensorSpec:
    d_out = math.prod(pshape_out)
    return TensorSpec(name, path, index, (d_out, d_in), (d_in, *pshape_out), True)


def _vector(name, path, index, n, fp32=False) -> TensorSpec:
    return TensorSpec(name, path, index, (n,), (n,), False, fp32)


def _mlp_specs(prefix, path, index, d, f) -> list[TensorSpec]:
    return [
        _linear(f"{prefix}gate_proj.weight", path + ("gate",), index, d, (f,)),
        _linear(f"{prefix}up_proj.weight", path + ("up",), index, d, (f,)),
        _linear(f"{prefix}down_proj.weight", path + ("down",), index, f, (d,)),
    ]


def layer_specs(cfg: ModelConfig, layer: int, path: tuple, index: tuple[int, ...]) -> list[TensorSpec]:
    """Specs of decoder layer `layer` (main or MTP) placed at params[path][index]."""
    p = f"model.layers.{layer}."
    d, h = cfg.hidden_size, cfg.num_attention_heads
    a = path + ("attn",)
    specs = [
        _vector(p + "input_layernorm.weight", path + ("attn_norm",), index, d),
        _vector(p + "post_attention_layernorm.weight", path + ("mlp_norm",), index, d),
        _linear(p + "self_attn.kv_a_proj_with_mqa.weight", a + ("kv_a",), index, d, (cfg.kv_dim,)),
        _vector(p + "self_attn.kv_a_layernorm.weight", a + ("kv_a_norm",), index, cfg.kv_lora_rank),
        _linear(
            p + "self_attn.kv_b_proj.weight",
            a + ("kv_b",),
            index,
            cfg.kv_lora_rank,
            (h, cfg.qk_nope_head_dim + cfg.v_head_dim),
        ),
        _linear(p + "self_attn.o_proj.weight", a + ("o",), index, h * cfg.v_head_dim, (d,)),
    ]
    if cfg.q_lora_rank:
        specs += [
            _linear(p + "self_attn.q_a_proj.weight", a + ("q_a",), index, d, (cfg.q_lora_rank,)),
            _vector(p + "self_attn.q_a_layernorm.weight", a + ("q_a_norm",), index, cfg.q_lora_rank),
            _linear(p + "self_attn.q_b_proj.weight", a + ("q_b",), index, cfg.q_lora_rank, (h, cfg.qk_head_dim)),
        ]
    else:
        specs.append(_linear(p + "self_attn.q_proj.weight", a + ("q",), index, d, (h, cfg.qk_head_dim)))
    m = path + ("mlp",)
    if not cfg.is_moe_layer(layer):
        return specs + _mlp_specs(p + "mlp.", m, index, d, cfg.intermediate_size)
    e = cfg.n_routed_experts
    specs.append(TensorSpec(p + "mlp.gate.weight", m + ("router",), index, (e, d), (d, e), True, fp32=True))
    if cfg.topk_method == "noaux_tc":
        specs.append(_vector(p + "mlp.gate.e_score_correction_bias", m + ("router_bias",), index, e, fp32=True))
    for j in range(e):
        specs += _mlp_specs(f"{p}mlp.experts.{j}.", m + ("experts",), index + (j,), d, cfg.moe_intermediate_size)
    if cfg.n_shared_experts:
        specs += _mlp_specs(
            p + "mlp.shared_experts.", m + ("shared",), index, d, cfg.moe_intermediate_size * cfg.n_shared_experts
        )
    return specs


def tensor_specs(cfg: ModelConfig, mtp: bool = True) -> list[TensorSpec]:
    """Every tensor of a checkpoint for `cfg` (MTP layers included when `mtp`)."""
    d, v = cfg.hidden_size, cfg.vocab_size
    specs = [
        TensorSpec("model.embed_tokens.weight", ("embed",), (), (v, d), (v, d), False),
        _vector("model.norm.weight", ("norm",), (), d),
    ]
    if not cfg.tie_word_embeddings:
        specs.append(_linear("lm_head.weight", ("lm_head",), (), d, (v,)))
    for s, (first, count, _) in enumerate(cfg.layer_segments):
        for i in range(count):
            specs += layer_specs(cfg, first + i, ("segments", s), (i,))
    if mtp:
        for k in range(cfg.num_mtp_layers):
            layer = cfg.num_hidden_layers + k
            p, path = f"model.layers.{layer}.", ("mtp", k)
            specs += layer_specs(cfg, layer, path + ("layer",), ())
            specs += [
                _vector(p + "enorm.weight", path + ("enorm",), (), d),
                _vector(p + "hnorm.weight", path + ("hnorm",), (), d),
                _linear(p + "eh_proj.weight", path + ("eh_proj",), (), 2 * d, (d,)),
                _vector(p + "shared_head.norm.weight", path + ("head_norm",), (), d),
                _linear(p + "shared_head.head.weight", path + ("head",), (), d, (v,)),
            ]
    return quantized_specs(specs, cfg.quantization) if cfg.quantization else specs


# Linears the model runs as `x @ W` (so a QWeight can stand in): MLPs (dense, shared, routed experts), MLA's down
# projections, the MTP combiner. MLA's per-head q_b/q/kv_b/o run as einsums in attention.py and stay unquantised, as
# do embeddings, LM heads, routers and norms.
QUANTIZABLE = ("gate", "up", "down", "q_a", "kv_a", "eh_proj")
_SCHEME_BITS = {"w4a16": (4, "bf16"), "w4a8": (4, "int8"), "w8a8": (8, "int8")}


def quantized_specs(specs: list[TensorSpec], q: QuantConfig) -> list[TensorSpec]:
    """The name table of a quantised checkpoint: each quantised linear `X.weight` [N, K] becomes `X.weight` (int4
    packed uint8 [N, K/2] or int8 [N, K]) and `X.weight_scale` (f32 [N, K/G]; [K/G, N] in params), at params paths
    (..., 'q') and (..., 'scale') of one QWeight (hcfjax/quant.py documents the layout)."""
    if q.fp8 is not None:
        return fp8_specs(specs)
    out = []
    for s in specs:
        scheme = q.experts if "experts" in s.path else q.linear
        if not (s.linear and s.path[-1] in QUANTIZABLE and scheme):
            out.append(s)
            continue
        bits, act = _SCHEME_BITS[scheme]
        n, k = s.shape
        qshape = (n, k // 2 if bits == 4 else k)
        sshape = (n, k // group_size(k, bits, q.group_size))
        scale_name = s.name[: -len("weight")] + "weight_scale"
        out.append(
            TensorSpec(s.name, s.path + ("q",), s.index, qshape, qshape, False, dtype=_QDTYPE[bits], quant=(bits, act))
        )
        # Scales [N, K/G] on disk (output-major, like the weight), [K/G, N] in the QWeight: a "linear" part.
        out.append(TensorSpec(scale_name, s.path + ("scale",), s.index, sshape, sshape[::-1], True, dtype="float32"))
    return out


_QDTYPE = {4: "uint8", 8: "int8"}

# The linears DeepSeek ships in fp8 that stay fp8 on the device: MLA's projections and every MLP (dense, shared,
# routed experts). kv_b is fp8 on disk too but is dequantised on load: attention.py slices it per head into the
# absorbed query and output (DeepSeek's own inference code dequantises it there). Embeddings, norms, routers, LM
# heads and the MTP combiner are bf16 in DeepSeek's checkpoints.
FP8_LINEARS = ("q_a", "q_b", "q", "kv_a", "o", "gate", "up", "down")
FP8_QUANT = (8, "fp8")  # TensorSpec.quant of an Fp8Weight's `q`


def fp8_specs(specs: list[TensorSpec]) -> list[TensorSpec]:
    """The name table of a DeepSeek fp8 checkpoint loaded as fp8: each FP8_LINEARS `X.weight` [N, K] is e4m3 and
    `X.weight_scale_inv` f32 [N/128, K/128], both kept as stored at params paths (..., 'q') and (..., 'scale') of
    one Fp8Weight (hcfjax/fp8.py)."""
    out = []
    for s in specs:
        if not (s.linear and s.path[-1] in FP8_LINEARS):
            out.append(s)
            continue
        n, k = s.shape
        sshape = fp8.scale_shape(n, k)
        out.append(
            TensorSpec(s.name, s.path + ("q",), s.index, s.shape, s.shape, False, False, "float8_e4m3fn", FP8_QUANT)
        )
        out.append(
            TensorSpec(f"{s.name}_scale_inv", s.path + ("scale",), s.index, sshape, sshape, False, dtype="float32")
        )
    return out


def quantized_weight(q, scale, quant: tuple[int, str], cfg: ModelConfig):
    """The pytree type of a quantised weight's parts (spec.quant says which)."""
    if quant == FP8_QUANT:
        return fp8.Fp8Weight(q, scale, cfg.quantization.fp8.scale_fmt)
    return QWeight(q, scale, *quant)


def stacked_shapes(specs: list[TensorSpec]) -> dict[tuple, tuple[tuple[int, ...], bool]]:
    """params path -> (full stacked shape, fp32): the leading dims are one past the largest index seen."""
    lead: dict[tuple, tuple[int, ...]] = {}
    slice_info: dict[tuple, tuple[tuple[int, ...], bool]] = {}
    for s in specs:
        cur = lead.get(s.path, (0,) * len(s.index))
        lead[s.path] = tuple(max(a, i + 1) for a, i in zip(cur, s.index, strict=True))
        slice_info[s.path] = (s.pshape, s.fp32)
    return {p: (lead[p] + slice_info[p][0], slice_info[p][1]) for p in lead}


def set_path(tree: dict, path: tuple, value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def get_path(tree, path: tuple):
    for key in path:
        tree = getattr(tree, key) if isinstance(tree, (QWeight, fp8.Fp8Weight)) else tree[key]
    return tree


def to_pytree(flat: dict[tuple, object]) -> dict:
    """{path: leaf} -> nested dicts, with integer-keyed levels ('segments', 'mtp') turned into lists."""
    tree: dict = {}
    for path, leaf in flat.items():
        set_path(tree, path, leaf)

    def listify(node):
        if isinstance(node, dict):
            node = {k: listify(v) for k, v in node.items()}
            if node and all(isinstance(k, int) for k in node):
                return [node[i] for i in range(len(node))]
        return node

    return listify(tree)


# ---- reading ---------------------------------------------------------------------------------------------------


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    missing = [f for f in files if not f.is_file()]
    if missing or not files:
        raise CheckpointError(
            f"no safetensors weights at {path}" + (f" (missing {missing[0].name})" if missing else "")
        )
    return files


def checkpoint_headers(path: Path) -> dict[str, dict]:
    """name -> safetensors header entry (dtype, shape) of every tensor in the checkpoint, read from file headers."""
    out = {}
    for file in checkpoint_files(path):
        header, _ = _read_header(file)
        out.update({k: v for k, v in header.items() if k != "__metadata__"})
    return out


def mtp_names(cfg: ModelConfig) -> list[str]:
    """Checkpoint names of the MTP layers' tensors, in name-table order."""
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
    with open(file, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return json.loads(fh.read(n)), 8 + n


def _read_fp8(file: Path, name: str) -> np.ndarray:
    """safetensors' numpy reader has no float8 type: map the tensor's bytes and view them as e4m3."""
    header, start = _read_header(file)
    info = header[name]
    begin, end = info["data_offsets"]
    raw = np.memmap(file, dtype=np.uint8, mode="r", offset=start + begin, shape=(end - begin,))
    return np.asarray(raw).view(ml_dtypes.float8_e4m3fn).reshape(info["shape"])


def fp8_parts(spec: TensorSpec, t: np.ndarray, load_scale, by_name: dict[str, TensorSpec]) -> list:
    """(spec, array) pairs that checkpoint tensor `t` of `spec` fills: itself; an fp8 weight (load_scale reads its
    weight_scale_inv) dequantised where its spec is a float linear, or kept with its scale where its spec is an
    Fp8Weight's `q`. The scale's shape is checked either way."""
    keep = spec.quant == FP8_QUANT
    if load_scale is None:
        if keep:
            raise CheckpointError(
                f"tensor {spec.name!r} is stored as {t.dtype} without a weight_scale_inv, but config.json's "
                f"quantization_config says fp8 (hcfjax.load(..., fp8='dequantize') loads it as it is)"
            )
        return [(spec, t)]
    scale = load_scale()
    scale_name = spec.name + "_scale_inv"
    want = fp8.scale_shape(*t.shape)
    if tuple(scale.shape) != want:
        raise CheckpointError(
            f"tensor {scale_name!r} has shape {tuple(scale.shape)}, expected {want}: one scale per "
            f"{FP8_BLOCK} x {FP8_BLOCK} block of {spec.name!r} {tuple(t.shape)}"
        )
    if keep:
        return [(spec, t), (by_name[scale_name], scale)]
    return [(spec, dequantize_fp8(t, scale))]


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


# Tensors that real checkpoints carry but this project derives or shares.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _ignored(cfg: ModelConfig, name: str) -> bool:
    if name.endswith(_IGNORED_SUFFIXES):
        return True
    # DeepSeek-V3 ships a copy of the embedding inside each MTP layer; the model shares the main one.
    if name.startswith("model.layers.") and name.endswith(".embed_tokens.weight"):
        return int(name.split(".")[2]) >= cfg.num_hidden_layers
    return False


def load_params(path: str | Path, cfg: ModelConfig, dtype=jnp.bfloat16, mtp: bool = True) -> dict:
    """Reads a checkpoint tensor by tensor into the params pytree (device arrays of `dtype`; router in f32).

    fp8 e4m3 weights with `weight_scale_inv` stay fp8 where the config's quantization_config is DeepSeek's fp8 block
    (fp8_specs), and are dequantised as they are read otherwise. Host memory holds one copy of the
    weights (the stacked buffers) plus the tensor being read.
    """
    path = Path(path)
    specs = tensor_specs(cfg, mtp=mtp)
    by_name = {s.name: s for s in specs}
    np_dtype = np.dtype(jnp.dtype(dtype))
    fixed = {s.path: np.dtype(s.dtype) for s in specs if s.dtype}
    buffers = {
        p: np.empty(shape, fixed.get(p, np.float32 if fp32 else np_dtype))
        for p, (shape, fp32) in stacked_shapes(specs).items()
    }
    seen: set[str] = set()
    for name, load, load_scale in iter_tensors(checkpoint_files(path)):
        spec = by_name.get(name)
        if spec is None:
            if _ignored(cfg, name) or (not mtp and _is_mtp_name(cfg, name)):
                continue
            raise CheckpointError(f"unexpected tensor {name!r} in {path} (not in the name table for this config)")
        t = load()
        if tuple(t.shape) != spec.shape:
            raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)}, config expects {spec.shape}")
        for part, value in fp8_parts(spec, t, load_scale, by_name):
            value = value.T.reshape(part.pshape) if part.linear else value
            buffers[part.path][part.index] = value.astype(buffers[part.path].dtype)
            seen.add(part.name)
    missing = [s.name for s in specs if s.name not in seen]
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint {path} lacks tensor {missing[0]!r}{more}")
    params = {}
    for p in list(buffers):
        params[p] = jnp.asarray(buffers.pop(p))
    for s in specs:
        if s.quant and s.path in params:
            w = s.path[:-1]
            params[w] = quantized_weight(params.pop(s.path), params.pop(w + ("scale",)), s.quant, cfg)
    return to_pytree(params)


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
        t = t.reshape(s.pshape[0], -1).T if s.linear else t
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
