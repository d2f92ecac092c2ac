"""Forced acceptance (benchmark only): verification accepts draft depth i with a given probability after depth i-1;
the token after the accepted drafts still follows them; serving refuses the knob; the step-cost benchmark's pieces."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hcfjax
from hcfjax.bench import generate as bench_generate
from hcfjax.bench import spec_step
from hcfjax.cli import build_parser
from hcfjax.engine import EngineConfig
from hcfjax.options import DEFAULT
from hcfjax.pd.prefill import PrefillConfig
from hcfjax.random_model import preset_config, random_model
from hcfjax.speculative import SpeculativeConfig
from hcfjax.verify import verify

K, V = 3, 8


@pytest.fixture(scope="module")
def two_heads():
    return random_model(
        preset_config("tiny-v3", num_hidden_layers=2, num_nextn_predict_layers=2), seed=7, dtype=jnp.float32
    )


def forced_verify(method: str, forced, rows: int, seed: int = 0):
    """verify() over `rows` rows whose target (greedy) picks token j at position j and whose drafts are token V-1,
    which the target never picks: unforced, no method accepts any. -> (n [rows], extra [rows])."""
    p = jnp.broadcast_to(jax.nn.one_hot(jnp.arange(K + 1), V), (rows, K + 1, V))
    d = jnp.full((rows, K), V - 1, jnp.int32)
    q = jax.nn.one_hot(d, V)  # greedy drafts' distributions
    keys = jax.random.split(jax.random.key(seed), rows)
    n, extra = verify((method,) * K, p, q, d, keys, forced=forced)
    return np.asarray(n), np.asarray(extra)


@pytest.mark.parametrize("method", ["exact", "rejection", "typical"])
def test_forced_one_accepts_every_draft_and_zero_none(method):
    n, extra = forced_verify(method, None, 64)
    assert (n == 0).all()  # the drafts are wrong: without forcing none passes
    n, extra = forced_verify(method, (1.0,) * K, 64)
    assert (n == K).all() and (extra == K).all()  # the bonus token is the target's own after all k drafts
    n, extra = forced_verify(method, (0.0,) * K, 64)
    assert (n == 0).all() and (extra == 0).all()


def test_forced_rates_are_conditional_per_depth_and_per_row():
    rows = 20000
    n, extra = forced_verify("exact", (0.5, 0.5, 0.5), rows, seed=1)
    assert (extra == n).all()  # the token after n accepted drafts is the target's at position n
    reached = [(n >= i).sum() for i in range(K + 1)]
    for i in range(1, K + 1):  # P(depth i accepted | depth i-1 accepted) = 0.5, within 4 standard deviations
        rate, m = reached[i] / reached[i - 1], reached[i - 1]
        assert abs(rate - 0.5) < 4 * np.sqrt(0.25 / m), (i, rate)
    n, _ = forced_verify("exact", (1.0, 0.3, 1.0), rows, seed=2)
    assert set(np.unique(n)) == {1, 3}  # depth 3 is certain only once depth 2 passed: conditional, not marginal
    assert abs((n == 3).mean() - 0.3) < 4 * np.sqrt(0.21 / rows)
    n_few, _ = forced_verify("exact", (1.0, 0.3, 1.0), 10, seed=2)
    np.testing.assert_array_equal(n_few, n[:10])  # each row draws from its own key, whatever the batch


def test_generate_with_forced_acceptance(two_heads):
    prompts = [[5, 9, 2, 33, 7], [8] * 13, [100, 3]]
    spec = SpeculativeConfig(2, forced_acceptance=(1.0, 1.0))
    out = hcfjax.generate(two_heads, prompts, max_new_tokens=13, stop_token_ids=[], speculative=spec)
    s = out.stats  # 13 tokens: the prefill's, then 4 steps of 3
    assert s["acceptance_per_depth"] == [1.0, 1.0] and s["mean_accepted_length"] == 3.0 and s["verify_steps"] == 12
    assert s["forced_acceptance"] == [1.0, 1.0]  # the stats say the acceptance was forced
    assert [len(t) for t in out.tokens] == [13] * 3


def test_bench_steps_are_one_executable_at_the_forced_rate(two_heads):
    """The benchmark's step loop: one compiled executable, nothing compiled while it runs (time_steps raises
    otherwise), and as many tokens per step as the forced acceptance gives."""
    state, dec = spec_step.prefilled(two_heads, batch=2, context=8, room=32, opts=DEFAULT)
    spec = SpeculativeConfig(2, forced_acceptance=(1.0, 1.0))
    start = spec_step.speculative_state(state, two_heads, 2)
    step_s, tokens = spec_step.time_steps(two_heads, start, dec, spec, DEFAULT, steps=2)
    assert tokens == 3.0 and step_s > 0
    assert spec_step.expected_tokens_per_step((0.85, 0.65)) == pytest.approx(1 + 0.85 + 0.85 * 0.65)


def test_serving_refuses_forced_acceptance():
    forced = SpeculativeConfig(2, forced_acceptance=(0.9, 0.5))
    with pytest.raises(ValueError, match="benchmarks only"):
        EngineConfig(speculative=forced)
    with pytest.raises(ValueError, match="benchmarks only"):
        dataclasses.replace(EngineConfig(speculative=SpeculativeConfig(2)), speculative=forced)
    with pytest.raises(ValueError, match="benchmarks only"):
        PrefillConfig(speculative=forced)
    with pytest.raises(SystemExit):  # `hcfjax serve` has no flag for it
        build_parser().parse_args(["serve", "--speculative", "2", "--forced-acceptance", "0.9,0.5"])


def test_bad_forced_acceptance():
    for rates in [(0.5,), (0.5, 1.5), (-0.1, 0.5), [0.5, 0.5]]:
        with pytest.raises(ValueError, match="forced_acceptance"):
            SpeculativeConfig(2, forced_acceptance=rates)
    with pytest.raises(SystemExit):  # the bench asks for the rates with --speculative
        bench_generate.main(["--speculative", "2"])
