"""transformers loads what hcfjax.save writes. The fixture step (tests/fixtures/make_roundtrip.py, with torch) has
transformers' DeepseekV3ForCausalLM / DeepseekV2ForCausalLM load checkpoints written by hcfjax.save in float32 and
bfloat16, checks their logits against hcfjax's, and records the config.json, the tensors and transformers' logits.
Here, without torch: hcfjax.save still writes exactly that config and those tensors, and hcfjax's logits of them
still match transformers'."""

import json

import numpy as np
import pytest

from hcfjax.checkpoint import checkpoint_headers
from tests.conftest import FIXTURES, rel_err
from tests.fixtures.roundtrip_hcfjax import CASES, MODELS, TOLERANCE, input_ids, save_fixture, saved_logits

RECORD = FIXTURES / "roundtrip"
RERUN = "what transformers loaded: where the change is meant, run tests/fixtures/make_roundtrip.py again"


@pytest.fixture(scope="module", params=list(MODELS))
def saved(request, tmp_path_factory):
    """(fixture name, saved dtype -> the directory hcfjax.save wrote it to)."""
    name = request.param
    return name, save_fixture(name, tmp_path_factory.mktemp(name))


def test_save_writes_what_transformers_loaded(saved):
    name, dirs = saved
    record = json.loads((RECORD / "results.json").read_text())["models"][name]
    assert record["architecture"] == MODELS[name]
    for dtype, d in dirs.items():
        written = record["saved"][dtype]
        assert json.loads((d / "config.json").read_text()) == written["config"], f"{dtype} config.json is not {RERUN}"
        tensors = {n: f"{e.dtype} {'x'.join(map(str, e.shape))}" for n, e in checkpoint_headers(d).items()}
        assert tensors == written["tensors"], f"{dtype} tensors are not {RERUN}"


def test_logits_match_transformers(saved):
    name, dirs = saved
    transformers = np.load(RECORD / "transformers_logits.npz")
    # The fixture's ids are those transformers ran: the fixture models are the ones the record was made from.
    assert np.array_equal(input_ids(name), transformers[f"{name}/ids"])
    logits = saved_logits(name, dirs)
    errors = {case: rel_err(logits[case], transformers[f"{name}/{case}"]) for case in CASES}
    assert all(errors[case] < TOLERANCE[case] for case in CASES), f"relative errors {errors}, tolerance {TOLERANCE}"
