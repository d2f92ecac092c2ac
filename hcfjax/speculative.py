"""Multi-layer MTP speculative decoding: a whole speculative step is one function (hcfjax.step runs it).

A step, for a batch of rows, each with its newest token `last` at position L (not yet in the target's cache) and k
drafts for positions L+1..L+k:
  1. target forward over [last, d_1..d_k] at positions L..L+k (absorbed MLA; writes their KV);
  2. verification (hcfjax.verify): n accepted drafts and one more token, so n+1 tokens are emitted;
  3. rollback: the row's length becomes L+n+1; cache entries past it are simply never read (pages stay valid);
  4. MTP extend: the MTP modules re-run over the newly verified positions with the target's hidden states, so their
     own KV caches hold what they saw in training (module i at position p: the chain from anchor p-i);
  5. drafting: depth 1 from the target's hidden state at L+n and the new token, depths 2..k autoregressively from
     the previous depth's hidden state (module i at depth i when the checkpoint has k modules; otherwise the
     modules it has, the last one reused).
Cache layers: the main model's L layers, then one per MTP module.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hcfjax.attention import CacheContext
from hcfjax.config import ModelConfig
from hcfjax.model import hidden_states, logits, mtp_module
from hcfjax.options import DEFAULT, Options
from hcfjax.sampling import SamplingBatch, filtered_logprobs
from hcfjax.verify import METHODS, row_keys, sample_probs_rows, split_rows, verify

SPEC_METHODS = (*METHODS, "tuned")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding with the checkpoint's MTP modules.

    num_draft_tokens: k drafts per step (the MTP depth).
    method: exact | rejection | typical | tuned (see hcfjax.verify for the first three).
    draft_temperature_scale: drafts are sampled at this multiple of the request's temperature (0: greedy drafts).
    typical_epsilon, typical_delta: the typical-acceptance threshold min(epsilon, delta * exp(-H(p))).
    position_methods: `tuned` only: the verification method of each draft position (default all `typical`).
    dynamic_temperature: `tuned` only, (t_min, t_max): the target is sampled at a temperature that follows its own
        normalised entropy at each position, t_min + (t_max - t_min) * H(p) / log(V), instead of the request's
        (greedy requests stay greedy). Confident positions get sharper, uncertain ones keep their spread.
    mtp_head_norm: the RMSNorm before the MTP modules' LM head (the reference added it to vLLM's MTP for +2%
        acceptance; DeepSeek ships its weight as shared_head.norm). False drops it, to measure what it buys.
    `tuned` defaults draft_temperature_scale to 0.5: less random drafts are accepted more often.
    forced_acceptance: BENCHMARK ONLY (a random model has no trained MTP heads). One probability per depth: draft i
        is accepted with probability a_i given drafts 1..i-1 were (conditional per depth, as the capacity
        simulator's `acceptance`: tokens per step 1 + a_1 + a_1 a_2 + ...), drawn from each row's own key in place
        of the method's accept test; everything else (target forward, the method's probabilities, the token after
        the accepted drafts, MTP extend, drafting) runs as usual. The output is then not the model's. The serving
        engine and the PD prefill worker refuse a config that sets it, and `hcfjax serve` has no flag for it.
    """

    num_draft_tokens: int = 2
    method: str = "exact"
    draft_temperature_scale: float | None = None
    typical_epsilon: float = 0.09
    typical_delta: float = 0.3
    position_methods: tuple[str, ...] | None = None
    dynamic_temperature: tuple[float, float] | None = None
    mtp_head_norm: bool = True
    forced_acceptance: tuple[float, ...] | None = None

    def __post_init__(self):
        if not (isinstance(self.num_draft_tokens, int) and 1 <= self.num_draft_tokens <= 16):
            raise ValueError(f"num_draft_tokens must be an integer in 1..16, got {self.num_draft_tokens!r}")
        if self.method not in SPEC_METHODS:
            raise ValueError(f"method must be one of {SPEC_METHODS}, got {self.method!r}")
        if self.draft_temperature_scale is not None and not self.draft_temperature_scale >= 0:
            raise ValueError(f"draft_temperature_scale must be >= 0, got {self.draft_temperature_scale!r}")
        if not (0 < self.typical_epsilon <= 1 and 0 < self.typical_delta):
            raise ValueError("typical_epsilon must be in (0, 1] and typical_delta > 0")
        if self.position_methods is not None:
            if self.method != "tuned":
                raise ValueError("position_methods is for method='tuned'")
            if len(self.position_methods) != self.num_draft_tokens or any(
                m not in METHODS for m in self.position_methods
            ):
                raise ValueError(f"position_methods needs {self.num_draft_tokens} entries from {METHODS}")

        if self.dynamic_temperature is not None:
            lo, hi = self.dynamic_temperature
            if self.method != "tuned" or not 0 < lo <= hi:
                raise ValueError("dynamic_temperature=(t_min, t_max) with 0 < t_min <= t_max, for method='tuned'")
        if self.forced_acceptance is not None:
            rates, k = self.forced_acceptance, self.num_draft_tokens
            if not (isinstance(rates, tuple) and len(rates) == k and all(0 <= a <= 1 for a in rates)):
                raise ValueError(f"forced_acceptance needs a tuple of {k} probabilities in [0, 1], got {rates!r}")

    @property
    def methods(self) -> tuple[str, ...]:
        if self.method != "tuned":
            return (self.method,) * self.num_draft_tokens
        return self.position_methods or ("typical",) * self.num_draft_tokens

    @property
    def draft_scale(self) -> float:
        if self.draft_temperature_scale is not None:
            return self.draft_temperature_scale
        return 0.5 if self.method == "tuned" else 1.0


