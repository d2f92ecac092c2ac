"""The embedded model: a trained DeepSeek-V3-architecture checkpoint that transformers reads identically."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hcfjax
from tests.conftest import FIXTURES, rel_err


@pytest.fixture(scope="module")
def embedded():
    return hcfjax.load(dtype=jnp.float32)


def test_default_model_is_small_and_v3_shaped(embedded):
    files = list(Path(hcfjax.DEFAULT_MODEL).iterdir())
    assert {f.name for f in files} == {"config.json", "model.safetensors", "tokenizer.json"}
    assert sum(f.stat().st_size for f in files) <= 16 * 2**20
    cfg = embedded.cfg
    assert cfg.q_lora_rank and cfg.topk_method == "noaux_tc" and cfg.n_group > 1 and cfg.n_shared_experts
    assert cfg.first_k_dense_replace >= 1 and cfg.num_mtp_layers == 1 and len(embedded.params["mtp"]) == 1


def test_embedded_model_matches_transformers(embedded):
    ref = np.load(FIXTURES / "stdlib_v3_reference.npz")
    assert rel_err(hcfjax.forward(embedded, ref["ids"]), ref["logits"]) < 1e-4
    out = hcfjax.generate(embedded, [list(ref["ids"][0])], max_new_tokens=ref["greedy"].shape[1], stop_token_ids=[])
    assert out.tokens[0] == list(map(int, ref["greedy"][0]))


def test_embedded_model_predicts_python(embedded):
    """Trained, not random: perplexity on unseen stdlib-style code is far below the vocabulary size (4096)."""
    code = (
        "def read_lines(path):\n    with open(path, encoding='utf-8') as f:\n        return [line.rstrip('\\n') "
        "for line in f]\n\n\nclass Counter:\n    def __init__(self):\n        self.count = 0\n\n"
        "    def increment(self):\n        self.count += 1\n        return self.count\n"
    )
    ids = [0] + embedded.tokenizer.encode(code).ids
    logp = np.asarray(jax.nn.log_softmax(hcfjax.forward(embedded, [ids])[0, :-1], axis=-1))
    nll = -np.mean(logp[np.arange(len(ids) - 1), ids[1:]])
    assert np.exp(nll) < 20


def test_cli_uses_the_embedded_model(capsys):
    from hcfjax import cli

    assert cli.main(["generate", "--prompt", "import os\n", "--max-new-tokens", "8"]) == 0
    assert capsys.readouterr().out.startswith("import os\n")


@pytest.mark.parametrize(
    "tokens,message",
    [
        ([[1, 2, 4096]], "token id 4096 is outside the vocabulary"),  # the embedding's gather would clamp it
        (jnp.asarray([[1, -1]]), "token id -1 is outside the vocabulary"),
        ([[1, 2, 3], [4]], "rows of one length"),
        (np.asarray([[2**32 + 5]]), "token id 4294967301 is outside"),  # not wrapped into range by a cast
        ("def f", "integer ids"),
    ],
)
def test_forward_refuses_what_it_cannot_run(embedded, tokens, message):
    with pytest.raises(ValueError, match=message):
        hcfjax.forward(embedded, tokens)
