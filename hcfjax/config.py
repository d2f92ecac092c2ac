"""Model configuration: a frozen dataclass read from a checkpoint's config.json (DeepSeek-V3/R1, V2, V2-Lite)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

SCORING = ("sigmoid", "softmax")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
ROPE_TYPES = ("default", "yarn")
MODEL_TYPES = ("deepseek_v3", "deepseek_v2")
# Quantisation schemes: (routed experts, other `x @ W` linears, KV cache). Experts are int4 with group-wise scales
# (w4a16: bf16 activations, w4a8: per-token int8 activations) or int8 per channel (w8a8); "w8a8" linears are int8 per
# channel with int8 activations; None keeps them in the model dtype. "fp8" is DeepSeek's own format: e4m3 weights
# with 128 x 128 block scales and e4m3 activations per token and 128 channels (hcfjax/fp8.py). hcfjax/quantize.py
# says which linears these are.
QUANT_SCHEMES = {
    "w4a16": ("w4a16", None, None),
    "w4a8": ("w4a8", None, None),
    "w4a8c8": ("w4a8", "w8a8", "int8"),
    "w8a8": ("w8a8", "w8a8", None),
    "fp8": ("fp8", "fp8", None),
}


class ConfigError(ValueError):
    """A config.json value this project cannot run, named in the message."""


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    # DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ...; False rotates halves (x_i, x_{i + R/2}).
    interleave: bool = True

    @property
    def attention_factor(self) -> float:
        """Scale on cos/sin (YaRN): mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
        if self.type != "yarn":
            return 1.0
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclasses.dataclass(frozen=True)
class Fp8Format:
    """DeepSeek-V3/R1's `quantization_config` block (quant_method "fp8"): e4m3 weights with one f32
    `weight_scale_inv` per block of weight_block_size (out, in), activations quantised dynamically per token and
    `block[1]` channels. scale_fmt "ue8m0" (DeepSeek-V3.1) rounds activation scales up to powers of two."""

    fmt: str = "e4m3"
    activation_scheme: str = "dynamic"
    weight_block_size: tuple[int, int] = (128, 128)
    scale_fmt: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Fp8Format:
        f = cls(
            fmt=d.get("fmt", "e4m3"),
            activation_scheme=d.get("activation_scheme", "dynamic"),
            weight_block_size=tuple(d.get("weight_block_size") or (128, 128)),
            scale_fmt=d.get("scale_fmt"),
        )
        wants = {
            "fmt": ("e4m3",),
            "activation_scheme": ("dynamic",),
            "weight_block_size": ((128, 128),),
            "scale_fmt": (None, "ue8m0"),
        }
        for key, allowed in wants.items():
            if getattr(f, key) not in allowed:
                raise ConfigError(
                    f"quantization_config {key}={d.get(key)!r} is not supported for quant_method='fp8' "
                    f"(expected one of {[list(a) if isinstance(a, tuple) else a for a in allowed]})"
                )
        return f

    def to_dict(self) -> dict[str, Any]:
        d = {
            "quant_method": "fp8",
            "fmt": self.fmt,
            "activation_scheme": self.activation_scheme,
            "weight_block_size": list(self.weight_block_size),
        }
        return d if self.scale_fmt is None else {**d, "scale_fmt": self.scale_fmt}


