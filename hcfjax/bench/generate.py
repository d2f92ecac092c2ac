"""Generation benchmark: decode tokens/s at several batch sizes and prefill tokens/s, through `hcfjax.generate`.

    python -m hcfjax.bench.generate [--preset v2-lite] [--batches 1,32,128] [--prompt-len 512] [--new-tokens 128]
                                    [--prefill-len 4096] [--out hcfjax/bench/results/generate.md]

Random weights of a real shape (default DeepSeek-V2-Lite: 27 layers, hidden 2048, 64 experts top-6, 2 shared,
kv_lora 512). Every figure is the second of two identical runs (the first compiles). The floor column is the time to
stream the bytes a decode step must read (weights of attention, dense and shared layers, the routed experts a batch
of that size touches in expectation, and the batch's KV cache) at the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import hcfjax
from hcfjax.bench.common import copy_bandwidth, header, matmul_flops, torch_copy_bandwidth
from hcfjax.config import ModelConfig
from hcfjax.random_model import PRESETS, preset_config, random_model


def decode_bytes(cfg: ModelConfig, params: dict, batch: int, context: int) -> float:
    """Bytes one decode step must read at least: non-expert weights, expected touched experts, KV cache."""
    total = sum(x.nbytes for x in jax.tree.leaves(params))
    expert = sum(
        x.nbytes
        for seg in params["segments"]
        if "experts" in seg["mlp"]
        for x in jax.tree.leaves(seg["mlp"]["experts"])
    )
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    touched = e * (1 - (1 - k / e) ** batch) / e if e else 0.0
    lm_and_embed = params["embed"].nbytes  # the embedding is gathered, not streamed
    kv = cfg.num_hidden_layers * batch * context * cfg.kv_dim * 2
    return total - lm_and_embed - expert + expert * touched + kv


def run(args) -> str:
    cfg = preset_config(args.preset, num_nextn_predict_layers=0)
    model = random_model(cfg, seed=0, dtype=jnp.bfloat16)
    n_params = sum(x.size for x in jax.tree.leaves(model.params))
    rng = np.random.default_rng(0)
    torch_bw = torch_copy_bandwidth()
    xla_bw = copy_bandwidth()
    bw = torch_bw or xla_bw
    flops = matmul_flops()

    rows = []
    for b in args.batches:
        prompts = [list(rng.integers(2, cfg.vocab_size, args.prompt_len)) for _ in range(b)]
        for _ in range(2):
            out = hcfjax.generate(model, prompts, max_new_tokens=args.new_tokens, stop_token_ids=[])
        s = out.stats
        step = s["decode_s"] / (args.new_tokens - 1)
        floor = decode_bytes(cfg, model.params, b, args.prompt_len + args.new_tokens // 2) / bw
        rows.append(
            f"| decode | {b} | {args.prompt_len} + {args.new_tokens} | {s['decode_tokens_per_s']:,.0f} | "
            f"{step * 1e3:.2f} ms | {floor * 1e3:.2f} ms | {floor / step:.0%} |"
        )
    prompt = [list(rng.integers(2, cfg.vocab_size, args.prefill_len))]
    for _ in range(2):
        out = hcfjax.generate(model, prompt, max_new_tokens=1, stop_token_ids=[])
    s = out.stats
    active = 2 * args.prefill_len * _active_params(cfg)
    attn = 2 * 2 * cfg.num_hidden_layers * cfg.num_attention_heads * args.prefill_len**2 * cfg.qk_head_dim / 2
    floor = (active + attn) / flops
    rows.append(
        f"| prefill | 1 | {args.prefill_len} | {s['prefill_tokens_per_s']:,.0f} | "
        f"{s['prefill_s'] * 1e3:.1f} ms | {floor * 1e3:.1f} ms | {floor / s['prefill_s']:.0%} |"
    )

    lines = [
        f"## `python -m hcfjax.bench.generate --preset {args.preset}`",
        "",
        f"{header()}; model {args.preset} with random weights, {n_params / 1e9:.2f}B parameters, bf16, "
        f"page size 64, XLA reference path (no Pallas kernels).",
        "",
        f"Ceilings measured in this run: copy {bw / 1e12:.2f} TB/s ({'torch copy_' if torch_bw else 'XLA'}; "
        f"XLA elementwise {xla_bw / 1e12:.2f} TB/s), bf16 matmul {flops / 1e12:.0f} TFLOP/s (XLA, 8192^3).",
        "",
        "| phase | batch | tokens | tokens/s | time per step | floor | floor / time |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        "decode floor = bytes a step must read (weights, expected routed experts touched, KV cache) / copy "
        "bandwidth; prefill floor = matmul FLOPs of active parameters + causal attention / bf16 matmul rate.",
    ]
    return "\n".join(lines)


def _active_params(cfg: ModelConfig) -> int:
    """Parameters a token multiplies by (routed experts: only its top-k; the embedding gather excluded)."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    q = d * cfg.q_lora_rank + cfg.q_lora_rank * h * cfg.qk_head_dim if cfg.q_lora_rank else d * h * cfg.qk_head_dim
    attn = q + d * cfg.kv_dim + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim) + h * cfg.v_head_dim * d
    dense = 3 * d * cfg.intermediate_size
    moe = 3 * d * cfg.moe_intermediate_size * (cfg.num_experts_per_tok + cfg.n_shared_experts)
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    return cfg.num_hidden_layers * attn + n_moe * moe + (cfg.num_hidden_layers - n_moe) * dense + d * cfg.vocab_size


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m hcfjax.bench.generate", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="v2-lite", choices=sorted(PRESETS))
    ap.add_argument("--batches", default="1,32,128", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=4096)
    ap.add_argument("--out", help="append the table to this markdown file")
    args = ap.parse_args(argv)
    table = run(args)
    print(table)
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(table + "\n\n")


if __name__ == "__main__":
    main()