def probs(lg: jax.Array, sp: SamplingBatch, branch_free: bool = True) -> jax.Array:
    """Sampling distribution [B, T, V] of logits [B, T, V] under per-row params (one-hot for greedy rows).
    branch_free: as in hcfjax.sampling.filtered_logprobs (Options.branch_free_sampling)."""
    p = jax.vmap(lambda x: jnp.exp(filtered_logprobs(x, sp, branch_free)), in_axes=1, out_axes=1)(lg)
    greedy = jax.nn.one_hot(jnp.argmax(lg, -1), lg.shape[-1], dtype=p.dtype)
    return jnp.where((sp.temperature > 0)[:, None, None], p, greedy)


def dynamic_probs(lg: jax.Array, sp: SamplingBatch, t_min: float, t_max: float, branch_free: bool = True) -> jax.Array:
    """probs() at a per-position temperature t_min + (t_max - t_min) * normalised entropy of softmax(lg)."""
    logp = jax.nn.log_softmax(lg.astype(jnp.float32), axis=-1)
    h = -jnp.sum(jnp.exp(logp) * logp, axis=-1) / jnp.log(lg.shape[-1])  # [B, T] in [0, 1]
    temp = t_min + (t_max - t_min) * h
    unit = dataclasses.replace(sp, temperature=jnp.where(sp.temperature > 0, 1.0, 0.0))
    return probs(lg / temp[..., None], unit, branch_free)


def scaled(sp: SamplingBatch, scale: float) -> SamplingBatch:
    return dataclasses.replace(sp, temperature=sp.temperature * scale)


def mtp_extend(
    params: dict,
    cfg: ModelConfig,
    cache,
    page_table,
    h: jax.Array,
    tok1: jax.Array,
    anchor_pos: jax.Array,
    anchor_ok: jax.Array,
    last_pos: jax.Array,
    depths: int,
    head_norm: bool = True,
    experts_fn=None,
    opts: Options = DEFAULT,
):
    """Runs MTP depths 1..depths over anchors (teacher forcing on verified tokens), writing the modules' KV.

    h [B, R, D]: the target's hidden states at anchor positions anchor_pos [B, R] (consecutive per row);
    tok1 [B, R]: the token at anchor + 1; last_pos [B]: the newest verified position (depth i runs only where
    anchor + i <= last_pos). Returns (every depth's chain hidden [depths] x [B, R, D], depth-1 logits [B, R, V],
    cache).

    Cache slots: depth i's entry for anchor a, (h_a, token a + i), lives at position a of module i's layer, so every
    position from 0 up is written before it is read, as in training (train_mtp runs each depth over the sequence
    from position 0) and in vLLM's MTP layer. depths <= len(modules): each depth here has its own module's layer;
    draft_chain runs deeper depths of a shared module at the positions after the anchor.
    """
    modules = params["mtp"]
    r = h.shape[1]
    x, xs, lg1 = h, [], None
    for i in range(1, depths + 1):
        m = i - 1
        tok = jnp.concatenate([tok1[:, i - 1 :], jnp.zeros((tok1.shape[0], i - 1), tok1.dtype)], axis=1)[:, :r]
        valid = anchor_ok & (anchor_pos + i <= last_pos[:, None])
        ctx = CacheContext(cache, page_table, last_pos + 1 - i, valid)
        x, lg, ctx = mtp_module(
            modules[m], cfg, m, x, tok, anchor_pos, params["embed"], ctx, True, head_norm, experts_fn, opts
        )
        cache = ctx.cache
        xs.append(x)
        lg1 = lg if lg1 is None else lg1
    return xs, lg1, cache


