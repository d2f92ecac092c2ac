"""Quality of the quantisation schemes on the embedded model's test split, against the bf16 model.

    python -m pallas_kernels.bench.quality [--data .data/corpus] [--windows 16] [--seq 512] [--prompts 32]
                                           [--gen 64] [--schemes w4a16,w4a8,w4a8c8,w8a8] [--out FILE]

Perplexity: teacher-forced next-token loss over fixed test windows (train_mtp.common.eval_windows), run as a cached
prefill so that a scheme's KV cache precision counts (the keys and values are read back from the int8 cache for
w4a8c8). Agreement: the fraction of those positions whose argmax equals the bf16 model's; and greedy generation from
test prefixes (bf16 vs quantised): tokens equal to bf16's, and the mean length of the identical prefix. The test split
is the corpus' (train_mtp/corpus.py: CPython's Lib split by file); `--data` must hold test.npy.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer

import hcfjax
from hcfjax import cache as kvcache
from hcfjax.attention import CacheContext
from hcfjax.bench.common import header
from hcfjax.model import hidden_states, logits
from hcfjax.quantize import default_cache_dtype, quantize_model
from train_mtp.common import eval_windows

SCHEMES = ("w4a16", "w4a8", "w4a8c8", "w8a8")


def cached_logits(model: hcfjax.Model, tokens: np.ndarray, cache_dtype) -> np.ndarray:
    """tokens [B, T] -> f32 logits [B, T, V] from one prefill through a fresh paged cache of `cache_dtype`."""
    cfg = model.cfg
    b, t = tokens.shape
    page = 64
    pages = -(-t // page)

    @jax.jit
    def run(params, tokens):
        cache = kvcache.init_cache(cfg, b * pages, page, cache_dtype)
        table = jnp.arange(b * pages, dtype=jnp.int32).reshape(b, pages)
        ctx = CacheContext(cache, table, jnp.full((b,), t, jnp.int32), jnp.ones((b, t), bool))
        positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        h, _ = hidden_states(params, cfg, tokens, positions, ctx)
        return logits(params, h)

    return np.asarray(run(model.params, jnp.asarray(tokens, jnp.int32)))


def nll(lg: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """Per-position next-token loss [B, T-1]."""
    logp = jax.nn.log_softmax(jnp.asarray(lg[:, :-1]), axis=-1)
    return -np.asarray(jnp.take_along_axis(logp, jnp.asarray(tokens[:, 1:, None]), axis=-1))[..., 0]


def evaluate(models: dict, test: np.ndarray, windows: int, seq: int, prompts: int, prefix: int, gen: int) -> list:
    win = eval_windows(test, 1, windows, seq)[0]
    starts = [list(map(int, w)) for w in eval_windows(test, 1, prompts, prefix)[0]]
    ref_lg = ref_gen = None
    rows = []
    for label, model in models.items():
        cdt = default_cache_dtype(model)
        lg = np.concatenate([cached_logits(model, win[i : i + 4], cdt) for i in range(0, windows, 4)])
        loss = float(nll(lg, win).mean())
        out = hcfjax.generate(model, starts, max_new_tokens=gen, stop_token_ids=[], cache_dtype=cdt)
        toks = np.array(out.tokens)
        if ref_lg is None:
            ref_lg, ref_gen, ref_loss = lg, toks, loss
        same = toks == ref_gen
        prefix_len = np.where(same.all(1), gen, np.argmin(same, axis=1))
        rows.append(
            dict(
                scheme=label,
                cache=str(jnp.dtype(cdt)),
                loss=loss,
                ppl=float(np.exp(loss)),
                dppl=float(np.exp(loss) / np.exp(ref_loss) - 1),
                top1=float((lg.argmax(-1) == ref_lg.argmax(-1)).mean()),
                gen_same=float(same.mean()),
                gen_prefix=float(prefix_len.mean()),
                weights_mb=sum(_nbytes(x) for x in jax.tree.leaves(model.params)) / 2**20,
            )
        )
        print(rows[-1], flush=True)
    return rows


def _nbytes(x) -> int:
    return x.size * x.dtype.itemsize


def table(rows: list, args) -> str:
    lines = [
        "| scheme | KV cache | weights (MiB) | test loss | perplexity | ppl increase | top-1 agreement "
        f"(teacher-forced) | greedy tokens equal ({args.gen}) | identical greedy prefix |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['scheme']} | {r['cache']} | {r['weights_mb']:.1f} | {r['loss']:.4f} | {r['ppl']:.3f} | "
            f"{100 * r['dppl']:+.2f}% | {100 * r['top1']:.2f}% | {100 * r['gen_same']:.1f}% | "
            f"{r['gen_prefix']:.1f} |"
        )
    return "\n".join(lines)


def check_tokenizer(model, path: Path) -> None:
    """The corpus must be tokenized as the model was trained: train_mtp.corpus retrains its tokenizer on this
    interpreter's stdlib, so another Python's corpus gives other ids (and a perplexity in the thousands)."""
    if model.tokenizer is None or not path.is_file():
        return
    if Tokenizer.from_file(str(path)).get_vocab() != model.tokenizer.get_vocab():
        raise SystemExit(
            f"{path} is not the model's tokenizer: this corpus trained its own on another stdlib. Build it with "
            "`python -m train_mtp.corpus --out DIR --tokenizer MODEL/tokenizer.json` (the embedded model's: "
            "hcfjax/assets/stdlib-v3/tokenizer.json)."
        )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default=".data/corpus")
    ap.add_argument("--model", help="checkpoint (default: the embedded model)")
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prefix", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--schemes", default=",".join(SCHEMES))
    ap.add_argument("--out", help="append the table to this markdown file")
    args = ap.parse_args(argv)
    test = np.load(Path(args.data) / "test.npy")
    base = hcfjax.load(args.model)
    check_tokenizer(base, Path(args.data) / "tokenizer.json")
    models = {"bf16": base, "f32": dataclasses.replace(base, params=jax.tree.map(_f32, base.params))}
    models |= {s: quantize_model(base, s) for s in args.schemes.split(",") if s}
    rows = evaluate(models, test, args.windows, args.seq, args.prompts, args.prefix, args.gen)
    text = (
        f"{header()}; {args.windows} test windows x {args.seq} tokens teacher-forced, {args.prompts} greedy "
        f"continuations of {args.gen} tokens from {args.prefix}-token test prefixes\n\n{table(rows, args)}\n"
    )
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + text)


def _f32(x):
    return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x


if __name__ == "__main__":
    main()
