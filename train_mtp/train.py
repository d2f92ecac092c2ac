"""Train D MTP modules on a frozen base model, as D independent modules or one module shared across D depths.

    python -m train_mtp.train --base PATH --depth 5 --mode shared|independent --out PATH
                              [--steps 600] [--workdir build/mtp-MODE] [--data DIR] [--seed 0]

Every module starts from the base checkpoint's jointly trained MTP layer. `independent`: module k predicts token
t+k+1 from module k-1's hidden state and the embedding of token t+k. `shared`: one module applied at every depth,
trained on all of them (its checkpoint has one MTP layer and loads anywhere DeepSeek's does). The loss is the mean of
the depths' cross-entropies. The output is the base checkpoint with its MTP layers replaced, in the project's HF
layout, ready for speculative decoding.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import hcfjax
from train_mtp import corpus
from train_mtp.common import TrainConfig, add_train_args, train, train_config
from train_mtp.heads import chain_loss

MODES = ("shared", "independent")


def run(
    base: str | Path,
    depth: int,
    mode: str,
    out: str | Path,
    tc: TrainConfig,
    workdir: str | Path,
    data_dir: str | Path | None = None,
) -> dict:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    workdir = Path(workdir)
    data_dir = Path(data_dir or workdir / "data")
    if not (data_dir / "splits.json").is_file():
        corpus.build(data_dir)
    model = hcfjax.load(base, dtype=jnp.float32)
    if not model.params.get("mtp"):
        raise ValueError(f"{base} has no MTP layer to start from")
    init = model.params["mtp"][0]
    modules = [init] if mode == "shared" else [jax.tree.map(jnp.copy, init) for _ in range(depth)]
    frozen = {k: v for k, v in model.params.items() if k != "mtp"}
    cfg = model.cfg
    loss = lambda mods, batch: chain_loss(mods, frozen, cfg, batch, tc.seq_len, depth)
    train_ids, val_ids = np.load(data_dir / "train.npy"), np.load(data_dir / "validation.npy")
    modules, records = train(
        loss, modules, tc, train_ids, val_ids, tc.seq_len + depth + 1, workdir, desc=f"mtp-{mode}-{depth}"
    )
    out_cfg = dataclasses.replace(cfg, num_mtp_layers=len(modules))
    hcfjax.save(hcfjax.Model(out_cfg, {**frozen, "mtp": modules}, model.tokenizer, model.path), out, dtype=jnp.bfloat16)
    summary = {"mode": mode, "depth": depth, **{k: v for k, v in records[-1].items() if k.startswith("val")}}
    (workdir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m train_mtp.train", description=__doc__.split("\n")[0])
    ap.add_argument("--base", default=None, help="base checkpoint (default: the embedded model)")
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--mode", choices=MODES, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--workdir")
    ap.add_argument("--data", help="corpus directory (default: built under workdir)")
    add_train_args(ap, steps=600, lr=1e-3)
    args = ap.parse_args(argv)
    tc = train_config(args, warmup=50, eval_every=max(1, args.steps // 5))
    base = args.base or hcfjax.DEFAULT_MODEL
    workdir = args.workdir or f"build/mtp-{args.mode}-{args.depth}"
    print(json.dumps(run(base, args.depth, args.mode, args.out, tc, workdir, args.data), indent=1))


if __name__ == "__main__":
    main()