def draft_chain(
    params: dict,
    cfg: ModelConfig,
    cache,
    page_table,
    ext: list,
    lg1: jax.Array,
    anchor: jax.Array,
    sp_draft: SamplingBatch,
    k: int,
    valid: jax.Array,
    key,
    head_norm: bool = True,
    experts_fn=None,
    opts: Options = DEFAULT,
):
    """Drafts k tokens from anchor A [B]. ext: mtp_extend's chain hidden of each depth it ran at the k anchors
    A-k+1..A ([B, k, D] each); lg1 [B, V]: depth 1's logits at A, which give the first draft.

    Depth i <= the number of modules (independent modules) runs its module over positions A+2-i..A, as training
    does (train_mtp's chain): the inputs are depth i-1's hidden there (mtp_extend's at A+2-i, the last anchor whose
    token at + i - 1 is verified; this chain's at the rest) and the tokens at + i, the drafts d_1..d_{i-1}. So its
    cache holds an entry for every position it attends to; the ones built on drafts are rewritten by the next
    mtp_extend once their tokens are verified. Deeper depths reuse the last module one position further each (a
    shipped single MTP layer drafting autoregressively, as vLLM and SGLang run it).

    Returns (drafts [B, k], draft distributions q [B, k, V], cache)."""
    modules = params["mtp"]
    keys = split_rows(row_keys(key, lg1.shape[0]), k)  # [B, k]
    branch_free = opts.on("branch_free_sampling")
    q = probs(lg1[:, None], sp_draft, branch_free)[:, 0]
    d = sample_probs_rows(keys[:, 0], q)
    ds, qs, x = [d], [q], ext[0][:, -1:]  # x: the previous depth's hidden at the positions it ran
    emb = params["embed"]
    for i in range(2, k + 1):
        m = min(i, len(modules)) - 1
        if i == m + 1:  # independent module i: positions A+2-i..A
            if i > 2:  # mtp_extend's depth i-1 hidden at A+2-i, then the chain's at A+3-i..A (for i = 2, x is the
                # extend's at A already)
                x = jnp.concatenate([ext[i - 2][:, k + 1 - i : k + 2 - i], x], axis=1)  # [B, i-1, D]
            pos = anchor[:, None] + jnp.arange(2 - i, 1)
            tok = jnp.stack(ds, 1)  # d_1 .. d_{i-1}
        else:  # the last module again, one position further
            x, pos, tok = x[:, -1:], (anchor + i - 1 - m)[:, None], ds[-1][:, None]
        ctx = CacheContext(cache, page_table, pos[:, -1] + 1, valid[:, None] & (pos >= 0))
        x, lg, ctx = mtp_module(modules[m], cfg, m, x, tok, pos, emb, ctx, True, head_norm, experts_fn, opts)
        cache = ctx.cache
        q = probs(lg[:, -1:], sp_draft, branch_free)[:, 0]
        ds.append(sample_probs_rows(keys[:, i - 1], q))
        qs.append(q)
    return jnp.stack(ds, 1), jnp.stack(qs, 1), cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Drafts:
    """A row's speculative state between steps."""

    last: jax.Array  # [B] newest token, at position pos (not yet in the target's cache)
    pos: jax.Array  # [B]
    drafts: jax.Array  # [B, k]
    q: jax.Array  # [B, k, V] the distributions the drafts were sampled from
    hist_h: jax.Array  # [B, R] x [D] target hidden states of anchors pos-R .. pos-1
    hist_tok: jax.Array  # [B, R] token at anchor + 1 (the last one is `last`)


def _take_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    """Per-row gather along axis 1: x [B, N, ...], idx [B, M] -> [B, M, ...]."""
    idx = jnp.clip(idx, 0, x.shape[1] - 1)
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def spec_prefill(
    params,
    cfg: ModelConfig,
    spec: SpeculativeConfig,
    h_prompt,
    tokens,
    first,
    lengths,
    cache,
    page_table,
    sp,
    live,
    key,
    experts_fn=None,
    opts: Options = DEFAULT,
) -> tuple[Drafts, object]:
    """After a prefill: the MTP modules see every prompt position, then the first k drafts from anchor lengths - 1.

    h_prompt [B, T, D]: the target's final-normed hidden states of the prompts; tokens [B, T] (right-padded to
    lengths [B]); first [B]: the token sampled at prefill; live [B]: rows that will decode.
    """
    k = spec.num_draft_tokens
    b, t = tokens.shape
    r = 2 * k + 1
    rows = jnp.arange(b)
    tok1 = jnp.where(
        jnp.arange(t)[None] == (lengths - 1)[:, None],
        first[:, None],
        jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), tokens.dtype)], axis=1),
    )
    anchor_pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    depths = min(len(params["mtp"]), k)
    xs, lg1, cache = mtp_extend(
        params,
        cfg,
        cache,
        page_table,
        h_prompt,
        tok1,
        anchor_pos,
        anchor_pos < lengths[:, None],
        lengths,
        depths,
        spec.mtp_head_norm,
        experts_fn,
        opts,
    )
    last_k = (lengths - k)[:, None] + jnp.arange(k)  # the anchors lengths-k .. lengths-1 (clipped below 0: unused)
    ext, lg1 = [_take_rows(x, last_k) for x in xs], lg1[rows, lengths - 1]
    sp_draft = scaled(sp, spec.draft_scale)
    drafts, q, cache = draft_chain(
        params,
        cfg,
        cache,
        page_table,
        ext,
        lg1,
        lengths - 1,
        sp_draft,
        k,
        live,
        key,
        spec.mtp_head_norm,
        experts_fn,
        opts,
    )
    hist_idx = lengths[:, None] - r + jnp.arange(r)
    return Drafts(first, lengths, drafts, q, _take_rows(h_prompt, hist_idx), _take_rows(tok1, hist_idx)), cache


