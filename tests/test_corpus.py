"""train_mtp.corpus: deterministic by-file splits and a lossless byte-level BPE tokenizer."""

import numpy as np

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
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tmp_path / "out" / "tokenizer.json"))
    assert tok.token_to_id("<bos>") == 0 and tok.token_to_id("<eos>") == 1
    text = "class Ünï:\n\tdef __init__(self):  # 漢字\n        pass\n"
    assert tok.decode(tok.encode(text).ids) == text
    test = np.load(tmp_path / "out" / "test.npy")
    assert test[0] == 0 and test[-1] == 1 and (test == 0).sum() == manifest["sizes"]["test"]["files"]
