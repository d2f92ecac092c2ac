"""train_mtp.corpus: deterministic by-file splits and a lossless byte-level BPE tokenizer."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer

from train_mtp import corpus


def make_lib(tmp_path, n=12):
    root = tmp_path / "Lib"
    for i in range(n):
        d = root / ("pkg" if i % 3 == 0 else "") / f"mod{i}.py"
        d.parent.mkdir(parents=True, exist_ok=True)
        d.write_text(f"def f{i}(x):\n    return x * {i}  # é ünïcode\n" * (i + 1))
    (root / "site-packages" / "third.py").parent.mkdir(parents=True)
    (root / "site-packages" / "third.py").write_text("x = 1\n")
    return root


def test_splits_are_deterministic_disjoint_and_complete(tmp_path):
    root = make_lib(tmp_path)
    files = corpus.stdlib_files(root)
    assert len(files) == 12 and all("site-packages" not in f.parts for f in files)
    a, b = corpus.split_files(files, seed=3), corpus.split_files(files, seed=3)
    assert a == b
    assert sorted(sum(a.values(), [])) == sorted(files)
    assert not set(a["train"]) & set(a["test"]) and not set(a["validation"]) & set(a["test"])
    assert corpus.split_files(files, seed=4) != a


def test_tokenizer_is_lossless_and_streams_are_framed(tmp_path):
    root = make_lib(tmp_path)
    manifest = corpus.build(tmp_path / "out", vocab_size=300, seed=0, root=root)
    tok = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    assert tok.token_to_id("<bos>") == 0 and tok.token_to_id("<eos>") == 1
    text = "class Ünï:\n\tdef __init__(self):  # 漢字\n        pass\n"
    assert tok.decode(tok.encode(text).ids) == text
    test = np.load(tmp_path / "out" / "test.npy")
    assert test[0] == 0 and test[-1] == 1 and (test == 0).sum() == manifest["sizes"]["test"]["files"]


def test_a_given_tokenizer_replaces_training(tmp_path):
    """--tokenizer: another library is tokenized with the given tokenizer (as bench.quality needs the embedded
    model's on a machine whose stdlib would train another), not with one trained on it."""
    corpus.build(tmp_path / "a", vocab_size=300, root=make_lib(tmp_path / "x", n=12))
    given = tmp_path / "a" / "tokenizer.json"
    other = make_lib(tmp_path / "y", n=15)
    corpus.build(tmp_path / "b", vocab_size=300, root=other)
    corpus.build(tmp_path / "c", root=other, tokenizer=given)
    a, b, c = (Tokenizer.from_file(str(tmp_path / d / "tokenizer.json")).get_vocab() for d in "abc")
    assert c == a and b != a
    tok = Tokenizer.from_file(str(given))
    test = np.load(tmp_path / "c" / "test.npy")
    first = corpus.split_files(corpus.stdlib_files(other))["test"][0]
    assert list(test[1 : test.tolist().index(1)]) == tok.encode(corpus.read(first)).ids
    with pytest.raises(ValueError, match="ids 0 and 1"):
        corpus.build(tmp_path / "d", root=other, tokenizer=_without_specials(tok, tmp_path / "bad.json"))


def _without_specials(tok, path):
    """A copy of `tok` whose ids 0 and 1 are ordinary tokens."""
    data = json.loads(tok.to_str())
    data["added_tokens"] = []
    vocab = data["model"]["vocab"]
    vocab["zz0"], vocab["zz1"] = vocab.pop("<bos>"), vocab.pop("<eos>")
    path.write_text(json.dumps(data))
    return path
