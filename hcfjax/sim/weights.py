"""A model's weights by kind: parameter counts, how many of them one token reads, their bytes in each storage format,
and the share one GPU holds under a plan. The cost model (cost.py) prices steps with these counts and sizes the KV
cache from what the weights leave of a GPU; `hcfjax info` prints them.

Each weight has a kind, which says how hcfjax stores it (hcfjax/quantize.py) and how the plans split it
(sharding/plans.py: the prefill plan's tensor-parallel rules; the decode plan replicates all but the experts):

    kind     weights                                          stored as                  per GPU
    experts  routed experts' gate / up / down                 the scheme's expert format over every GPU
    mlp      dense MLPs, shared experts                       the scheme's linear format over tp
    down     MLA's q_a / kv_a (kv_a alone without q_lora),    the scheme's linear format replicated
             the MTP combiner eh_proj
    heads    MLA's per-head q_b (or q), o                     the scheme's linear format over tp
             (bf16 in checkpoints without quantization_config.heads: holds_float_heads)
    kv_b     MLA's per-head kv_b                              the model dtype            over tp
    lm_head  the LM head, each MTP module's own head          the model dtype            over tp (vocab)
    embed    the token embedding                              the model dtype            replicated
    norms    RMSNorm weights                                  the model dtype            replicated
    router   routers and noaux_tc's score-correction bias     float32                    replicated

DeepSeek's fp8 checkpoints (V3, R1) store every decoder-layer linear but the router as fp8 e4m3 with one float32
scale per 128 x 128 block (`weight_scale_inv`), and the rest (embeddings, LM heads, routers, norms, the MTP's
eh_proj) in bf16 (the correction bias in float32).
"""

from __future__ import annotations

import dataclasses

from hcfjax.config import QUANT_SCHEMES, ModelConfig

INT4_BYTES = 0.5 + 4 / 128  # int4 values + one float32 scale per group of 128 (hcfjax.quant.QWeight)
FP8_BYTES = 1 + 4 / 128**2  # e4m3 values + one float32 scale per 128 x 128 block (hcfjax.fp8.Fp8Weight)
WEIGHT_BYTES = {None: 2.0, "w8a8": 1.0, "w4a16": INT4_BYTES, "w4a8": INT4_BYTES, "fp8": FP8_BYTES}
SPLIT_TP = ("mlp", "heads", "kv_b", "lm_head")  # kinds the prefill plan splits over tp; experts go over every GPU


@dataclasses.dataclass(frozen=True)
class Weights:
    """One kind of weight of the main model or of the MTP modules, summed over layers."""

    kind: str
    params: int
    active: int  # parameters one token reads (k of E routed experts, one embedding row)
    fp8: bool  # fp8 block-scaled in DeepSeek's fp8 checkpoints
    f32: bool = False  # float32 in a checkpoint (the correction bias)


@dataclasses.dataclass(frozen=True)
class LayerParams:
    """Parameter counts of one decoder layer's parts and of the LM head, as the cost model prices them."""

    down: int  # q_a + kv_a (kv_a alone without q_lora)
    heads: int  # q_b (or q) + o
    kv_b: int
    dense: int  # one dense MLP
    expert: int  # one routed expert (the shared ones are this wide each)
    shared: int  # all shared experts of a layer
    router: int
    lm: int  # the LM head (and the embedding: the same count)
    norms: int  # a layer's RMSNorm weights

    @classmethod
    def of(cls, c: ModelConfig) -> LayerParams:
        d, h, cr = c.hidden_size, c.num_attention_heads, c.kv_lora_rank + c.qk_rope_head_dim
        q_out = h * c.qk_head_dim
        o = h * c.v_head_dim * d
        expert = 3 * d * c.moe_intermediate_size
        return cls(
            down=(d * c.q_lora_rank if c.q_lora_rank else 0) + d * cr,
            heads=(c.q_lora_rank * q_out if c.q_lora_rank else d * q_out) + o,
            kv_b=c.kv_lora_rank * h * (c.qk_nope_head_dim + c.v_head_dim),
            dense=3 * d * c.intermediate_size,
            expert=expert,
            shared=c.n_shared_experts * expert,
            router=d * c.n_routed_experts,
            lm=d * c.vocab_size,
            norms=2 * d + (c.q_lora_rank or 0) + c.kv_lora_rank,
        )


def _layers(c: ModelConfig, layers: range) -> list[Weights]:
    p = LayerParams.of(c)
    moe = [i for i in layers if c.is_moe_layer(i)]
    n, m, e, k = len(layers), len(moe), c.n_routed_experts, c.num_experts_per_tok
    bias = e if c.topk_method == "noaux_tc" else 0
    return [
        Weights("down", n * p.down, n * p.down, True),
        Weights("heads", n * p.heads, n * p.heads, True),
        Weights("kv_b", n * p.kv_b, n * p.kv_b, True),
        Weights("norms", n * p.norms, n * p.norms, False),
        Weights("mlp", (n - m) * p.dense + m * p.shared, (n - m) * p.dense + m * p.shared, True),
        Weights("router", m * p.router, m * p.router, False),
        Weights("router", m * bias, m * bias, False, f32=True),
        Weights("experts", m * e * p.expert, m * k * p.expert, True),
    ]


