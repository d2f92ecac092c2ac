"""The one forward step every driver calls.

A step runs, in one traced function, a prefill part (chunks of up to Bp prompts, Tc tokens each, written into their
pages; a chunk that ends its prompt samples the request's first new token into its decode slot, and with speculative
decoding makes its first drafts) and a decode part (one token, or one speculative step, for each decode row's
slot; absorbed MLA over the cache). Either part may be absent. Per-slot state (`SlotState`: the cache, each slot's
newest token, length and rng counter, and its draft state) is carried from step to step.

Drivers:
- `hcfjax.generate`: one prefill step for the whole batch, then decode steps in one `lax.while_loop`
  (`decode_steps`);
- the engine (`hcfjax.engine.runner`): one step per iteration, prefill chunks and decode rows together; the PD
  decode worker is the engine;
- the PD prefill worker (`hcfjax.pd.prefill`): `prefill_layer` layer by layer (so each layer's cache can leave
  as soon as it is written), then `finish_prefill` (the first tokens and drafts, as `step` makes them).
A sharding plan wraps `step` in a shard_map over its ranks (`sharding.plans.Plan.wrap_step`).

Sampling keys come from each request's seed and its counter of sampled tokens (`sample_keys`): a row's draws do
not depend on its batch, its rank, or which driver runs it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from hcfjax import cache as kvcache
from hcfjax.attention import CacheContext
from hcfjax.config import ModelConfig
from hcfjax.model import decoder_layer, hidden_states, logits
from hcfjax.options import DEFAULT, Options
from hcfjax.sampling import SamplingBatch, sample_rows
from hcfjax.speculative import Drafts, SpeculativeConfig, spec_prefill, spec_step

PAD = -1  # marks unused slots of an output buffer


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotState:
    cache: kvcache.KVCache
    tok: jax.Array  # [S] the slot's newest token, not yet in the cache
    length: jax.Array  # [S] tokens of the slot's sequence in the cache
    count: jax.Array  # [S] tokens sampled for the slot's request (its rng counter)
    drafts: Drafts | None = None  # [S] speculative state (then `tok` and `length` are unused)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PrefillInputs:
    tokens: jax.Array  # [Bp, Tc] chunk tokens, right-padded
    start: jax.Array  # [Bp] position of the chunk's first token
    n: jax.Array  # [Bp] real tokens in the chunk (0 for padding rows)
    page_table: jax.Array  # [Bp, M]
    slot: jax.Array  # [Bp] decode slot receiving the sampled token (S when the chunk does not end its prompt)
    sp: SamplingBatch  # [Bp]
    seed: jax.Array  # [Bp] uint32 request seeds
    count: jax.Array  # [Bp] the request's rng counter at this sample


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeInputs:
    """The decode rows: N <= S rows, row i decoding slot `slot[i]`, or without `slot` the first N slots. The
    engine packs its decoding requests into the fewest rows a compiled size holds, wherever their slots lie, so a
    step decodes as few rows as it can; slots no row names are untouched."""

    active: jax.Array  # [N] bool
    page_table: jax.Array  # [N, M]
    sp: SamplingBatch  # [N]
    seed: jax.Array  # [N]
    slot: jax.Array | None = None  # [N] int32 the slot each row decodes (S, none, on inactive rows)


def empty_state(cfg: ModelConfig, slots: int, cache: kvcache.KVCache, spec: SpeculativeConfig | None, dtype):
    """SlotState for `slots` slots over `cache`, with zeroed draft state when speculating."""
    i32 = lambda *shape: jnp.zeros(shape, jnp.int32)  # noqa: E731
    drafts = None
    if spec is not None:
        k, r = spec.num_draft_tokens, 2 * spec.num_draft_tokens + 1
        q = jnp.zeros((slots, k, cfg.vocab_size), jnp.float32)
        hist_h = jnp.zeros((slots, r, cfg.hidden_size), dtype)
        drafts = Drafts(i32(slots), i32(slots), i32(slots, k), q, hist_h, i32(slots, r))
    return SlotState(cache, i32(slots), i32(slots), i32(slots), drafts)


def sample_keys(seed: jax.Array, count: jax.Array) -> jax.Array:
    """Per-row keys [B] from request seeds [B] and rng counters [B]."""
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seed, count)


_DRAFT_TAG = 0x5EED  # the prefill's first drafts: apart from the first decode step's keys (same counter)


def draft_keys(seed: jax.Array, count: jax.Array) -> jax.Array:
    """Per-row keys [B] for the first drafts after a prefill whose sampled token was the count-th: a request's
    drafts depend only on its seed and counter, so every driver draws the same."""
    return jax.vmap(lambda k: jax.random.fold_in(k, _DRAFT_TAG))(sample_keys(seed, count + 1))


def finish_prefill(params, cfg: ModelConfig, h, pre: PrefillInputs, cache, spec=None, opts=DEFAULT, experts_fn=None):
    """After a prefill chunk: each row's next token from its last real position's hidden state (h: final-normed
    [Bp, Tc, D]), and with speculation the MTP modules over the chunk and the first drafts (prompts come whole:
    start 0). -> (first tokens [Bp], Drafts [Bp] or None, cache)."""
    b = h.shape[0]
    last = h[jnp.arange(b), jnp.maximum(pre.n - 1, 0)]
    branch_free = opts.on("branch_free_sampling")
    first = sample_rows(logits(params, last), pre.sp, sample_keys(pre.seed, pre.count), branch_free)
    if spec is None:
        return first, None, cache
    keys = draft_keys(pre.seed, pre.count)
    drafts, cache = spec_prefill(
        params, cfg, spec, h, pre.tokens, first, pre.n, cache, pre.page_table, pre.sp, pre.n > 0, keys, experts_fn, opts
    )
    return first, drafts, cache


def prefill_layer(p, cfg: ModelConfig, is_moe: bool, layer, x, start, cache, page_table, n, opts: Options = DEFAULT):
    """One decoder layer (params p, cache layer `layer`) over a prefill chunk x [B, Tc, D] at positions start..,
    for prompts of n [B] tokens: the layer-major prefill of the PD prefill worker. -> (x, cache)."""
    t = x.shape[1]
    pos = jnp.broadcast_to(start + jnp.arange(t)[None], x.shape[:2])
    real = pos < n[:, None]
    ctx = CacheContext(cache, page_table, jnp.minimum(start + t, n), real)
    x, ctx = decoder_layer(p, cfg, x, pos, ctx, layer, is_moe, absorbed=False, opts=opts, real=real)
    return x, ctx.cache


def step(
    params,
    cfg: ModelConfig,
    state: SlotState,
    pre: PrefillInputs | None,
    dec: DecodeInputs | None,
    spec: SpeculativeConfig | None = None,
    opts: Options = DEFAULT,
    experts_fn=None,
    with_load: bool = False,
):
    """One step; experts_fn runs the routed experts (the decode plan's expert-parallel exchange, or local).

    -> (state, first tokens [Bp] of the prefill rows (None without prefill), decode output (None without
    decode): next tokens [N], or with speculation (emitted [N, k+1], tokens emitted [N], drafts accepted [N]),
    with_load: tokens routed to each expert [n_moe_layers, E] by the real rows (EPLB's counters), else None).
    Stop tokens are the driver's business: a speculative row emits all its accepted tokens."""
    if with_load and spec is not None:
        raise ValueError("expert-load counting covers plain decoding only")
    cache, tok, length, count, drafts = state.cache, state.tok, state.length, state.count, state.drafts
    first = nxt = None
    loads = []  # per part, [n_moe_layers, E]: only real tokens count (padding and mock rows route too)
    if pre is not None:
        t = pre.tokens.shape[1]
        pos = pre.start[:, None] + jnp.arange(t)
        real = jnp.arange(t)[None] < pre.n[:, None]
        ctx = CacheContext(cache, pre.page_table, pre.start + pre.n, real)
        counted = real if with_load else False
        h, ctx, *loads = hidden_states(params, cfg, pre.tokens, pos, ctx, False, experts_fn, counted, opts, real)
        first, d, cache = finish_prefill(params, cfg, h, pre, ctx.cache, spec, opts, experts_fn)
        tok = tok.at[pre.slot].set(first, mode="drop")
        length = length.at[pre.slot].set(pre.start + pre.n, mode="drop")
        count = count.at[pre.slot].set(pre.count + 1, mode="drop")
        if d is not None:
            drafts = jax.tree.map(lambda s, x: s.at[pre.slot].set(x, mode="drop"), drafts, d)
    if dec is not None:
        head, put = _slot_rows(dec, tok.shape[0])
    if dec is not None and spec is not None:
        no_stops = lambda emitted, n_emit: (n_emit, jnp.zeros(n_emit.shape, bool))  # noqa: E731
        keys = sample_keys(dec.seed, head(count))
        mine = jax.tree.map(head, drafts)
        d, cache, emitted, n_emit, _, n_acc = spec_step(
            params, cfg, spec, mine, cache, dec.page_table, dec.sp, dec.active, no_stops, keys, experts_fn, opts
        )
        drafts = jax.tree.map(put, drafts, d)
        count = put(count, head(count) + jnp.where(dec.active, n_emit, 0))  # the rng counter: tokens emitted so far
        nxt = (emitted, n_emit, n_acc)
    elif dec is not None:
        t, n = head(tok), head(length)
        ctx = CacheContext(cache, dec.page_table, n + 1, dec.active[:, None])
        counted = dec.active[:, None] if with_load else False
        active = dec.active[:, None]
        h, ctx, *load = hidden_states(params, cfg, t[:, None], n[:, None], ctx, True, experts_fn, counted, opts, active)
        loads += load
        cache = ctx.cache
        branch_free = opts.on("branch_free_sampling")
        nxt = sample_rows(logits(params, h[:, 0]), dec.sp, sample_keys(dec.seed, head(count)), branch_free)
        tok = put(tok, jnp.where(dec.active, nxt, t))
        length = put(length, n + dec.active)
        count = put(count, head(count) + dec.active)
    load = sum(loads) if with_load else None
    return SlotState(cache, tok, length, count, drafts), first, nxt, load


def _slot_rows(dec: DecodeInputs, slots: int):
    """(head, put): a per-slot array's decode rows, and the array with the rows written back to their slots."""
    if dec.slot is not None:  # a gather and a scatter that drops the inactive rows (slot S)
        head = lambda x: x.at[dec.slot].get(mode="fill", fill_value=0)  # noqa: E731
        return head, lambda whole, x: whole.at[dec.slot].set(x, mode="drop")
    rows = dec.active.shape[0]  # the first `rows` slots decode
    if rows == slots:  # all slots: no slices (XLA:CPU crashed on full-width ones, speculative, in a plan)
        return (lambda x: x), (lambda whole, x: x)
    return (lambda x: x[:rows]), (lambda whole, x: whole.at[:rows].set(x))


STATIC = ("cfg", "spec", "opts", "experts_fn", "with_load")


@functools.cache
def step_program(xla: tuple = ()):
    """`step` jitted with these XLA compiler options (`Options.compiler_options()`, which the caller's opts ask
    for: they are fixed per jit, not traced)."""
    return jax.jit(step, static_argnames=STATIC, donate_argnames=("state",), compiler_options=dict(xla) or None)


jitted_step = step_program()


def decode_steps(
    params,
    cfg: ModelConfig,
    state: SlotState,
    dec: DecodeInputs,
    stop_ids,
    max_new_tokens,
    spec: SpeculativeConfig | None = None,
    opts: Options = DEFAULT,
    experts_fn=None,
    axis: str | None = None,
    width: int | None = None,
):
    """Decodes every slot of dec.active from its first token (sampled at prefill) until a token in stop_ids [S']
    (padded with PAD) or max_new_tokens tokens, in one while_loop of `step`s.

    max_new_tokens: an int, or a traced scalar at most `width` (static), the output's width: one compiled program
    serves every limit up to it. Under a data-parallel plan (axis set, inside shard_map) every rank keeps stepping
    until all ranks are done, since the MoE exchange needs all of them each step.
    -> (tokens [S, width], PAD after a row's end; counters {"count": tokens [S], "steps" [S], "evaluated" [S, k],
    "accepted" [S, k]} (the last three for speculation: verification steps, and drafts evaluated and accepted per
    depth); state)."""
    s = dec.active.shape[0]
    k = spec.num_draft_tokens if spec is not None else 0
    rows = jnp.arange(s)
    first = state.tok if spec is None else state.drafts.last
    width = max_new_tokens if width is None else width
    out = jnp.full((s, width + k + 1), PAD, jnp.int32).at[:, 0].set(first)
    done = ~dec.active | jnp.isin(first, stop_ids) | (max_new_tokens <= 1)
    n = jnp.where(dec.active, 1, 0)
    zero = jnp.zeros_like(n)  # (derived from the rows, so varying over a plan's ranks as the loop's outputs are)
    zeros_k = zero[:, None] + jnp.zeros((1, k), jnp.int32)
    counters = {"count": n, "steps": zero, "evaluated": zeros_k, "accepted": zeros_k}

    def cond(carry):
        _, _, done, _ = carry
        running = jnp.sum(~done)
        if axis is not None:
            running = jax.lax.psum(running, axis)  # all ranks agree on the number of live requests
        return running > 0

    def body(carry):
        state, out, done, c = carry
        live = ~done
        state, _, nxt, _ = step(params, cfg, state, None, dataclasses.replace(dec, active=live), spec, opts, experts_fn)
        if spec is None:
            emitted, n_emit = nxt[:, None], live.astype(jnp.int32)
        else:
            emitted, n_emit, n_acc = nxt
        j = jnp.arange(emitted.shape[1])[None]
        is_stop = jnp.isin(emitted, stop_ids) & (j < n_emit[:, None])
        ends = jnp.where(is_stop.any(1), jnp.argmax(is_stop, 1) + 1, n_emit)
        n_emit = jnp.where(live, jnp.minimum(ends, max_new_tokens - c["count"]), 0)
        at = jnp.where(j < n_emit[:, None], c["count"][:, None] + j, out.shape[1])
        out = out.at[rows[:, None], at].set(emitted, mode="drop")
        count = c["count"] + n_emit
        done = done | is_stop.any(1) | (count >= max_new_tokens)
        c = {**c, "count": count, "steps": c["steps"] + live}
        if spec is not None:
            c["evaluated"] = c["evaluated"] + (live[:, None] & (n_acc[:, None] >= jnp.arange(k)[None]))
            c["accepted"] = c["accepted"] + (live[:, None] & (n_acc[:, None] >= jnp.arange(1, k + 1)[None]))
        return state, out, done, c

    state, out, _, counters = jax.lax.while_loop(cond, body, (state, out, done, counters))
    return out[:, :width], counters, state