QUANT_METHODS = ("fp8", "hcfjax")  # DeepSeek's block-scaled fp8, and what `hcfjax quantize` writes


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """config.json's `quantization_config`: DeepSeek's fp8 block (scheme "fp8", `fp8` says its format) or what
    `hcfjax quantize` writes."""

    scheme: str
    group_size: int = 128
    experts: str = "w4a16"  # w4a16 | w4a8 | w8a8 | fp8
    linear: str | None = None  # w8a8 | fp8 | None (kept in the model dtype)
    kv_cache_dtype: str | None = None  # "int8": the scheme was chosen with the int8 latent cache
    fp8: Fp8Format | None = None  # scheme "fp8": the format of the weights and activations

    @classmethod
    def for_scheme(cls, scheme: str, group_size: int = 128) -> QuantConfig:
        if scheme not in QUANT_SCHEMES:
            raise ConfigError(
                f"quantisation scheme {scheme!r} is not supported (expected one of {list(QUANT_SCHEMES)})"
            )
        experts, linear, kv = QUANT_SCHEMES[scheme]
        if scheme == "fp8":
            return cls(scheme, 128, experts, linear, kv, Fp8Format())
        return cls(scheme, group_size, experts, linear, kv)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QuantConfig:
        method = d.get("quant_method")
        if method == "fp8":
            return dataclasses.replace(cls.for_scheme("fp8"), fp8=Fp8Format.from_dict(d))
        if method != "hcfjax":
            raise ConfigError(
                f"quantization_config with quant_method={method!r} is not supported (expected one of "
                f"{QUANT_METHODS}: DeepSeek's block-scaled fp8, or a checkpoint `hcfjax quantize` wrote)"
            )
        q = cls.for_scheme(d.get("scheme"), int(d.get("group_size", 128)))
        return dataclasses.replace(
            q,
            experts=d.get("experts", q.experts),
            linear=d.get("linear", q.linear),
            kv_cache_dtype=d.get("kv_cache_dtype"),
        )

    def to_dict(self) -> dict[str, Any]:
        if self.fp8 is not None:
            return self.fp8.to_dict()
        return {"quant_method": "hcfjax", **{k: v for k, v in dataclasses.asdict(self).items() if k != "fp8"}}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int
    topk_group: int
    topk_method: str
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int
    moe_layer_freq: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    num_mtp_layers: int = 0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    quantization: QuantConfig | None = None

    # ---- derived -------------------------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_dim(self) -> int:
        """Per-token width of one cache entry: latent c_kv then rope key k_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        if self.rope.type == "yarn" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale *= m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        """DeepSeek's rule; MTP layers (index >= num_hidden_layers) follow it too."""
        return self.n_routed_experts > 0 and layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @property
    def layer_segments(self) -> tuple[tuple[int, int, bool], ...]:
        """Runs of consecutive layers of one kind, as (first layer, count, is_moe); each run is one lax.scan."""
        segs: list[list] = []
        for i in range(self.num_hidden_layers):
            moe = self.is_moe_layer(i)
            if segs and segs[-1][2] == moe:
                segs[-1][1] += 1
            else:
                segs.append([i, 1, moe])
        return tuple(tuple(s) for s in segs)

    # ---- JSON ----------------------------------------------------------------------------------------------------
    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json at {path}")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        model_type = d.get("model_type", "deepseek_v3")
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"model_type={model_type!r} is not supported (expected one of {MODEL_TYPES})")
        v3 = model_type == "deepseek_v3"
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act={d['hidden_act']!r} is not supported (DeepSeek uses 'silu')")
        for key in ("attention_bias", "mlp_bias"):
            if d.get(key, False):
                raise ConfigError(f"{key}=true is not supported (DeepSeek checkpoints have no biases)")
        if d.get("num_key_value_heads") not in (None, d.get("num_attention_heads")):
            raise ConfigError("num_key_value_heads must equal num_attention_heads for MLA")

        def req(key):
            if d.get(key) is None:
                raise ConfigError(f"config.json lacks required key {key!r}")
            return d[key]

        n_experts = d.get("n_routed_experts") or 0
        scoring = d.get("scoring_func", "sigmoid" if v3 else "softmax")
        topk_method = d.get("topk_method", "noaux_tc" if v3 else "greedy")
        n_group = d.get("n_group") or 1
        topk_group = d.get("topk_group") or 1
        if scoring not in SCORING:
            raise ConfigError(f"scoring_func={scoring!r} is not supported (expected one of {SCORING})")
        if topk_method not in TOPK_METHODS:
            raise ConfigError(f"topk_method={topk_method!r} is not supported (expected one of {TOPK_METHODS})")
        if n_experts and n_experts % n_group:
            raise ConfigError(f"n_routed_experts={n_experts} is not divisible by n_group={n_group}")
        if topk_group > n_group:
            raise ConfigError(f"topk_group={topk_group} exceeds n_group={n_group}")
        top_k = d.get("num_experts_per_tok") or 0
        if n_experts and not 0 < top_k <= n_experts:
            raise ConfigError(f"num_experts_per_tok={top_k} must be in 1..n_routed_experts={n_experts}")

        eos = d.get("eos_token_id")
        eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        return cls(
            model_type=model_type,
            vocab_size=req("vocab_size"),
            hidden_size=req("hidden_size"),
            intermediate_size=req("intermediate_size"),
            moe_intermediate_size=d.get("moe_intermediate_size") or 0,
            num_hidden_layers=req("num_hidden_layers"),
            num_attention_heads=req("num_attention_heads"),
            q_lora_rank=d.get("q_lora_rank"),
            kv_lora_rank=req("kv_lora_rank"),
            qk_nope_head_dim=req("qk_nope_head_dim"),
            qk_rope_head_dim=req("qk_rope_head_dim"),
            v_head_dim=req("v_head_dim"),
            n_routed_experts=n_experts,
            n_shared_experts=d.get("n_shared_experts") or 0,
            num_experts_per_tok=top_k,
            n_group=n_group,
            topk_group=topk_group,
            topk_method=topk_method,
            scoring_func=scoring,
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
            first_k_dense_replace=d.get("first_k_dense_replace") or 0,
            moe_layer_freq=d.get("moe_layer_freq") or 1,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=req("max_position_embeddings"),
            rope=_rope_from_dict(d, interleave_default=True),
            num_mtp_layers=d.get("num_nextn_predict_layers", d.get("num_mtp_layers")) or 0,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            quantization=QuantConfig.from_dict(d["quantization_config"]) if d.get("quantization_config") else None,
        )

    def to_dict(self) -> dict[str, Any]:
        """config.json contents (DeepSeek's original key names, which transformers also reads)."""
        d = {
            k: v
            for k, v in dataclasses.asdict(self).items()
            if k not in ("rope", "eos_token_ids", "num_mtp_layers", "quantization")
        }
        d["architectures"] = ["DeepseekV3ForCausalLM" if self.model_type == "deepseek_v3" else "DeepseekV2ForCausalLM"]
        d["num_key_value_heads"] = self.num_attention_heads
        d["num_nextn_predict_layers"] = self.num_mtp_layers
        d["hidden_act"] = "silu"
        d["eos_token_id"] = list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0]
        d["rope_theta"] = self.rope.theta
        if self.model_type == "deepseek_v3":
            d["rope_interleave"] = self.rope.interleave
        d["rope_scaling"] = None
        if self.rope.type == "yarn":
            r = self.rope
            d["rope_scaling"] = dict(
                type="yarn",
                factor=r.factor,
                beta_fast=r.beta_fast,
                beta_slow=r.beta_slow,
                mscale=r.mscale,
                mscale_all_dim=r.mscale_all_dim,
                original_max_position_embeddings=r.original_max_position_embeddings,
            )
        if self.quantization is not None:
            d["quantization_config"] = self.quantization.to_dict()
        return d


def _rope_from_dict(d: dict[str, Any], interleave_default: bool) -> RopeConfig:
    """Reads DeepSeek's `rope_scaling` or transformers' `rope_parameters` (which also carries rope_theta)."""
    params = d.get("rope_parameters") or d.get("rope_scaling") or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"rope type {rope_type!r} is not supported (expected one of {ROPE_TYPES})")
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    # transformers' V2 always rotates interleaved pairs; V3 has the rope_interleave flag.
    interleave = bool(d.get("rope_interleave", interleave_default))
    if rope_type == "default":
        return RopeConfig(theta=theta, interleave=interleave)
    factor = params.get("factor")
    orig = params.get("original_max_position_embeddings")
    if factor is None or orig is None:
        raise ConfigError("yarn rope needs 'factor' and 'original_max_position_embeddings'")
    return RopeConfig(
        theta=theta,
        type="yarn",
        factor=float(factor),
        original_max_position_embeddings=int(orig),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        interleave=interleave,
    )
