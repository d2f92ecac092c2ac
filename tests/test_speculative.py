"""MTP speculative decoding: greedy equivalence, the methods end to end, rollback (sampling rules: the other file)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hcfjax
from hcfjax import cache as kvcache
from hcfjax.generate import bucket
from hcfjax.sampling import SamplingBatch, SamplingParams
from hcfjax.speculative import SpeculativeConfig, mtp_extend
from hcfjax.step import DecodeInputs, PrefillInputs, decode_steps, empty_state, jitted_step

# (the run of one letter: drafts accepted at every depth, the reused module's included)
PROMPTS = [
    "def fibonacci(n):",
    "import os\n",
    "class Stack:\n    def push(self, x):",
    "x",
    "for i in range(10):",
    "a" * 16,
]


@pytest.fixture(scope="module")
def embedded():
    return hcfjax.load(dtype=jnp.float32)


def prefilled(model, prompt, cache, table, sp: SamplingParams, spec=None, seed=0):
    """One slot after a prefill step over `prompt` (the first token, and with spec the first drafts)."""
    t = bucket(len(prompt))
    i32 = lambda *x: jnp.asarray(x, jnp.int32)  # noqa: E731
    pre = PrefillInputs(
        jnp.asarray([prompt + [0] * (t - len(prompt))]),
        i32(0),
        i32(len(prompt)),
        table,
        i32(0),
        SamplingBatch.of([sp]),
        jnp.asarray([seed], jnp.uint32),
        i32(0),
    )
    state = empty_state(model.cfg, 1, cache, spec, model.dtype)
    return jitted_step(model.params, model.cfg, state, pre, None, spec)[0]


@pytest.fixture(scope="module")
def greedy(embedded):
    """(want, run): plain greedy decoding's tokens for PROMPTS, 24 each, cut after the first `stop` in each row (a
    token that ends one row early and leaves others to run to the limit); run(spec) is generate's result under that
    speculative config, with `stop` as the stop token (each config run once, for the tests that compare them)."""
    plain = hcfjax.generate(embedded, PROMPTS, max_new_tokens=24, stop_token_ids=[]).tokens
    stop = plain[1][6]
    want = [row[: row.index(stop) + 1] if stop in row else row for row in plain]
    assert len(want[1]) < 24 and any(len(row) == 24 for row in want)

    @functools.cache
    def run(spec: SpeculativeConfig):
        return hcfjax.generate(embedded, PROMPTS, max_new_tokens=24, stop_token_ids=[stop], speculative=spec)

    return want, run


# k = 1 and 5 (the one trained module drafting alone, and reused for depths 2..5), stop token included; k = 2 runs
# in the engine and PD tests, independent modules at depths 2..5 in test_speculative_depths
@pytest.mark.parametrize("k", [1, 5])
def test_greedy_exact_equals_plain_greedy(greedy, k):
    want, run = greedy
    spec = run(SpeculativeConfig(num_draft_tokens=k, method="exact"))
    assert spec.tokens == want
    s = spec.stats
    assert len(s["acceptance_per_depth"]) == k and all(0 <= a <= 1 for a in s["acceptance_per_depth"])
    assert 1 <= s["mean_accepted_length"] <= k + 1 and len(s["per_request"]) == len(PROMPTS)
    assert s["acceptance_per_depth"][0] > 0.3  # the trained joint MTP layer does draft real tokens
    assert min(s["acceptance_per_depth"]) > 0  # every depth's drafts accepted somewhere: the reuse chain is checked


def test_mtp_head_norm_flag_changes_drafts_not_outputs(greedy):
    want, run = greedy
    normed = run(SpeculativeConfig(1, method="exact"))
    bare = run(SpeculativeConfig(1, method="exact", mtp_head_norm=False))
    assert bare.tokens == want
    assert bare.stats["acceptance_per_depth"] != normed.stats["acceptance_per_depth"]


@pytest.mark.parametrize(
    "method,extra",
    [
        ("typical", {}),
        ("tuned", dict(dynamic_temperature=(0.5, 1.0), position_methods=("typical", "rejection", "exact"))),
    ],
)
def test_sampled_methods_run_and_report(embedded, method, extra):
    """Sampled verification runs and reports its acceptance. Rejection alone is tested elsewhere: its distribution in
    test_speculative_sampling, its batch independence in test_engine."""
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
    page, new, k = 16, 16, 3
    n_layers = cfg.num_hidden_layers + 1
    table = jnp.arange(4)[None]
    sp = SamplingParams()
    spec = SpeculativeConfig(num_draft_tokens=k)
    state = prefilled(m, prompt, kvcache.init_cache(cfg, 4, page, jnp.float32, num_layers=n_layers), table, sp, spec)
    dec = DecodeInputs(jnp.array([True]), table, SamplingBatch.of([sp]), jnp.zeros(1, jnp.uint32))
    decode = jax.jit(decode_steps, static_argnames=("cfg", "max_new_tokens", "spec"))
    out, stats, state = decode(m.params, cfg, state, dec, jnp.array([-1]), new, spec)
    cache = state.cache
    steps, accepted = int(stats["steps"][0]), int(stats["accepted"][0].sum())
    assert steps < new - 1 and accepted < steps * k  # some drafts accepted, some rejected
    full = prompt + [int(x) for x in out[0]]
    n = len(full) - 1  # the last emitted token is not in the cache yet
    ref = prefilled(m, full[:n], kvcache.init_cache(cfg, 4, page, jnp.float32, num_layers=n_layers), table, sp).cache
    got = np.asarray(cache.kv[: cfg.num_hidden_layers, :4]).reshape(cfg.num_hidden_layers, -1, cfg.kv_dim)[:, :n]
    want = np.asarray(ref.kv[: cfg.num_hidden_layers, :4]).reshape(cfg.num_hidden_layers, -1, cfg.kv_dim)[:, :n]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_mtp_over_the_paged_cache_equals_the_training_view(embedded):
    """Depth 1 over a prompt through the paged cache (what spec_prefill runs) gives the logits of train_mtp's
    cache-free chain: the module attends to exactly the anchors 0..t. The cache starts full of garbage, as a reused
    page would be, so a slot read before it is written (the module's first position, say) fails the comparison."""
    from train_mtp.heads import base_hidden, chain_logits

    cfg, params = embedded.cfg, embedded.params
    t, page = 40, 16
    tokens = jnp.asarray(np.random.default_rng(0).integers(2, cfg.vocab_size, (1, t + 1)), jnp.int32)
    # each side one compiled program (as the model runs them), not hundreds of eager ones
    h = jax.jit(base_hidden, static_argnums=(1, 3))(params, cfg, tokens, t)
    chain = jax.jit(chain_logits, static_argnums=(2, 5))
    want = chain(params["mtp"], params, cfg, h, tokens, 1)[0]  # row a predicts token a + 2
    n_layers = cfg.num_hidden_layers + len(params["mtp"])
    cache = kvcache.init_cache(cfg, 4, page, jnp.float32, num_layers=n_layers)
    garbage = jax.random.normal(jax.random.key(1), cache.kv.shape, cache.kv.dtype)
    cache = kvcache.KVCache(garbage, cache.scale)
    table = jnp.asarray([[3, 0, 2, 1]])
    anchors = jnp.arange(t)[None]
    extend = jax.jit(mtp_extend, static_argnums=(1, 9))
    _, got, _ = extend(params, cfg, cache, table, h, tokens[:, 1:], anchors, anchors >= 0, jnp.asarray([t]), 1)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=2e-4)


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
