"""The one name table of a DeepSeek checkpoint: every tensor it may hold, as a `TensorSpec` made from the config by
`tensor_specs` (its checkpoint name, where it goes in the params pytree, its shape), the quantised schemes' parts
(`quantized_specs`), and the params pytree's paths.

Linear weights are [out, in] in checkpoints and [in, out] (reshaped per head where useful) in params, so einsums
read left to right; MLA's kv_b is held as W_UK and W_UV, each [H, C, N] (`_kv_b`). `TensorSpec.to_params` and
`to_checkpoint` convert between the two layouts. Layers of one kind are stacked along a leading axis per run of layers
(`ModelConfig.layer_segments`) so that the forward pass is a `lax.scan`.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from hcfjax import fp8
from hcfjax.config import ModelConfig, QuantConfig
from hcfjax.quant import QWeight, group_size


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str  # checkpoint name
    path: tuple  # params pytree path
    index: tuple[int, ...]  # position inside the stacked param (layer in segment, expert)
    shape: tuple[int, ...]  # checkpoint shape
    pshape: tuple[int, ...]  # params shape of this slice
    linear: bool  # [out, in] in the checkpoint, [in, out] (then reshaped to pshape) in params; kv_b: see halves
    fp32: bool = False  # kept in float32 whatever the model dtype (router)
    dtype: str | None = None  # stored and loaded in exactly this dtype (the parts of a quantised weight)
    quant: tuple[int, str] | None = None  # (bits, activations) on the `q` part of a quantised weight
    halves: tuple[int, int] | None = None  # MLA's kv_b: (N, V); see _kv_b

    def to_params(self, t):
        """This tensor as the checkpoint holds it (numpy) -> its slice of the param."""
        if self.halves:
            (n, v), (_, h, c, m) = self.halves, self.pshape
            t = t.reshape(h, n + v, c)
            pad = lambda w: np.pad(w, ((0, 0), (0, m - w.shape[1]), (0, 0)))  # noqa: E731
            return np.stack([pad(t[:, :n]), pad(t[:, n:])]).transpose(0, 1, 3, 2)
        return (t.T if self.linear else t).reshape(self.pshape)

    def to_checkpoint(self, t):
        """to_params' inverse: the param's slice -> the tensor as the checkpoint holds it."""
        if self.halves:
            n, v = self.halves
            return np.concatenate([t[0, ..., :n], t[1, ..., :v]], axis=-1).transpose(0, 2, 1).reshape(self.shape)
        return t.reshape(self.pshape[0], -1).T if self.linear else t


def _kv_b(name, path, index, cfg: ModelConfig) -> TensorSpec:
    """kv_b_proj [H * (N + V), C] as [2, H, C, M] per layer: W_UK [H, C, N] then W_UV [H, C, V], each whole, so
    the absorbed decode reads them where they lie (a slice of [C, H, N + V] would be copied at every layer).
    M = max(N, V); the shorter is zero-padded (every DeepSeek model has N = V)."""
    h, c, n, v = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.v_head_dim
    return TensorSpec(name, path, index, (h * (n + v), c), (2, h, c, max(n, v)), True, halves=(n, v))


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
        _kv_b(p + "self_attn.kv_b_proj.weight", a + ("kv_b",), index, cfg),
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
# projections, the MTP combiner. MLA's per-head q_b (or q) and o are quantised by QuantConfig.heads, held as one
# linear over the heads ([in, H*K] and [H*V, D]); kv_b (folded into the absorbed decode's query and output),
# embeddings, LM heads, routers and norms stay unquantised.
QUANTIZABLE = ("gate", "up", "down", "q_a", "kv_a", "eh_proj")
HEADS = ("q_b", "q", "o")
_SCHEME_BITS = {"w4a16": (4, "bf16"), "w4a8": (4, "int8"), "w8a8": (8, "int8")}


def quantized_specs(specs: list[TensorSpec], q: QuantConfig) -> list[TensorSpec]:
    """The name table of a quantised checkpoint: each quantised linear `X.weight` [N, K] becomes `X.weight` (int4
    packed uint8 [N, K/2] or int8 [N, K]) and `X.weight_scale` (f32 [N, K/G]; [K/G, N] in params), at params paths
    (..., 'q') and (..., 'scale') of one QWeight (hcfjax/quant.py documents the layout)."""
    if q.fp8 is not None:
        return fp8.checkpoint_specs(specs)
    out = []
    for s in specs:
        scheme = q.experts if "experts" in s.path else q.heads if s.path[-1] in HEADS else q.linear
        if not (s.linear and s.path[-1] in QUANTIZABLE + HEADS and scheme):
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


def scale_part(quant: tuple[int, str]) -> str:
    """The field of a quantised weight that holds its scales: an Fp8Weight's `scale_inv`, a QWeight's `scale`."""
    return "scale_inv" if quant == fp8.QUANT else "scale"


def quantized_weight(flat: dict[tuple, object], w: tuple, quant: tuple[int, str], cfg: ModelConfig):
    """Quantised weight `w`'s parts, popped from the {path: leaf} `flat`, as its pytree type (quant says which)."""
    q, scale = flat.pop(w + ("q",)), flat.pop(w + (scale_part(quant),))
    if quant == fp8.QUANT:
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
