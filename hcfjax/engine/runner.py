"""The engine's device side: the paged cache and per-slot decode state, and one jitted step per engine iteration.

A step runs, in one compiled call, a prefill part (chunks of up to Bp requests, Tc tokens each, written into their
pages; a chunk that ends its prompt samples the request's first new token into its decode slot) and a decode part
(one token for every active slot, absorbed MLA over the cache). Decode slots are fixed (dp x max_slots rows, rank
major), prefill shapes are bucketed to powers of two, so steady state never recompiles; each new shape is logged as
a compile event. The tokens a step samples stay on the device as the next step's input: the host only sends page
tables and masks, and reads the sampled tokens back one step later (see engine.py).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

from hcfjax import cache as kvcache
from hcfjax.attention import CacheContext
from hcfjax.config import ModelConfig
from hcfjax.engine.scheduler import StepPlan
from hcfjax.generate import bucket
from hcfjax.model import Model, hidden_states, logits
from hcfjax.sampling import SamplingBatch, SamplingParams, sample_rows
from hcfjax.speculative import Drafts, SpeculativeConfig, spec_prefill, spec_step

log = logging.getLogger("hcfjax.engine")


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
    active: jax.Array  # [S] bool
    page_table: jax.Array  # [S, M]
    sp: SamplingBatch  # [S]
    seed: jax.Array  # [S]


def _keys(seed: jax.Array, count: jax.Array) -> jax.Array:
    return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seed, count)


def _clear_mtp_head(cache: kvcache.KVCache, first_mtp_layer: int, page, ok, spec) -> kvcache.KVCache:
    """Zeroes positions 0..k of the MTP layers in each new sequence's first page. Module m's entries start at
    position m + 1, so these positions are read but never written: a fresh cache holds zeros there, and a reused
    page must too, or a sequence would attend to the previous owner's entries."""
    page = jnp.where(ok, page, cache.num_pages)  # rows without a sequence: out of range, dropped
    n = spec.num_draft_tokens + 1
    kv = cache.kv.at[first_mtp_layer:, page, :n].set(0, mode="drop")
    scale = None if cache.scale is None else cache.scale.at[first_mtp_layer:, page, :n].set(0, mode="drop")
    return kvcache.KVCache(kv, scale)


@functools.partial(jax.jit, static_argnames=("cfg", "spec"), donate_argnames=("state",))
def engine_step(
    params,
    cfg: ModelConfig,
    state: SlotState,
    pre: PrefillInputs | None,
    dec: DecodeInputs | None,
    step,
    spec: SpeculativeConfig | None = None,
):
    """-> (state, first tokens [Bp] of the prefill rows (None without prefill), decode output (None without
    decode): next tokens [S], or with speculation (emitted [S, k+1], tokens emitted [S], drafts accepted [S]))."""
    cache, tok, length, count, drafts = state.cache, state.tok, state.length, state.count, state.drafts
    first = nxt = None
    key = jax.random.fold_in(jax.random.key(0), step)
    if pre is not None:
        b, t = pre.tokens.shape
        pos = pre.start[:, None] + jnp.arange(t)
        ctx = CacheContext(cache, pre.page_table, pre.start + pre.n, jnp.arange(t)[None] < pre.n[:, None])
        h, ctx = hidden_states(params, cfg, pre.tokens, pos, ctx, absorbed=False)
        cache = ctx.cache
        last = h[jnp.arange(b), jnp.maximum(pre.n - 1, 0)]
        first = sample_rows(logits(params, last), pre.sp, _keys(pre.seed, pre.count))
        tok = tok.at[pre.slot].set(first, mode="drop")
        length = length.at[pre.slot].set(pre.start + pre.n, mode="drop")
        count = count.at[pre.slot].set(pre.count + 1, mode="drop")
        if spec is not None:  # prompts come whole (start 0): the MTP modules see every anchor
            cache = _clear_mtp_head(cache, cfg.num_hidden_layers, pre.page_table[:, 0], pre.n > 0, spec)
            key, sub = jax.random.split(key)
            d, cache = spec_prefill(
                params, cfg, spec, h, pre.tokens, first, pre.n, cache, pre.page_table, pre.sp, pre.n > 0, sub
            )
            drafts = jax.tree.map(lambda s, x: s.at[pre.slot].set(x, mode="drop"), drafts, d)
    if dec is not None and spec is not None:
        no_stops = lambda emitted, n_emit: (n_emit, jnp.zeros(n_emit.shape, bool))  # the host applies stops
        drafts, cache, emitted, n_emit, _, n_acc = spec_step(
            params, cfg, spec, drafts, cache, dec.page_table, dec.sp, dec.active, no_stops, key
        )
        nxt = (emitted, n_emit, n_acc)
    elif dec is not None:
        ctx = CacheContext(cache, dec.page_table, length + 1, dec.active[:, None])
        h, ctx = hidden_states(params, cfg, tok[:, None], length[:, None], ctx, absorbed=True)
        cache = ctx.cache
        nxt = sample_rows(logits(params, h[:, 0]), dec.sp, _keys(dec.seed, count))
        tok = jnp.where(dec.active, nxt, tok)
        length = length + dec.active
        count = count + dec.active
    return SlotState(cache, tok, length, count, drafts), first, nxt


