"""Parity with transformers' DeepseekV3ForCausalLM / DeepseekV2ForCausalLM (fixtures from tests/fixtures/)."""

import jax.numpy as jnp
import numpy as np

import hcfjax
from hcfjax.model import hidden_states, mtp_module
from tests.conftest import rel_err


def test_logits_match_transformers(parity_case):
    model, ref = parity_case
    logits = hcfjax.forward(model, ref["ids"])
    assert logits.dtype == jnp.float32 and logits.shape == ref["logits"].shape
    assert rel_err(logits, ref["logits"]) < 1e-4


def test_greedy_matches_transformers(parity_case):
    model, ref = parity_case
    prompts = [list(p) for p in ref["prompt"]]
    out = hcfjax.generate(model, prompts, max_new_tokens=ref["greedy"].shape[1], stop_token_ids=[])
    assert out.tokens == [list(map(int, g)) for g in ref["greedy"]]


def test_mtp_module_matches_transformers_block(v3_model):
    """MTP module 0 (enorm, hnorm, eh_proj, a decoder block, shared_head) against the same composition built
    from transformers' DeepseekV3DecoderLayer in the fixture script."""
    ref = np.load("tests/fixtures/tiny_v3/reference.npz")
    ids = jnp.asarray(ref["ids"])
    pos = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
    p = v3_model.params
    h, _ = hidden_states(p, v3_model.cfg, ids, pos)
    _, logits, _ = mtp_module(p["mtp"][0], v3_model.cfg, 0, h[:, :-1], ids[:, 1:], pos[:, 1:], p["embed"])
    assert rel_err(logits, ref["mtp_logits"]) < 1e-4
