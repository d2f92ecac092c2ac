"""Per-depth loss and greedy acceptance of a checkpoint's MTP heads on held-out data.

    python -m train_mtp.evaluate --model PATH [--label NAME] [--model PATH --label NAME ...] [--depth 5]
                                 [--data DIR] [--windows 64] [--prefix 128] [--gen 64] [--out RESULTS.md]

Loss: each depth's cross-entropy on test-split text (teacher forcing through the chain).
Acceptance: the base model greedily continues `windows` test prefixes by `gen` tokens; at every anchor t whose next
depth+1 tokens are all greedy, the chain drafts depth by depth from the base's hidden state at t. Depth k's draft is
accepted when it equals the base's greedy token, and it only counts when depths 1..k-1 were accepted (their inputs
are then exactly the greedy tokens, as in a speculative step). Reported: the conditional acceptance per depth, and
the mean tokens emitted per verification step with k drafts: 1 + sum over j <= k of P(first j drafts accepted).
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import hcfjax
from train_mtp.common import cross_entropy, eval_windows
from train_mtp.heads import base_hidden, chain_logits


def evaluate(
    model: hcfjax.Model,
    test_ids: np.ndarray,
    depth: int = 5,
    windows: int = 64,
    prefix: int = 128,
    gen: int = 64,
    loss_batches: int = 4,
    seq_len: int = 512,
) -> dict:
    cfg, p = model.cfg, model.params
    modules = p["mtp"]

    @jax.jit
    def losses(tokens):
        h0 = base_hidden(p, cfg, tokens, seq_len)
        return [
            cross_entropy(lg, tokens[:, k + 1 : k + 1 + seq_len])
            for k, lg in enumerate(chain_logits(modules, p, cfg, h0, tokens, depth), start=1)
        ]

    per_depth_loss = np.zeros(depth)
    for w in eval_windows(test_ids, loss_batches, 16, seq_len + depth + 1):
        per_depth_loss += np.array([float(x) for x in losses(jnp.asarray(w))]) / loss_batches

    prompts = [list(map(int, w)) for w in eval_windows(test_ids, 1, windows, prefix)[0]]
    out = hcfjax.generate(model, prompts, max_new_tokens=gen, stop_token_ids=[])
    seq = jnp.asarray(np.array([pr + toks for pr, toks in zip(prompts, out.tokens, strict=True)], np.int32))
    rows = prefix + gen - depth - 1  # anchors t < rows have tokens up to t + depth + 1 in seq

    @jax.jit
    def drafts(seq):
        h0 = base_hidden(p, cfg, seq, rows)
        return jnp.stack([jnp.argmax(lg, -1) for lg in chain_logits(modules, p, cfg, h0, seq, depth)], -1)

    d = np.asarray(drafts(seq))  # [W, rows, depth]; d[:, t, k-1] drafts seq[:, t + k + 1]
    target = np.stack([np.asarray(seq)[:, k + 1 : k + 1 + rows] for k in range(1, depth + 1)], -1)
    anchors = slice(prefix - 1, rows)  # the next depth + 1 tokens after t are all the base's greedy tokens
    hit = (d == target)[:, anchors].reshape(-1, depth)
    prefix_ok = np.cumprod(hit, axis=1)  # first j drafts all accepted
    p_first = prefix_ok.mean(0)
    cond = [float(p_first[0])] + [float(p_first[k] / max(p_first[k - 1], 1e-12)) for k in range(1, depth)]
    return {
        "modules": len(modules),
        "anchors": int(hit.shape[0]),
        "loss_per_depth": [float(x) for x in per_depth_loss],
        "acceptance_per_depth": cond,
        "mean_accepted_length": [float(1 + p_first[:k].sum()) for k in range(1, depth + 1)],
    }


def report(results: dict[str, dict], depth: int, commands: list[str]) -> str:
    labels = list(results)
    lines = [
        f"Evaluated {datetime.date.today().isoformat()} on {jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"test split, {next(iter(results.values()))['anchors']} anchors per model.",
        "",
    ]
    depths = [f"depth {k}" for k in range(1, depth + 1)]
    ks = [f"k={k}" for k in range(1, depth + 1)]
    fmt = lambda key: {n: [f"{a:.3f}" for a in results[n][key]] for n in labels}
    base = labels[0]
    gains = {
        n: [
            f"{results[n]['mean_accepted_length'][k] / results[base]['mean_accepted_length'][k] - 1:+.1%}"
            for k in range(depth)
        ]
        for n in labels[1:]
    }
    lines += _table(
        "Conditional greedy acceptance per depth (depth k counted only when depths < k were accepted):",
        depths,
        fmt("acceptance_per_depth"),
    )
    lines += [
        "",
        *_table(
            "Mean tokens emitted per verification step with k drafts (1 + expected accepted drafts):",
            ks,
            fmt("mean_accepted_length"),
        ),
    ]
    lines += ["", *_table(f"Gain in tokens per step over `{base}` at the same k:", ks, gains)]
    lines += [
        "",
        *_table("Held-out cross-entropy per depth (nats/token, teacher forcing):", depths, fmt("loss_per_depth")),
    ]
    lines += ["", "Commands:", "", "```", *commands, "```"]
    return "\n".join(lines)


def _table(title: str, columns: list[str], rows: dict[str, list[str]]) -> list[str]:
    """A titled markdown table with one row per label."""
    out = [title, "", "| heads | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    return out + [f"| {n} | " + " | ".join(cells) + " |" for n, cells in rows.items()]


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, r in results.items():
        ks = range(1, len(r["acceptance_per_depth"]) + 1)
        a.plot(ks, r["acceptance_per_depth"], marker="o", label=name)
        b.plot(ks, r["mean_accepted_length"], marker="o", label=name)
    a.set(xlabel="depth", ylabel="conditional acceptance", title="acceptance per depth", ylim=(0, 1))
    b.set(xlabel="drafts k", ylabel="tokens per verification step", title="mean accepted length")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m train_mtp.evaluate", description=__doc__.split("\n")[0])
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--label", action="append")
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--data", required=True, help="corpus directory (python -m train_mtp.corpus)")
    ap.add_argument("--windows", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=128)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--out", help="write the markdown report here (and a PNG beside it)")
    ap.add_argument("--command", action="append", default=[], help="commands to list in the report")
    args = ap.parse_args(argv)
    labels = args.label or [Path(m).name for m in args.model]
    if len(labels) != len(args.model):
        raise SystemExit("give one --label per --model")
    test_ids = np.load(Path(args.data) / "test.npy")
    results = {}
    for label, path in zip(labels, args.model, strict=True):
        results[label] = evaluate(
            hcfjax.load(path, dtype=jnp.float32), test_ids, args.depth, args.windows, args.prefix, args.gen
        )
        print(label, json.dumps(results[label]))
    if args.out:
        out = Path(args.out)
        out.write_text(report(results, args.depth, args.command) + "\n")
        plot(results, out.with_suffix(".png"))
        (out.with_suffix(".json")).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
