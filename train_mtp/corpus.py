"""The training corpus: the Python standard library's own source, split by file, and a byte-level BPE tokenizer.

    python -m train_mtp.corpus --out DIR [--vocab-size 4096] [--seed 0] [--tokenizer FILE]

writes DIR/tokenizer.json (trained on the train split only, or FILE's), DIR/{train,validation,test}.npy (uint16
token streams, each file wrapped in <bos> ... <eos>) and DIR/splits.json (which file went where). The trained
tokenizer depends on the stdlib of the Python that runs this; `--tokenizer hcfjax/assets/stdlib-v3/tokenizer.json`
tokenizes any stdlib as the embedded model was trained (what bench.quality needs on another machine).
"""

from __future__ import annotations

import argparse
import json
import random
import sysconfig
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ("<bos>", "<eos>")  # ids 0 and 1
SPLITS = ("train", "validation", "test")


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """Lib/**/*.py of the running interpreter (installed third-party packages excluded), sorted."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = [f for f in root.rglob("*.py") if "site-packages" not in f.relative_to(root).parts]
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def split_files(files: list[Path], seed: int = 0, fractions=(0.9, 0.05, 0.05)) -> dict[str, list[Path]]:
    """Deterministic split by file (never inside a file), so held-out text is unseen code."""
    order = list(files)
    random.Random(seed).shuffle(order)
    n_val = max(1, round(fractions[1] * len(order)))
    n_test = max(1, round(fractions[2] * len(order)))
    n_train = len(order) - n_val - n_test
    if n_train < 1:
        raise ValueError(f"need at least 3 files to split, got {len(order)}")
    parts = {"train": order[:n_train], "validation": order[n_train : n_train + n_val], "test": order[n_train + n_val :]}
    return {k: sorted(v) for k, v in parts.items()}


def read(file: Path) -> str:
    return file.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(files: list[Path], vocab_size: int = 4096) -> Tokenizer:
    """Byte-level BPE (lossless on any text) trained on `files`; <bos>=0, <eos>=1."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator((read(f) for f in files), trainer=trainer, length=len(files))
    return tok


def encode_files(tok: Tokenizer, files: list[Path]) -> np.ndarray:
    """One token stream: <bos> file <eos> <bos> file <eos> ... as uint16 (vocab must fit)."""
    if tok.get_vocab_size() > 65536:
        raise ValueError("uint16 token streams need a vocabulary of at most 65536")
    bos, eos = (tok.token_to_id(s) for s in SPECIALS)
    out = []
    for enc in tok.encode_batch([read(f) for f in files]):
        out += [bos, *enc.ids, eos]
    return np.asarray(out, np.uint16)


def build(out: str | Path, vocab_size: int = 4096, seed: int = 0, root=None, tokenizer=None) -> dict:
    """The corpus in `out`; with `tokenizer` (a tokenizer.json) that tokenizer instead of one trained here."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    root = Path(root or sysconfig.get_paths()["stdlib"])
    splits = split_files(stdlib_files(root), seed)
    if tokenizer is None:
        tok = train_tokenizer(splits["train"], vocab_size)
    else:
        tok = Tokenizer.from_file(str(tokenizer))
        if any(tok.token_to_id(s) != i for i, s in enumerate(SPECIALS)):
            raise ValueError(f"{tokenizer}: the corpus needs {SPECIALS} as ids 0 and 1")
    tok.save(str(out / "tokenizer.json"))
    sizes = {}
    for name in SPLITS:
        ids = encode_files(tok, splits[name])
        np.save(out / f"{name}.npy", ids)
        sizes[name] = {"files": len(splits[name]), "tokens": int(ids.size)}
    manifest = {
        "root": str(root),
        "seed": seed,
        "vocab_size": tok.get_vocab_size(),
        "sizes": sizes,
        "files": {k: [f.relative_to(root).as_posix() for f in v] for k, v in splits.items()},
    }
    (out / "splits.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m train_mtp.corpus", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--root", help="library root (default: this interpreter's stdlib)")
    ap.add_argument("--tokenizer", help="use this tokenizer.json instead of training one (--vocab-size is ignored)")
    args = ap.parse_args(argv)
    manifest = build(args.out, args.vocab_size, args.seed, args.root, args.tokenizer)
    print(json.dumps(manifest["sizes"]), "vocab", manifest["vocab_size"])


if __name__ == "__main__":
    main()
