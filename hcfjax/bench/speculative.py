"""Speculative-decoding benchmark: wall time per output token vs plain decoding, acceptance, and output quality.

    python -m hcfjax.bench.speculative [--model PATH] [--label NAME] [--model PATH --label NAME ...]
        [--batches 1,32] [--ks 1,2,3] [--methods exact,rejection,typical,tuned] [--new-tokens 128]
        [--temperature 0.7] [--head-norm-ablation] [--out FILE]

Default model: the embedded one (its jointly trained MTP layer reused at every depth); pass checkpoints written by
train_mtp.train to compare trained heads. Prompts are the first lines of real standard-library modules. `exact` runs
greedy; rows identical to plain greedy are counted (in float32 all are; in bf16 a near-tie in the target's logits
can flip, because verification runs 1 + k tokens through differently shaped matmuls). The other methods sample at
--temperature with top-p 0.95. Quality: the mean log-likelihood per generated token under the target model at
temperature 1 (identical in distribution to plain sampling for exact and rejection; typical and tuned trade it for
acceptance).
Every timing is the second of two identical runs (the first compiles).
"""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path

import jax
import numpy as np

import hcfjax
from hcfjax.bench.common import header

PROMPT_MODULES = ["os", "json", "argparse", "collections", "functools", "pathlib", "textwrap", "typing"]


def prompts(model: hcfjax.Model, n: int, length: int = 64) -> list[list[int]]:
    """n prompts of `length` tokens from the sources of a few stdlib modules."""
    import importlib

    out = []
    for i in range(n):
        src = inspect.getsource(importlib.import_module(PROMPT_MODULES[i % len(PROMPT_MODULES)]))
        ids = model.tokenizer.encode(src).ids
        start = (i // len(PROMPT_MODULES)) * 97 % max(1, len(ids) - length)
        out.append([0] + ids[start : start + length - 1])
    return out


def log_likelihood(model: hcfjax.Model, ps: list[list[int]], outs: list[list[int]]) -> float:
    """Mean log p(token) of the generated tokens under the model (teacher forcing, temperature 1)."""
    total, count = 0.0, 0
    for p, o in zip(ps, outs, strict=True):
        seq = p + o
        lp = jax.nn.log_softmax(hcfjax.forward(model, [seq[:-1]])[0], axis=-1)
        idx = np.arange(len(p) - 1, len(seq) - 1)
        total += float(np.asarray(lp)[idx, np.asarray(seq)[idx + 1]].sum())
        count += len(o)
    return total / count


def timed_generate(model, ps, **kw):
    hcfjax.generate(model, ps, **kw)
    return hcfjax.generate(model, ps, **kw)


def run(args) -> str:
    labels = args.label or [Path(m).name for m in args.model]
    rows = []
    for label, path in zip(labels, args.model, strict=True):
        model = hcfjax.load(path)
        for b in args.batches:
            ps = prompts(model, b)
            for method in args.methods:
                greedy = method == "exact"
                sp = hcfjax.SamplingParams() if greedy else hcfjax.SamplingParams(args.temperature, top_p=0.95)
                kw = dict(max_new_tokens=args.new_tokens, stop_token_ids=[], sampling=sp, seed=0)
                plain = timed_generate(model, ps, **kw)
                t_plain = plain.stats["decode_s"] / (plain.stats["new_tokens"] - b)
                ll_plain = log_likelihood(model, ps, plain.tokens)
                variants = [(k, True) for k in args.ks] + [(args.ks[-1], False)] * args.head_norm_ablation
                for k, head_norm in variants:
                    cfg = hcfjax.SpeculativeConfig(k, method, mtp_head_norm=head_norm)
                    spec = timed_generate(model, ps, **kw, speculative=cfg)
                    s = spec.stats
                    t_spec = s["decode_s"] / (s["new_tokens"] - b)
                    same = f"{sum(x == y for x, y in zip(spec.tokens, plain.tokens, strict=True))}/{b}"
                    acc = " / ".join(f"{a:.2f}" for a in s["acceptance_per_depth"])
                    ll = log_likelihood(model, ps, spec.tokens)
                    name = method if head_norm else f"{method} (no MTP head norm)"
                    rows.append(
                        f"| {label} | {b} | {name} | {k} | {t_plain * 1e6:.1f} | {t_spec * 1e6:.1f} | "
                        f"{t_plain / t_spec:.2f}x | {s['mean_accepted_length']:.2f} | {acc} | "
                        f"{ll_plain:.3f} / {ll:.3f} | {same if greedy else '-'} |"
                    )
                    print(rows[-1], flush=True)
    lines = [
        "## `python -m hcfjax.bench.speculative`",
        "",
        f"{header()}; {args.new_tokens} new tokens per request, prompts of 64 tokens; sampled methods at "
        f"temperature {args.temperature}, top-p 0.95; exact runs greedy.",
        "",
        "| model | batch | method | k | plain µs/token | spec µs/token | speedup | tokens/step | acceptance per depth "
        "| log-lik plain / spec | rows = greedy |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m hcfjax.bench.speculative", description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append")
    ap.add_argument("--label", action="append")
    ap.add_argument("--batches", default="1,32", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--ks", default="1,2,3", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--methods", default="exact,rejection,typical,tuned", type=lambda s: s.split(","))
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument(
        "--head-norm-ablation", action="store_true", help="also run the largest k without the MTP head norm"
    )
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    args.model = args.model or [hcfjax.DEFAULT_MODEL]
    if args.label and len(args.label) != len(args.model):
        raise SystemExit("give one --label per --model")
    table = run(args)
    print(table)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            f.write(table + "\n\n")


if __name__ == "__main__":
    main()
