"""Independent MTP modules (depth i drafts with module i) at every depth 1..5: speculative greedy equals plain
greedy with drafts accepted at every depth (chains of 2 and 5 modules here, one module in test_speculative), each
depth's draft is its module's teacher-forced prediction, and no depth reads a cache slot that nothing has written."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import hcfjax
from hcfjax import cache as kvcache
from hcfjax.random_model import preset_config, random_model
from hcfjax.sampling import SamplingBatch, SamplingParams
from hcfjax.speculative import SpeculativeConfig, spec_step
from hcfjax.step import PrefillInputs, empty_state, jitted_step

DEPTH = 5
# The second prompt is shorter than the depth: its first draft chains start at negative positions.
PROMPTS = [[5, 9, 2, 33, 7, 41, 8, 8, 19, 60, 3], [100, 3]]
PAGE = 8
TABLE = jnp.asarray([[5, 0, 7, 2, 9, 4], [1, 11, 3, 6, 8, 10]])  # each row's pages, interleaved
STEPS = 4
# The greedy test's (text for the embedded model): one row ends at its stop token, the run of one letter is
# accepted at every depth.
GREEDY_PROMPTS = [
    "aaaaaaaaaaaaaaaa",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13,",
    "def f(x):\n    return x\n\ndef g(x):\n",
]


@pytest.fixture(scope="module")
def five_heads():
    """A random V3 model with five independent MTP modules."""
    cfg = preset_config("tiny-v3", num_hidden_layers=2, num_nextn_predict_layers=DEPTH)
    return random_model(cfg, seed=5, dtype=jnp.float32)


def no_stops(emitted, n_emit):
    return n_emit, jnp.zeros(n_emit.shape, bool)


spec_step_jit = jax.jit(spec_step, static_argnums=(1, 2, 8))


def speculate(model, cache: kvcache.KVCache, spec: SpeculativeConfig, steps: int):
    """Prefills both PROMPTS over `cache` and runs `steps` speculative steps, sampling at temperature 1 (so the
    draft distributions q are the modules' softmax). -> ([(verified tokens per row, Drafts)] after the prefill and
    after each step, final cache)."""
    n = [len(p) for p in PROMPTS]
    t = 16
    sp = SamplingParams(temperature=1.0)
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    pre = PrefillInputs(
        i32([p + [0] * (t - len(p)) for p in PROMPTS]),
        i32([0, 0]),
        i32(n),
        TABLE,
        i32([0, 1]),
        SamplingBatch.of([sp, sp]),
        jnp.asarray([1, 2], jnp.uint32),
        i32([0, 0]),
    )
    state = empty_state(model.cfg, 2, cache, spec, model.dtype)
    state = jitted_step(model.params, model.cfg, state, pre, None, spec)[0]
    d, cache = state.drafts, state.cache
    seqs = [p + [int(d.last[b])] for b, p in enumerate(PROMPTS)]
    out = [([list(s) for s in seqs], d)]
    live, sb = jnp.array([True, True]), SamplingBatch.of([sp, sp])
    for i in range(steps):
        key = jax.random.key(10 + i)
        d, cache, emitted, n_emit, _, _ = spec_step_jit(
            model.params, model.cfg, spec, d, cache, TABLE, sb, live, no_stops, key
        )
        for b, s in enumerate(seqs):
            s += [int(x) for x in emitted[b, : int(n_emit[b])]]
        out.append(([list(s) for s in seqs], d))
    return out, cache


@pytest.fixture(scope="module")
def runs(five_heads):
    """speculate at depth 5 over a zeroed cache and over one whose every slot holds a large random sentinel (each
    run its own cache: the prefill step donates it)."""
    cfg = five_heads.cfg
    spec = SpeculativeConfig(num_draft_tokens=DEPTH, method="rejection")
    zeros = kvcache.init_cache(cfg, 12, PAGE, jnp.float32, num_layers=cfg.num_hidden_layers + DEPTH)
    sentinel = kvcache.KVCache(100.0 * jax.random.normal(jax.random.key(7), zeros.kv.shape), zeros.scale)
    return {
        name: speculate(five_heads, cache, spec, STEPS) for name, cache in [("zeros", zeros), ("sentinel", sentinel)]
    }


def test_no_depth_reads_an_unwritten_cache_slot(five_heads, runs):
    """The drafts, their distributions and the emitted tokens are the same, bit for bit, whether the never-written
    slots hold zeros or a large sentinel (attending to a sentinel key would dominate that softmax); and every slot
    below a row's length holds the same entry in both runs, in every layer: each was written, in the main layers
    and in all five modules'.

    The sentinel is finite: attention gathers whole pages and gives the masked slots probability 0, and 0 * NaN is
    NaN, so a NaN-filled cache poisons even a forward that attends only to written slots."""
    (zero_steps, zero_cache), (sent_steps, sent_cache) = runs["zeros"], runs["sentinel"]
    for (seq_z, d_z), (seq_s, d_s) in zip(zero_steps, sent_steps, strict=True):
        assert seq_s == seq_z
        assert np.isfinite(np.asarray(d_s.q)).all()
        np.testing.assert_array_equal(np.asarray(d_s.drafts), np.asarray(d_z.drafts))
        np.testing.assert_array_equal(np.asarray(d_s.q), np.asarray(d_z.q))
    final = sent_steps[-1][1]
    pages = lambda kv, b: np.asarray(kv[:, TABLE[b]]).reshape(kv.shape[0], -1, kv.shape[-1])  # noqa: E731
    for b in range(len(PROMPTS)):
        n = int(final.pos[b])  # positions 0..n-1 are verified: the target's and every module's layer hold them
        assert n > len(PROMPTS[b]) + STEPS  # drafts were accepted
        np.testing.assert_array_equal(pages(sent_cache.kv, b)[:, :n], pages(zero_cache.kv, b)[:, :n])


def test_independent_drafts_equal_the_training_view(five_heads, runs):
    """Depth i's draft distribution at anchor A is module i's teacher-forced prediction over the whole sequence
    (train_mtp's chain, the drafts taken as the tokens after A), after the prefill and after each step, for every
    depth up to 5: the draft chain's module i holds an entry for every position up to A, including A+2-i..A-1,
    whose tokens are earlier drafts."""
    from train_mtp.heads import base_hidden, chain_logits

    m, cfg = five_heads, five_heads.cfg
    width = 48  # padded sequence: the chain is causal, so the padding after A + DEPTH + 1 changes nothing

    @jax.jit
    def training_view(params, full, anchor):  # softmax of depths 1..DEPTH's logits at anchor [B] (full [B, width])
        rows = width - DEPTH - 1
        h0 = base_hidden(params, cfg, full, rows)
        lgs = chain_logits(params["mtp"], params, cfg, h0, full, DEPTH)
        at = jnp.stack([lg[jnp.arange(full.shape[0]), anchor] for lg in lgs], 1)  # [B, DEPTH, V]
        return jax.nn.softmax(at, -1)

    for seqs, d in runs["sentinel"][0]:
        full = [s + [int(x) for x in d.drafts[b]] for b, s in enumerate(seqs)]
        full = jnp.asarray([f + [0] * (width - len(f)) for f in full])
        anchor = jnp.asarray([len(s) - 2 for s in seqs])
        want = training_view(m.params, full, anchor)
        np.testing.assert_allclose(np.asarray(d.q), np.asarray(want), rtol=1e-3, atol=1e-6)


@pytest.fixture(scope="module")
def copied_heads():
    """The embedded model with its trained MTP module copied into DEPTH independent modules. Random modules' greedy
    drafts are never the target's tokens, so greedy verification would reject every draft at depth 1 and never
    reach the deeper modules; these copies draft well on repetitive text (a run of one letter is accepted at every
    depth)."""
    m = hcfjax.load(dtype=jnp.float32)
    params = {**m.params, "mtp": [m.params["mtp"][0]] * DEPTH}
    return dataclasses.replace(m, params=params, cfg=dataclasses.replace(m.cfg, num_mtp_layers=DEPTH))


@pytest.fixture(scope="module")
def plain_greedy(copied_heads):
    """Plain greedy decoding of GREEDY_PROMPTS, 24 tokens each, with no stop token: every depth's reference."""
    return hcfjax.generate(copied_heads, GREEDY_PROMPTS, max_new_tokens=24, stop_token_ids=[]).tokens


# k = 2: fewer depths than modules (the chain cut short); k = DEPTH: every module. k = 1 (module 1 alone, nothing
# chained) is test_speculative's.
@pytest.mark.parametrize("k", [2, DEPTH])
def test_greedy_exact_at_every_depth(copied_heads, plain_greedy, k):
    """Exact verification of greedy requests gives plain greedy decoding's tokens with a chain of k independent
    modules, stop token included (one row ends at a stop token, the others run to the limit), and every depth's
    drafts are accepted at least once, so the multi-token accepts and their cache updates are what is checked."""
    stop = plain_greedy[1][6]
    want = [row[: row.index(stop) + 1] if stop in row else row for row in plain_greedy]
    assert len(want[1]) < 24 and any(len(row) == 24 for row in want)
    spec = SpeculativeConfig(num_draft_tokens=k, method="exact")
    got = hcfjax.generate(copied_heads, GREEDY_PROMPTS, max_new_tokens=24, stop_token_ids=[stop], speculative=spec)
    assert got.tokens == want
    accepted = got.stats["acceptance_per_depth"]
    assert len(accepted) == k and min(accepted) > 0, accepted
