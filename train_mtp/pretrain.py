"""Pretrain the embedded tiny DeepSeek-V3 model on the Python standard library, with one jointly trained MTP layer.

    python -m train_mtp.pretrain --out hcfjax/assets/stdlib-v3 [--workdir build/pretrain] [--steps 3000]
                                 [--time-limit 420] [--seed 0]

The architecture is DeepSeek-V3's at a small size: MLA with q_lora, MoE with sigmoid scoring and noaux_tc
group-limited routing (16 experts, top 4, 4 groups, 2 chosen) and a shared expert, one dense layer first, and one
MTP module trained jointly with loss weight 0.3 as in the DeepSeek-V3 paper. The router's correction bias stays 0
(no aux-loss-free balancing updates). Writes an HF-layout checkpoint (bf16) with the corpus tokenizer; workdir keeps
orbax checkpoints (the run resumes from them), log.jsonl and loss.png.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer

import hcfjax
from hcfjax.config import ModelConfig
from hcfjax.model import Model, hidden_states, init_params, logits, mtp_module
from train_mtp import corpus
from train_mtp.common import TrainConfig, add_train_args, cross_entropy, train, train_config

ARCH = dict(
    model_type="deepseek_v3",
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=48,
    num_hidden_layers=4,
    num_nextn_predict_layers=1,
    num_attention_heads=4,
    q_lora_rank=128,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=16,
    n_shared_experts=1,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    topk_method="noaux_tc",
    scoring_func="sigmoid",
    norm_topk_prob=True,
    routed_scaling_factor=1.0,
    first_k_dense_replace=1,
    moe_layer_freq=1,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    hidden_act="silu",
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
)
MTP_WEIGHT = 0.3


def model_config(vocab_size: int, **overrides) -> ModelConfig:
    return ModelConfig.from_dict({**ARCH, "vocab_size": vocab_size, **overrides})


def fresh_params(cfg: ModelConfig, seed: int) -> dict:
    params = init_params(cfg, jax.random.key(seed), jnp.float32)
    # Training starts from unit norm gains and a zero routing bias.
    return jax.tree_util.tree_map_with_path(
        lambda path, x: (
            jnp.ones_like(x) if "norm" in str(path[-1]) else jnp.zeros_like(x) if "router_bias" in str(path[-1]) else x
        ),
        params,
    )


def joint_loss(params: dict, batch: jax.Array, cfg: ModelConfig, seq_len: int, mtp_weight: float = MTP_WEIGHT):
    """Next-token loss of the main model plus mtp_weight x the MTP module's loss on token t+2.

    batch [B, seq_len + 2]: the main model reads tokens 0..T-1 and predicts 1..T; the MTP module combines the main
    hidden state at t with the embedding of token t+1 and predicts token t+2.
    """
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.lax.stop_gradient(x) if "router_bias" in str(path[-1]) else x, params
    )
    x = batch[:, :seq_len]
    pos = jnp.broadcast_to(jnp.arange(seq_len), x.shape)
    h, _ = hidden_states(params, cfg, x, pos)
    main = cross_entropy(logits(params, h), batch[:, 1 : seq_len + 1])
    _, mtp_logits, _ = mtp_module(params["mtp"][0], cfg, 0, h, batch[:, 1 : seq_len + 1], pos + 1, params["embed"])
    mtp = cross_entropy(mtp_logits, batch[:, 2 : seq_len + 2])
    return main + mtp_weight * mtp, {"main_loss": main, "mtp_loss": mtp}


def run(
    out: str | Path,
    workdir: str | Path,
    tc: TrainConfig,
    data_dir: str | Path | None = None,
    arch_overrides: dict | None = None,
    corpus_root=None,
) -> dict:
    workdir = Path(workdir)
    data_dir = Path(data_dir or workdir / "data")
    if not (data_dir / "splits.json").is_file():
        corpus.build(data_dir, root=corpus_root)
    tok = Tokenizer.from_file(str(data_dir / "tokenizer.json"))
    train_ids, val_ids = np.load(data_dir / "train.npy"), np.load(data_dir / "validation.npy")
    cfg = model_config(tok.get_vocab_size(), **(arch_overrides or {}))
    loss = lambda p, b: joint_loss(p, b, cfg, tc.seq_len)
    params, records = train(
        loss, fresh_params(cfg, tc.seed), tc, train_ids, val_ids, tc.seq_len + 2, workdir, desc="pretrain"
    )
    model = Model(cfg, params, tok)
    hcfjax.save(model, out, dtype=jnp.bfloat16)
    final = {k: v for k, v in records[-1].items() if k.startswith("val")} if records else {}
    summary = {
        "steps": records[-1]["step"] if records else 0,
        **final,
        "val_perplexity": float(np.exp(final.get("val_main_loss", np.nan))),
        "params": int(sum(x.size for x in jax.tree.leaves(params))),
        "train_config": dataclasses.asdict(tc),
    }
    (workdir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m train_mtp.pretrain", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="checkpoint directory to write (HF layout)")
    ap.add_argument("--workdir", default="build/pretrain")
    ap.add_argument("--data", help="corpus directory (default: built under workdir)")
    add_train_args(ap, steps=3000, lr=3e-3)
    args = ap.parse_args(argv)
    tc = train_config(args, warmup=200)
    print(json.dumps(run(args.out, args.workdir, tc, args.data), indent=1))


if __name__ == "__main__":
    main()