def main_weights(c: ModelConfig) -> list[Weights]:
    """The main model: embedding, decoder layers, final norm, LM head (none when tied to the embedding)."""
    d, lm = c.hidden_size, LayerParams.of(c).lm
    out = [Weights("embed", lm, d, False), *_layers(c, range(c.num_hidden_layers)), Weights("norms", d, d, False)]
    if not c.tie_word_embeddings:
        out.append(Weights("lm_head", lm, lm, False))
    return out


def mtp_weights(c: ModelConfig, modules: int | None = None) -> list[Weights]:
    """`modules` MTP modules (default: the config's) as hcfjax holds them: a decoder layer, enorm / hnorm, the
    combiner eh_proj [2D -> D], and its own head norm and LM head (tensor_specs.tensor_specs); the embedding is the
    main model's."""
    n = c.num_mtp_layers if modules is None else modules
    if n == 0:
        return []
    d, lm = c.hidden_size, LayerParams.of(c).lm
    first = c.num_hidden_layers
    return [
        *_layers(c, range(first, first + n)),
        Weights("norms", 3 * n * d, 3 * n * d, False),
        Weights("combiner", n * 2 * d * d, n * 2 * d * d, False),
        Weights("lm_head", n * lm, n * lm, False),
    ]


def count(weights: list[Weights], active: bool = False) -> int:
    return sum(w.active if active else w.params for w in weights)


def holds_float_heads(c: ModelConfig, quant: str | None) -> bool:
    """Whether the checkpoint behind `c`, served in scheme `quant`, holds MLA's q_b / o in bf16: one quantised by
    hcfjax to int8 linears before `quantization_config.heads` existed (hcfjax/quantize.py loads them as written).
    A float or fp8 checkpoint quantised as it loads gets them in the scheme's format."""
    q = c.quantization
    return q is not None and q.fp8 is None and q.linear is not None and q.heads is None and quant == q.scheme


def kind_bytes(kind: str, quant: str | None, float_heads: bool = False) -> float:
    """Bytes per parameter of `kind` under a scheme (None: bf16), as hcfjax/quantize.py quantises: the linears of
    "mlp", "down" (q_a / kv_a) and "heads" (MLA's q_b / o) by every scheme that quantises linears; the MTP combiner
    by the int schemes only (fp8 keeps it, as DeepSeek ships it); kv_b, norms, embeddings and LM heads by none;
    routers in float32. float_heads: the heads in bf16 (holds_float_heads)."""
    if quant is not None and quant not in QUANT_SCHEMES:
        raise ValueError(f"quant must be None or one of {sorted(QUANT_SCHEMES)}, got {quant!r}")
    experts, linear, _ = QUANT_SCHEMES[quant] if quant else (None, None, None)
    if kind == "heads" and float_heads:
        return 2.0
    if kind == "experts":
        return WEIGHT_BYTES[experts]
    if kind in ("mlp", "down", "heads") or (kind == "combiner" and linear != "fp8"):
        return WEIGHT_BYTES[linear]
    return 4.0 if kind == "router" else 2.0


def total_bytes(weights: list[Weights], quant: str | None, float_heads: bool = False) -> float:
    """Bytes of the weights as hcfjax holds them under a scheme (None: bf16)."""
    return sum(w.params * kind_bytes(w.kind, quant, float_heads) for w in weights)


def fp8_bytes(weights: list[Weights], block: tuple[int, int] = (128, 128)) -> float:
    """Bytes of the weights as DeepSeek's fp8 checkpoints store them: e4m3 values with one float32 scale per block
    (`quantization_config.weight_block_size`)."""
    fp8 = 1 + 4 / (block[0] * block[1])
    return sum(w.params * (fp8 if w.fp8 else 4.0 if w.f32 else 2.0) for w in weights)


def bytes_per_gpu(weights: list[Weights], quant: str | None, tp: int, gpus: int, float_heads: bool = False) -> float:
    """What one GPU of an instance of `gpus` GPUs (tp per DP rank) holds: the kinds in SPLIT_TP over tp, routed
    experts over every GPU (E over ep, each expert's width over the gpus / ep that share it), the rest replicated."""
    total = 0.0
    for w in weights:
        share = 1 / gpus if w.kind == "experts" else 1 / tp if w.kind in SPLIT_TP else 1.0
        total += w.params * kind_bytes(w.kind, quant, float_heads) * share
    return total
