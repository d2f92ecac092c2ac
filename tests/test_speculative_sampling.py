"""Speculative decoding's sampling: rejection sampling preserves the target distribution (chi-square, with a
biased verifier as the negative control), the exact and typical rules, dynamic temperature, and the whole jitted loop
on a tiny vocabulary."""

import jax
import jax.numpy as jnp
import numpy as np

import hcfjax
from hcfjax.random_model import preset_config, random_model
from hcfjax.sampling import SamplingBatch, SamplingParams
from hcfjax.speculative import SpeculativeConfig, dynamic_probs
from hcfjax.verify import typical_threshold, verify


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


CHI2_DF4_P001 = 18.47  # chi-square critical value, 4 degrees of freedom, p = 0.001


def draw_and_verify(methods, p, q, n_trials, seed):
    """Drafts sampled from q, verified against p, many independent trials; returns (first, second, n)."""

    def one(key):
        k_draft, k_verify = jax.random.split(key)
        d = jax.random.categorical(k_draft, jnp.log(q))[None]  # [1, k]
        n, extra = verify(methods, p[None], q[None], d.astype(jnp.int32), k_verify)
        emitted = jnp.concatenate([d[0], d[0, :1]]).at[n[0]].set(extra[0])
        return emitted[0], emitted[1], n[0]

    return [np.asarray(x) for x in jax.vmap(one)(jax.random.split(jax.random.key(seed), n_trials))]


def test_rejection_sampling_preserves_the_target_distribution():
    p = jnp.array([[0.4, 0.3, 0.15, 0.1, 0.05], [0.05, 0.05, 0.2, 0.3, 0.4], [0.2] * 5])
    q = jnp.array([[0.1, 0.1, 0.2, 0.3, 0.3], [0.6, 0.1, 0.1, 0.1, 0.1]])  # far from p
    first, second, n = draw_and_verify(("rejection", "rejection"), p, q, 40000, seed=0)
    assert chi_square(np.bincount(first, minlength=5), np.asarray(p[0])) < CHI2_DF4_P001
    # given the first draft was accepted, the second emitted token follows p_1
    assert chi_square(np.bincount(second[n >= 1], minlength=5), np.asarray(p[1])) < CHI2_DF4_P001
    assert 0 < (n == 0).mean() < 1 and (n == 2).any()


def test_chi_square_catches_a_biased_verifier():
    """The check above can fail: typical acceptance, which does not preserve the target distribution, fails it on
    the same inputs (drafts favouring tokens 3 and 4 are accepted whenever p clears the threshold)."""
    p = jnp.array([[0.4, 0.3, 0.15, 0.1, 0.05], [0.2] * 5])
    q = jnp.array([[0.1, 0.1, 0.2, 0.3, 0.3]])
    first, _, _ = draw_and_verify(("typical",), p, q, 40000, seed=1)
    assert chi_square(np.bincount(first, minlength=5), np.asarray(p[0])) > 10 * CHI2_DF4_P001


def test_exact_method_with_sampling_preserves_the_target_distribution():
    p = jnp.array([[0.4, 0.3, 0.15, 0.1, 0.05], [0.2] * 5])
    q = jnp.array([[0.1, 0.1, 0.2, 0.3, 0.3]])
    first, _, _ = draw_and_verify(("exact",), p, q, 40000, seed=2)
    assert chi_square(np.bincount(first, minlength=5), np.asarray(p[0])) < CHI2_DF4_P001


def test_typical_acceptance_rule():
    p = jnp.array([[[0.5, 0.3, 0.1, 0.06, 0.04], [0.5, 0.3, 0.1, 0.06, 0.04], [0.2] * 5]])
    entropy = -np.sum(np.array(p[0, 0]) * np.log(np.array(p[0, 0])))
    thr = min(0.09, 0.3 * np.exp(-entropy))
    assert np.isclose(float(typical_threshold(p[0, 0], 0.09, 0.3)), thr)
    q = jnp.full((1, 2, 5), 0.2)
    for d0, expect_accept in [(0, True), (2, 0.1 > thr), (4, 0.04 > thr)]:
        n, extra = verify(("typical", "typical"), p, q, jnp.array([[d0, 0]]), jax.random.key(0))
        assert bool(n[0] >= 1) == expect_accept, (d0, thr)
    # with a flat target every token clears the threshold, whatever the draft distribution
    n, _ = verify(("typical", "typical"), p[:, [2, 2, 2]], q, jnp.array([[3, 1]]), jax.random.key(1))
    assert int(n[0]) == 2


def test_dynamic_temperature_sharpens_confident_positions():
    lg = jnp.log(jnp.array([[[0.9, 0.05, 0.03, 0.02], [0.3, 0.25, 0.25, 0.2]]]))
    sp = SamplingBatch.of([SamplingParams(temperature=1.0)])
    p = dynamic_probs(lg, sp, 0.3, 1.5)
    # confident row: normalised entropy 0.31 -> temperature 0.67 -> sharper; flat row: ~1.5 -> flatter
    assert float(p[0, 0, 0]) > 0.97 and float(p[0, 1, 0]) < 0.29
    greedy = dynamic_probs(lg, SamplingBatch.of([SamplingParams()]), 0.3, 1.5)
    assert np.array_equal(np.asarray(greedy[0, :, 0]), [1.0, 1.0])


def test_rejection_end_to_end_matches_the_target_on_a_tiny_vocabulary():
    """Through the whole jitted loop: 1024 rows of one prompt sample a first token at prefill, then a speculative
    step emits the second. Among rows with the most common first token (about 570 of them), the second token's
    empirical distribution must match the target's p(. | prompt, first), although the random MTP drafts follow a
    different distribution (about 40% of them are rejected). The model is narrower than tiny-v3, which runs the rows
    faster: the distributions are under test, not the width."""
    narrow = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, q_lora_rank=32, kv_lora_rank=32)
    cfg = preset_config("tiny-v3", vocab_size=8, num_hidden_layers=2, bos_token_id=None, eos_token_id=None, **narrow)
    model = random_model(cfg, seed=11, dtype=jnp.float32)
    prompt, n = [1, 5, 2, 7, 3], 1024
    out = hcfjax.generate(
        model,
        [prompt] * n,
        max_new_tokens=3,
        sampling=SamplingParams(temperature=1.0),
        seed=4,
        stop_token_ids=[],
        max_prefill_tokens=16 * n,  # one prefill program for all rows
        speculative=SpeculativeConfig(num_draft_tokens=2, method="rejection"),
    )
    toks = np.array(out.tokens)
    t0 = np.bincount(toks[:, 0], minlength=8).argmax()
    rows = toks[toks[:, 0] == t0]
    target = np.asarray(jax.nn.softmax(hcfjax.forward(model, [prompt + [int(t0)]])[0, -1]))
    assert len(rows) > 300 and out.stats["acceptance_per_depth"][0] < 0.8  # drafts do get rejected
    assert chi_square(np.bincount(rows[:, 1], minlength=8), target) < 24.32  # chi-square, 7 dof, p = 0.001