@dataclasses.dataclass
class Dispatched:
    """A step in flight: its device outputs and which requests they belong to."""

    plan: StepPlan
    first: jax.Array | None
    nxt: jax.Array | None
    chunk_epochs: list[int]  # each chunk's request epoch at dispatch (a preemption starts a new one)
    decode_slots: list[tuple]  # (request, slot, epoch) of the decode rows


class ModelRunner:
    def __init__(
        self,
        model: Model,
        num_slots: int,
        num_pages: int,
        page_size: int,
        max_pages: int,
        cache_dtype,
        spec: SpeculativeConfig | None = None,
        min_bucket: int = 16,
    ):
        self.model, self.cfg, self.spec, self.min_bucket = model, model.cfg, spec, min_bucket
        self.num_slots, self.max_pages, self.cache_page_size = num_slots, max_pages, page_size
        layers = self.cfg.num_hidden_layers + (len(model.params["mtp"]) if spec else 0)
        cache = kvcache.init_cache(self.cfg, num_pages, page_size, cache_dtype, num_layers=layers)
        drafts = None
        if spec is not None:
            k, r, s = spec.num_draft_tokens, 2 * spec.num_draft_tokens + 1, num_slots
            i32 = lambda *shape: jnp.zeros(shape, jnp.int32)
            hist_h = jnp.zeros((s, r, self.cfg.hidden_size), model.dtype)
            q = jnp.zeros((s, k, self.cfg.vocab_size), jnp.float32)
            drafts = Drafts(i32(s), i32(s), i32(s, k), q, hist_h, i32(s, r))
        self.state = SlotState(cache, *(jnp.zeros((num_slots,), jnp.int32) for _ in range(3)), drafts)
        self.steps = 0
        self.shapes: set = set()
        self.compiles: list[tuple[tuple, float]] = []  # (shape key, seconds of the first call)

    def dispatch(self, plan: StepPlan, max_prefill_rows: int, max_chunk: int) -> Dispatched:
        pre = self._prefill_inputs(plan, max_prefill_rows, max_chunk) if plan.chunks else None
        dec = self._decode_inputs(plan) if plan.decode else None
        first, nxt = self._call(pre, dec)
        epochs = [c.req.epoch for c in plan.chunks]
        return Dispatched(plan, first, nxt, epochs, [(r, r.slot, r.epoch) for r in plan.decode])

    def _call(self, pre: PrefillInputs | None, dec: DecodeInputs | None):
        key = (None if pre is None else pre.tokens.shape, dec is not None)
        t0 = time.perf_counter()
        self.state, first, nxt = engine_step(self.model.params, self.cfg, self.state, pre, dec, self.steps, self.spec)
        self.steps += 1
        if key not in self.shapes:  # jit compiles synchronously inside the first call of a shape
            self.shapes.add(key)
            self.compiles.append((key, time.perf_counter() - t0))
            log.info("compiled step for prefill %s, decode %s in %.1f s", key[0], key[1], self.compiles[-1][1])
        return first, nxt

    def warmup(self, max_rows: int, max_chunk: int) -> None:
        """Compiles every step shape the engine can produce (prefill rows x chunk buckets, with and without
        decode, and decode alone) on inputs that touch nothing, so serving never stops to compile."""
        s, m = self.num_slots, self.max_pages
        rows = sorted({min(bucket(b, 1), max_rows) for b in range(1, max_rows + 1)})
        cap = None if self.spec is not None else max(max_chunk, self.min_bucket)  # speculation: whole prompts
        top = self.max_pages * self.cache_page_size if cap is None else cap
        sizes = [1 << i for i in range(top.bit_length()) if 1 << i < top] + [top]
        fit = (lambda t: t) if cap is None else (lambda t: min(t, cap))
        chunks = sorted({fit(bucket(n, self.min_bucket)) for n in sizes})
        sp = lambda n: SamplingBatch.of([SamplingParams()] * n)
        i32 = lambda *shape: jnp.zeros(shape, jnp.int32)
        dec = DecodeInputs(jnp.zeros(s, bool), i32(s, m), sp(s), jnp.zeros(s, jnp.uint32))
        shapes = [(None, True)] + [((b, t), d) for b in rows for t in chunks for d in (False, True)]
        for shape, with_decode in shapes:
            pre = None
            if shape is not None:
                b, t = shape
                pre = PrefillInputs(
                    i32(b, t),
                    i32(b),
                    i32(b),
                    i32(b, m),
                    jnp.full(b, s, jnp.int32),
                    sp(b),
                    jnp.zeros(b, jnp.uint32),
                    i32(b),
                )
            self._call(pre, dec if with_decode else None)

    def _table(self, pages_list) -> np.ndarray:
        table = np.zeros((len(pages_list), self.max_pages), np.int32)
        for i, pages in enumerate(pages_list):
            table[i, : len(pages)] = pages
        return table

    def _prefill_inputs(self, plan: StepPlan, max_rows: int, max_chunk: int) -> PrefillInputs:
        chunks = plan.chunks
        b = min(bucket(len(chunks), 1), max_rows)
        t = bucket(max(c.n for c in chunks), self.min_bucket)
        t = t if self.spec is not None else min(t, max(max_chunk, self.min_bucket))
        tokens, start, n = np.zeros((b, t), np.int32), np.zeros(b, np.int32), np.zeros(b, np.int32)
        slot, seed, count = np.full(b, self.num_slots, np.int32), np.zeros(b, np.uint32), np.zeros(b, np.int32)
        for i, c in enumerate(chunks):
            tokens[i, : c.n] = c.req.fill[c.start : c.start + c.n]
            start[i], n[i], seed[i] = c.start, c.n, c.req.seed
            if c.final:
                slot[i], count[i] = c.req.slot, len(c.req.output)
        sp = SamplingBatch.of([c.req.sampling for c in chunks] + [chunks[0].req.sampling] * (b - len(chunks)))
        table = self._table([c.req.pages for c in chunks] + [[]] * (b - len(chunks)))
        return PrefillInputs(
            *map(jnp.asarray, (tokens, start, n, table, slot)), sp, jnp.asarray(seed), jnp.asarray(count)
        )

    def _decode_inputs(self, plan: StepPlan) -> DecodeInputs:
        s = self.num_slots
        active, seed = np.zeros(s, bool), np.zeros(s, np.uint32)
        pages: list[list[int]] = [[] for _ in range(s)]
        sampling = [plan.decode[0].sampling] * s
        for req in plan.decode:
            active[req.slot], seed[req.slot], pages[req.slot], sampling[req.slot] = (
                True,
                req.seed,
                req.pages,
                req.sampling,
            )
        return DecodeInputs(
            jnp.asarray(active), jnp.asarray(self._table(pages)), SamplingBatch.of(sampling), jnp.asarray(seed)
        )
