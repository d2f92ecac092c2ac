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
# channel with int8 activations (and MLA's per-head q_b / q and o with them: QuantConfig.heads); None keeps them in
# the model dtype. "fp8" is DeepSeek's own format: e4m3 weights with 128 x 128 block scales and e4m3 activations per
# token and 128 channels (hcfjax/fp8.py). hcfjax/quantize.py says which linears these are.
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
        """The block's keys, each checked: hcfjax runs e4m3 weights in 128 x 128 blocks with dynamic activations."""
        f = _Keys(d, "quantization_config.")
        block = d.get("weight_block_size")
        if block is not None and (not isinstance(block, list) or block != [128, 128]):
            raise ConfigError(
                f"quantization_config.weight_block_size={block!r:.40} is not supported (expected [128, 128])"
            )
        return cls(
            fmt=f.choice("fmt", "e4m3", ("e4m3",)),
            activation_scheme=f.choice("activation_scheme", "dynamic", ("dynamic",)),
            scale_fmt=f.choice("scale_fmt", None, ("ue8m0",)),
        )

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
    # MLA's per-head q_b (or q) and o: w8a8 (int8 per output channel, as the linears) or None (the model dtype, as
    # checkpoints written without this key hold them). fp8 quantises them by its own format.
    heads: str | None = None

    @classmethod
    def for_scheme(cls, scheme: str, group_size: int = 128) -> QuantConfig:
        if scheme not in QUANT_SCHEMES:
            raise ConfigError(
                f"quantisation scheme {scheme!r} is not supported (expected one of {list(QUANT_SCHEMES)})"
            )
        experts, linear, kv = QUANT_SCHEMES[scheme]
        if scheme == "fp8":
            return cls(scheme, 128, experts, linear, kv, fp8=Fp8Format())
        return cls(scheme, group_size, experts, linear, kv, heads=linear)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QuantConfig:
        method = d.get("quant_method")
        if method == "fp8":
            return dataclasses.replace(cls.for_scheme("fp8"), fp8=Fp8Format.from_dict(d))
        if method != "hcfjax":
            raise ConfigError(
                f"quantization_config with quant_method={method!r:.40} is not supported (expected one of "
                f"{QUANT_METHODS}: DeepSeek's block-scaled fp8, or a checkpoint `hcfjax quantize` wrote)"
            )
        f = _Keys(d, "quantization_config.")
        int_schemes = tuple(s for s in QUANT_SCHEMES if s != "fp8")  # fp8 is written as DeepSeek's block
        q = cls.for_scheme(f.choice("scheme", _REQUIRED, int_schemes), f.int("group_size", 128))
        return dataclasses.replace(
            q,
            experts=f.choice("experts", q.experts, ("w4a16", "w4a8", "w8a8")),
            linear=f.choice("linear", None, ("w8a8",)) if "linear" in d else q.linear,
            kv_cache_dtype=f.choice("kv_cache_dtype", None, ("int8",)),
            heads=f.choice("heads", None, ("w8a8",)),
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
        """Reads config.json (or a directory's); ConfigError, naming the file and the key, for a file that is not a
        JSON object or a value this project cannot run."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json at {path}")
        try:
            d = json.loads(path.read_text())
        except ValueError as e:  # not JSON, or not UTF-8
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{path} holds a JSON {type(d).__name__}, not an object of config keys")
        try:
            return cls.from_dict(d)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """A config from config.json's keys. Every value is checked for its JSON type and range (ConfigError names
        the key); a missing optional key, or null, takes its default."""
        if not isinstance(d, dict):
            raise ConfigError(f"a config is a JSON object, not a {type(d).__name__}")
        f = _Keys(d)
        model_type = f.choice("model_type", "deepseek_v3", MODEL_TYPES)
        v3 = model_type == "deepseek_v3"
        f.choice("hidden_act", "silu", ("silu",))
        for key in ("attention_bias", "mlp_bias"):
            if f.bool(key, False):
                raise ConfigError(f"{key}=true is not supported (DeepSeek checkpoints have no biases)")
        heads = f.int("num_attention_heads")
        if d.get("num_key_value_heads") not in (None, heads) or isinstance(d.get("num_key_value_heads"), bool):
            raise ConfigError("num_key_value_heads must equal num_attention_heads for MLA")

        n_experts = f.int("n_routed_experts", 0, lo=0)
        scoring = f.choice("scoring_func", "sigmoid" if v3 else "softmax", SCORING)
        topk_method = f.choice("topk_method", "noaux_tc" if v3 else "greedy", TOPK_METHODS)
        n_group = f.int("n_group", 1, lo=0) or 1  # 0, as null, means no groups
        topk_group = f.int("topk_group", 1, lo=0) or 1
        if n_experts and n_experts % n_group:
            raise ConfigError(f"n_routed_experts={n_experts} is not divisible by n_group={n_group}")
        if topk_group > n_group:
            raise ConfigError(f"topk_group={topk_group} exceeds n_group={n_group}")
        top_k = f.int("num_experts_per_tok", 0, lo=0)
        if n_experts and not 0 < top_k <= n_experts:
            raise ConfigError(f"num_experts_per_tok={top_k} must be in 1..n_routed_experts={n_experts}")
        eligible = topk_group * (n_experts // n_group)  # the experts of the groups a group-limited gate keeps
        if n_experts and topk_method != "greedy" and topk_group < n_group and eligible < top_k:
            raise ConfigError(
                f"num_experts_per_tok={top_k} exceeds the {eligible} experts of topk_group={topk_group} groups"
                f" (n_routed_experts={n_experts} in n_group={n_group})"
            )
        moe_width = f.int("moe_intermediate_size", 0, lo=0)
        if n_experts and not moe_width:
            raise ConfigError("moe_intermediate_size must be >= 1 for routed experts (n_routed_experts > 0)")
        rope_dim = f.int("qk_rope_head_dim", lo=2)
        if rope_dim % 2:
            raise ConfigError(f"qk_rope_head_dim={rope_dim} must be even (rotary pairs)")

        vocab = f.int("vocab_size")
        token = lambda key, v: f.check_int(key, v, 0, vocab - 1)  # noqa: E731
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos_ids = tuple(token("eos_token_id", e) for e in eos)
        else:
            eos_ids = () if eos is None else (token("eos_token_id", eos),)
        bos = d.get("bos_token_id")
        mtp_key = "num_nextn_predict_layers" if d.get("num_nextn_predict_layers") is not None else "num_mtp_layers"
        return cls(
            model_type=model_type,
            vocab_size=vocab,
            hidden_size=f.int("hidden_size"),
            intermediate_size=f.int("intermediate_size"),
            moe_intermediate_size=moe_width,
            num_hidden_layers=f.int("num_hidden_layers"),
            num_attention_heads=heads,
            q_lora_rank=f.int("q_lora_rank", None, lo=0),
            kv_lora_rank=f.int("kv_lora_rank"),
            qk_nope_head_dim=f.int("qk_nope_head_dim"),
            qk_rope_head_dim=rope_dim,
            v_head_dim=f.int("v_head_dim"),
            n_routed_experts=n_experts,
            n_shared_experts=f.int("n_shared_experts", 0, lo=0),
            num_experts_per_tok=top_k,
            n_group=n_group,
            topk_group=topk_group,
            topk_method=topk_method,
            scoring_func=scoring,
            norm_topk_prob=f.bool("norm_topk_prob", False),
            routed_scaling_factor=f.float("routed_scaling_factor", 1.0, lo=0.0) or 1.0,  # 0, as null: unscaled
            first_k_dense_replace=f.int("first_k_dense_replace", 0, lo=0),
            moe_layer_freq=f.int("moe_layer_freq", 1, lo=0) or 1,
            rms_norm_eps=f.float("rms_norm_eps", 1e-6, lo=0.0, open_lo=True),
            max_position_embeddings=f.int("max_position_embeddings"),
            rope=_rope_from_dict(d, f, interleave_default=True),
            num_mtp_layers=f.int(mtp_key, 0, lo=0),
            tie_word_embeddings=f.bool("tie_word_embeddings", False),
            bos_token_id=None if bos is None else token("bos_token_id", bos),
            eos_token_ids=eos_ids,
            quantization=QuantConfig.from_dict(f.dict("quantization_config")) if d.get("quantization_config") else None,
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


def _rope_from_dict(d: dict[str, Any], f: _Keys, interleave_default: bool) -> RopeConfig:
    """Reads DeepSeek's `rope_scaling` or transformers' `rope_parameters` (which also carries rope_theta)."""
    key = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
    params = _Keys(f.dict(key) or {}, f"{key}.")
    rope_type = params.choice("rope_type", None, ROPE_TYPES) or params.choice("type", "default", ROPE_TYPES)
    theta = params.float("rope_theta", None, lo=0.0, open_lo=True) or f.float("rope_theta", 10000.0, 0.0, True)
    # transformers' V2 always rotates interleaved pairs; V3 has the rope_interleave flag.
    interleave = f.bool("rope_interleave", interleave_default)
    if rope_type == "default":
        return RopeConfig(theta=theta, interleave=interleave)
    if params.d.get("factor") is None or params.d.get("original_max_position_embeddings") is None:
        raise ConfigError("yarn rope needs 'factor' and 'original_max_position_embeddings'")
    return RopeConfig(
        theta=theta,
        type="yarn",
        factor=params.float("factor", lo=0.0, open_lo=True),
        original_max_position_embeddings=params.int("original_max_position_embeddings"),
        beta_fast=params.float("beta_fast", 32.0, lo=0.0) or 32.0,  # 0, as null, takes the default
        beta_slow=params.float("beta_slow", 1.0, lo=0.0) or 1.0,
        mscale=params.float("mscale", 0.0, lo=0.0),
        mscale_all_dim=params.float("mscale_all_dim", 0.0, lo=0.0),
        interleave=interleave,
    )


_REQUIRED = object()


class _Keys:
    """A JSON object's values read with their type and range checked; a ConfigError names the key (after `prefix`,
    the enclosing key's name). A key that is missing or null takes `default`; without one it is required."""

    def __init__(self, d: dict[str, Any], prefix: str = ""):
        self.d, self.prefix = d, prefix

    def _get(self, key: str, default):
        v = self.d.get(key)
        if v is None and default is _REQUIRED:
            raise ConfigError(f"the required key {self.prefix + key!r} is missing")
        return v

    def check_int(self, key: str, v, lo: int, hi: int | None = None) -> int:
        if type(v) is not int:
            raise ConfigError(f"{self.prefix}{key}={v!r:.40} is not an integer")
        if v < lo or (hi is not None and v > hi):
            bound = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
            raise ConfigError(f"{self.prefix}{key}={v} is out of range (must be {bound})")
        return v

    def int(self, key: str, default=_REQUIRED, lo: int = 1) -> int:
        v = self._get(key, default)
        return default if v is None else self.check_int(key, v, lo)

    def float(self, key: str, default=_REQUIRED, lo: float | None = None, open_lo: bool = False) -> float:
        v = self._get(key, default)
        if v is None:
            return default
        if type(v) not in (int, float) or not math.isfinite(v):
            raise ConfigError(f"{self.prefix}{key}={v!r:.40} is not a finite number")
        if lo is not None and (v <= lo if open_lo else v < lo):
            raise ConfigError(f"{self.prefix}{key}={v} is out of range (must be {'>' if open_lo else '>='} {lo})")
        return float(v)

    def bool(self, key: str, default: bool) -> bool:
        v = self._get(key, default)
        if v is None:
            return default
        if type(v) is not bool:
            raise ConfigError(f"{self.prefix}{key}={v!r:.40} is not true or false")
        return v

    def choice(self, key: str, default, choices: tuple[str, ...]) -> str:
        v = self._get(key, default)
        if v is None:
            return default
        if v not in choices or type(v) is not str:
            raise ConfigError(f"{self.prefix}{key}={v!r:.40} is not supported (expected one of {choices})")
        return v

    def dict(self, key: str) -> dict | None:
        v = self.d.get(key)
        if v is not None and not isinstance(v, dict):
            raise ConfigError(f"{self.prefix}{key}={v!r:.40} is not a JSON object")
        return v
