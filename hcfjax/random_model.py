"""Random-weight models of real shapes, for benchmarks, tests and a checkpoint made on the fly.

    python -m hcfjax.random_model OUT_DIR [--preset tiny-v3|v2-lite] [--seed N]

writes a complete checkpoint (config.json, safetensors, a byte-level tokenizer.json) that `hcfjax.load` and
transformers both read.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from hcfjax.api import save
from hcfjax.config import ModelConfig
from hcfjax.model import Model, init_params
from hcfjax.quantize import quantize_model, slice_quantizer

_V3_ROUTING = dict(
    model_type="deepseek_v3",
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    norm_topk_prob=True,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    moe_layer_freq=1,
    bos_token_id=0,
    eos_token_id=1,
)

PRESETS = {
    # DeepSeek-V3 / R1 as their config.json has it (the capacity simulator's model; 671B parameters: too large to
    # make with random weights on one device).
    "deepseek-v3": dict(
        _V3_ROUTING,
        vocab_size=129280,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        num_attention_heads=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=256,
        n_shared_experts=1,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        routed_scaling_factor=2.5,
        first_k_dense_replace=3,
        max_position_embeddings=163840,
        num_nextn_predict_layers=1,
        rope_scaling=dict(
            type="yarn",
            factor=40,
            original_max_position_embeddings=4096,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ),
    # A small V3-architecture model: MLA with q_lora, group-limited routing, a shared expert, one MTP layer.
    "tiny-v3": dict(
        _V3_ROUTING,
        vocab_size=258,
        hidden_size=128,
        intermediate_size=256,
        moe_intermediate_size=64,
        num_hidden_layers=4,
        num_nextn_predict_layers=1,
        num_attention_heads=4,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=16,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        max_position_embeddings=2048,
    ),
    # DeepSeek-V2-Lite's shape (15.7B parameters).
    "v2-lite": dict(
        model_type="deepseek_v2",
        vocab_size=102400,
        hidden_size=2048,
        intermediate_size=10944,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        num_attention_heads=16,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=64,
        n_shared_experts=2,
        num_experts_per_tok=6,
        n_group=1,
        topk_group=1,
        topk_method="greedy",
        scoring_func="softmax",
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        first_k_dense_replace=1,
        moe_layer_freq=1,
        max_position_embeddings=163840,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=dict(
            type="yarn",
            factor=40,
            original_max_position_embeddings=4096,
            beta_fast=32,
            beta_slow=1,
            mscale=0.707,
            mscale_all_dim=0.707,
        ),
        bos_token_id=100000,
        eos_token_id=100001,
    ),
}


def preset_config(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r} (choose from {sorted(PRESETS)})")
    return ModelConfig.from_dict({**PRESETS[name], **overrides})


def byte_tokenizer(vocab_size: int = 258) -> Tokenizer:
    """A byte-level BPE with no merges: ids 0/1 are <bos>/<eos>, ids 2..257 the 256 bytes, and the ids from 258 up to
    vocab_size words of lowercase letters after a space (" a", " b", ..., " z", " aa", ...). Every id a random model
    samples then has text, as a real tokenizer's would: an id the tokenizer did not know would have none, and the
    engine's incremental detokeniser would decode a growing window for each such token (about ten times a real
    token's time). Text still encodes to bytes only (no merges)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {"<bos>": 0, "<eos>": 1} | {ch: i + 2 for i, ch in enumerate(sorted(alphabet))}
    space = "\u0120"  # the byte-level alphabet's character for a space
    for i in range(258, vocab_size):
        word, j = "", i - 258
        while True:  # j in bijective base 26: a .. z, aa .. zz, aaa ...
            word, j = chr(ord("a") + j % 26) + word, j // 26 - 1
            if j < 0:
                break
        vocab[space + word] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<bos>", "<eos>"])
    return tok


def model_tokenizer(cfg: ModelConfig) -> Tokenizer | None:
    """A random model's tokenizer: byte_tokenizer over its whole vocabulary, or None for one smaller than the bytes
    (the model and a front end serving it build the same)."""
    return byte_tokenizer(cfg.vocab_size) if cfg.vocab_size >= 258 else None


def random_model(cfg: ModelConfig, seed: int = 0, dtype=jnp.bfloat16, scheme: str | None = None) -> Model:
    """Random weights of cfg's shape (model.init_params); scheme: quantised as hcfjax.quantize.quantize_model would
    quantise them, the large weights slice by slice as they are made, so the device never holds the float model
    (a V2-Lite in bf16 is 31 GiB, in w4a8c8 9)."""
    tokenizer = model_tokenizer(cfg)
    each = None if scheme is None else slice_quantizer(cfg, scheme)
    model = Model(cfg, init_params(cfg, jax.random.key(seed), dtype, each=each), tokenizer)
    return model if scheme is None else quantize_model(model, scheme)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m hcfjax.random_model", description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--preset", default="tiny-v3", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    save(random_model(preset_config(args.preset), args.seed), args.out)
    print(f"wrote a random {args.preset} checkpoint to {args.out}")


if __name__ == "__main__":
    main()
