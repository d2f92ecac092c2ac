"""MTP speculative decoding: greedy equivalence, rejection sampling's distribution, the typical rule, rollback."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hcfjax
from hcfjax import cache as kvcache
from hcfjax.generate import bucket, prefill
from hcfjax.random_model import preset_config, random_model
from hcfjax.sampling import SamplingBatch, SamplingParams
from hcfjax.speculative import SpeculativeConfig, dynamic_probs, speculative_decode
from hcfjax.verify import typical_threshold, verify

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, x):", "x", "for i in range(10):"]


@pytest.fixture(scope="module")
def embedded():
    return hcfjax.load(dtype=jnp.float32)


@pytest.fixture(scope="module")
def three_heads():
    """A random V3 model with three independent MTP modules (depth i uses module i)."""
    return random_model(
        preset_config("tiny-v3", num_hidden_layers=2, num_nextn_predict_layers=3), seed=5, dtype=jnp.float32
    )


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_greedy_exact_equals_plain_greedy(embedded, k):
    plain = hcfjax.generate(embedded, PROMPTS, max_new_tokens=24, stop_token_ids=[])
    spec = hcfjax.generate(
        embedded,
        PROMPTS,
        max_new_tokens=24,
        stop_token_ids=[],
        speculative=SpeculativeConfig(num_draft_tokens=k, method="exact"),
    )
    assert spec.tokens == plain.tokens
    s = spec.stats
    assert len(s["acceptance_per_depth"]) == k and all(0 <= a <= 1 for a in s["acceptance_per_depth"])
    assert 1 <= s["mean_accepted_length"] <= k + 1 and len(s["per_request"]) == len(PROMPTS)
    assert s["acceptance_per_depth"][0] > 0.3  # the trained joint MTP layer does draft real tokens


def test_mtp_head_norm_flag_changes_drafts_not_outputs(embedded):
    kw = dict(max_new_tokens=24, stop_token_ids=[])
    plain = hcfjax.generate(embedded, PROMPTS, **kw)
    normed = hcfjax.generate(embedded, PROMPTS, **kw, speculative=SpeculativeConfig(2))
    bare = hcfjax.generate(embedded, PROMPTS, **kw, speculative=SpeculativeConfig(2, mtp_head_norm=False))
    assert bare.tokens == plain.tokens
    assert bare.stats["acceptance_per_depth"] != normed.stats["acceptance_per_depth"]


@pytest.mark.parametrize("k", [2, 4])
def test_greedy_exact_with_independent_modules_and_stops(three_heads, k):
    prompts = [[5, 9, 2, 33, 7], [8] * 13, [100, 3]]
    plain = hcfjax.generate(three_heads, prompts, max_new_tokens=20, stop_token_ids=[])
    spec = hcfjax.generate(
        three_heads, prompts, max_new_tokens=20, stop_token_ids=[], speculative=SpeculativeConfig(num_draft_tokens=k)
    )
    assert spec.tokens == plain.tokens
    stop = plain.tokens[1][6]
    plain_s = hcfjax.generate(three_heads, prompts, max_new_tokens=20, stop_token_ids=[stop])
    spec_s = hcfjax.generate(
        three_heads,
        prompts,
        max_new_tokens=20,
        stop_token_ids=[stop],
        speculative=SpeculativeConfig(num_draft_tokens=k),
    )
    assert spec_s.tokens == plain_s.tokens and spec_s.tokens[1][-1] == stop


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


@pytest.mark.parametrize(
    "method,extra",
    [
        ("rejection", {}),
        ("typical", {}),
        ("tuned", {}),
        ("tuned", dict(dynamic_temperature=(0.5, 1.0), position_methods=("typical", "rejection", "exact"))),
    ],
)
def test_sampled_methods_run_and_report(embedded, method, extra):
    spec = SpeculativeConfig(num_draft_tokens=3, method=method, **extra)
    out = hcfjax.generate(
        embedded,
        PROMPTS[:3],
        max_new_tokens=16,
        stop_token_ids=[],
        seed=3,
        sampling=SamplingParams(temperature=0.8, top_p=0.95),
        speculative=spec,
    )
    assert [len(t) for t in out.tokens] == [16] * 3
    assert all(0 <= t < embedded.cfg.vocab_size for row in out.tokens for t in row)
    assert out.stats["verify_steps"] >= 3 * 15 / 4 and len(out.stats["acceptance_per_depth"]) == 3


def test_rollback_leaves_exactly_the_accepted_entries(embedded):
    """After decoding with partly rejected drafts, every cached position below the final length equals a fresh
    prefill of prompt + output (rejected drafts' entries lie beyond the length and are never read)."""
    m, cfg = embedded, embedded.cfg
    prompt = [0] + m.tokenizer.encode("def walk(top):\n    for name in").ids
    t, page, new, k = bucket(len(prompt)), 16, 16, 3
    n_layers = cfg.num_hidden_layers + 1
    table = jnp.arange(4)[None]
    tokens = jnp.asarray([prompt + [0] * (t - len(prompt))])
    lengths = jnp.asarray([len(prompt)])
    sp = SamplingBatch.of([SamplingParams()])
    cache = kvcache.init_cache(cfg, 4, page, jnp.float32, num_layers=n_layers)
    first, cache, h = prefill(m.params, cfg, tokens, lengths, cache, table, sp, jax.random.key(0), return_hidden=True)
    out, stats, cache = speculative_decode(
        m.params,
        cfg,
        SpeculativeConfig(num_draft_tokens=k),
        h,
        tokens,
        first,
        lengths,
        cache,
        table,
        sp,
        jax.random.key(1),
        jnp.array([-1]),
        new,
    )
    steps, accepted = int(stats["steps"][0]), int(stats["accepted"][0].sum())
    assert steps < new - 1 and accepted < steps * k  # some drafts accepted, some rejected
    full = prompt + [int(x) for x in out[0]]
    n = len(full) - 1  # the last emitted token is not in the cache yet
    ref = kvcache.init_cache(cfg, 4, page, jnp.float32, num_layers=n_layers)
    padded = jnp.asarray([full[:n] + [0] * (bucket(n) - n)])
    _, ref = prefill(m.params, cfg, padded, jnp.asarray([n]), ref, table, sp, jax.random.key(0))
    got = np.asarray(cache.kv[: cfg.num_hidden_layers, :4]).reshape(cfg.num_hidden_layers, -1, cfg.kv_dim)[:, :n]
    want = np.asarray(ref.kv[: cfg.num_hidden_layers, :4]).reshape(cfg.num_hidden_layers, -1, cfg.kv_dim)[:, :n]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_bad_speculative_configs(embedded):
    for kwargs in [
        dict(num_draft_tokens=0),
        dict(method="greedy"),
        dict(draft_temperature_scale=-1.0),
        dict(method="exact", position_methods=("typical", "exact")),
        dict(method="tuned", num_draft_tokens=2, position_methods=("typical",)),
    ]:
        with pytest.raises(ValueError):
            SpeculativeConfig(**kwargs)
    no_mtp = hcfjax.load(dtype=jnp.float32, mtp=False)
    with pytest.raises(ValueError, match="MTP"):
        hcfjax.generate(no_mtp, ["x"], max_new_tokens=4, speculative=SpeculativeConfig())


def test_rejection_end_to_end_matches_the_target_on_a_tiny_vocabulary():
    """Through the whole jitted loop: 4000 rows of one prompt sample a first token at prefill, then a speculative
    step emits the second. Among rows with the most common first token, the second token's empirical distribution
    must match the target's p(. | prompt, first), although the random MTP drafts follow a different distribution."""
    cfg = preset_config("tiny-v3", vocab_size=8, num_hidden_layers=2, bos_token_id=None, eos_token_id=None)
    model = random_model(cfg, seed=11, dtype=jnp.float32)
    prompt, n = [1, 5, 2, 7, 3], 4000
    out = hcfjax.generate(
        model,
        [prompt] * n,
        max_new_tokens=3,
        sampling=SamplingParams(temperature=1.0),
        seed=4,
        stop_token_ids=[],
        speculative=SpeculativeConfig(num_draft_tokens=2, method="rejection"),
    )
    toks = np.array(out.tokens)
    t0 = np.bincount(toks[:, 0], minlength=8).argmax()
    rows = toks[toks[:, 0] == t0]
    target = np.asarray(jax.nn.softmax(hcfjax.forward(model, [prompt + [int(t0)]])[0, -1]))
    assert len(rows) > 300 and out.stats["acceptance_per_depth"][0] < 0.95  # drafts do get rejected
    assert chi_square(np.bincount(rows[:, 1], minlength=8), target) < 24.32  # chi-square, 7 dof, p = 0.001