def spec_step(
    params,
    cfg: ModelConfig,
    spec: SpeculativeConfig,
    d: Drafts,
    cache,
    page_table,
    sp,
    live,
    stops,
    key,
    experts_fn=None,
    opts: Options = DEFAULT,
):
    """One speculative step for every row: target forward over [last, drafts] (writing their KV), verification,
    the bonus or recovered token, rollback (the new position), MTP extend and the next k drafts.

    live [B]: rows that step; stops(emitted [B, k+1], n_emit [B]) -> (n_emit, done [B]) applies the caller's
    stopping rules to the tokens this step emits. Returns (drafts state, cache, emitted [B, k+1], n_emit [B],
    done [B], drafts accepted [B]).
    """
    k = spec.num_draft_tokens
    r = 2 * k + 1
    keys = split_rows(row_keys(key, d.last.shape[0]), 2)
    k_verify, k_draft = keys[:, 0], keys[:, 1]
    # 1. target forward over [last, drafts]
    toks = jnp.concatenate([d.last[:, None], d.drafts], axis=1)  # [B, k+1]
    pos = d.pos[:, None] + jnp.arange(k + 1)
    rows = jnp.broadcast_to(live[:, None], toks.shape)  # (rows that do not step skip the routed experts)
    ctx = CacheContext(cache, page_table, d.pos + k + 1, rows)
    h, ctx = hidden_states(params, cfg, toks, pos, ctx, absorbed=True, experts_fn=experts_fn, opts=opts, real=rows)
    # 2. verification
    lg = logits(params, h)
    branch_free = opts.on("branch_free_sampling")
    if spec.dynamic_temperature:
        p = dynamic_probs(lg, sp, *spec.dynamic_temperature, branch_free=branch_free)
    else:
        p = probs(lg, sp, branch_free)
    n, extra = verify(
        spec.methods, p, d.q, d.drafts, k_verify, spec.typical_epsilon, spec.typical_delta, spec.forced_acceptance
    )
    j = jnp.arange(k + 1)[None]
    emitted = jnp.where(j < n[:, None], jnp.concatenate([d.drafts, d.drafts[:, :1]], 1), extra[:, None])
    n_emit, done = stops(emitted, jnp.where(live, n + 1, 0))
    # 3. rollback is the new position; 4. MTP extend over the window of anchors ending at the new anchor
    new_pos = d.pos + n + 1
    all_h = jnp.concatenate([d.hist_h, h], axis=1)  # anchors pos-R .. pos+k
    all_tok = jnp.concatenate([d.hist_tok, emitted], axis=1)
    idx = n[:, None] + 1 + jnp.arange(r)
    hist_h, hist_tok = _take_rows(all_h, idx), _take_rows(all_tok, idx)
    anchor_pos = new_pos[:, None] - r + jnp.arange(r)
    depths = min(len(params["mtp"]), k)
    going = live & ~done  # rows that step and go on: only they write the MTP layers (an idle slot's page table is
    # padding that points at page 0, someone else's)
    xs, lg1, cache = mtp_extend(
        params,
        cfg,
        ctx.cache,
        page_table,
        hist_h,
        hist_tok,
        anchor_pos,
        (anchor_pos >= 0) & going[:, None],
        new_pos,
        depths,
        spec.mtp_head_norm,
        experts_fn,
        opts,
    )
    # 5. drafts for the next step
    sp_draft = scaled(sp, spec.draft_scale)
    drafts, q, cache = draft_chain(
        params,
        cfg,
        cache,
        page_table,
        [x[:, -k:] for x in xs],
        lg1[:, -1],
        new_pos - 1,
        sp_draft,
        k,
        going,
        k_draft,
        spec.mtp_head_norm,
        experts_fn,
        opts,
    )
    new = Drafts(extra, new_pos, drafts, q, hist_h, hist_tok)
    keep = lambda a, b: jnp.where(live.reshape(live.shape + (1,) * (a.ndim - 1)), a, b)
    state = jax.tree.map(keep, new, d)  # rows that did not step keep their state (a slot filled this step)
    return state, cache, emitted, n_emit, done, jnp.where(live, n, 0)
