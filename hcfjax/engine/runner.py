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
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

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


_DRAFT_TAG = 0x5EED  # the prefill's first drafts: apart from the first decode step's keys (same counter)


def draft_keys(seed: jax.Array, count: jax.Array) -> jax.Array:
    """Per-row keys [B] for the first drafts after a prefill whose sampled token was the count-th: a request's
    drafts depend only on its seed and counter, so the colocated engine and a PD prefill worker draw the same."""
    return jax.vmap(lambda k: jax.random.fold_in(k, _DRAFT_TAG))(_keys(seed, count + 1))


def step_body(
    params,
    cfg: ModelConfig,
    state: SlotState,
    pre: PrefillInputs | None,
    dec: DecodeInputs | None,
    spec: SpeculativeConfig | None = None,
    experts_fn=None,
    with_load: bool = False,
):
    """One engine step; experts_fn runs the routed experts (sharding.ep.ep_experts under the decode plan).

    -> (state, first tokens [Bp] of the prefill rows (None without prefill), decode output (None without
    decode): next tokens [S], or with speculation (emitted [S, k+1], tokens emitted [S], drafts accepted [S]),
    with_load: tokens routed to each expert [n_moe_layers, E] by the real rows (EPLB's counters), else None)."""
    if with_load and spec is not None:
        raise ValueError("expert-load counting covers plain decoding only")
    cache, tok, length, count, drafts = state.cache, state.tok, state.length, state.count, state.drafts
    first = nxt = None
    loads = []  # per part, [n_moe_layers, E]: only real tokens count (padding and mock rows route too)
    if pre is not None:
        b, t = pre.tokens.shape
        pos = pre.start[:, None] + jnp.arange(t)
        real = jnp.arange(t)[None] < pre.n[:, None]
        ctx = CacheContext(cache, pre.page_table, pre.start + pre.n, real)
        h, ctx, *loads = hidden_states(
            params, cfg, pre.tokens, pos, ctx, False, experts_fn, with_load=real if with_load else False
        )
        cache = ctx.cache
        last = h[jnp.arange(b), jnp.maximum(pre.n - 1, 0)]
        first = sample_rows(logits(params, last), pre.sp, _keys(pre.seed, pre.count))
        tok = tok.at[pre.slot].set(first, mode="drop")
        length = length.at[pre.slot].set(pre.start + pre.n, mode="drop")
        count = count.at[pre.slot].set(pre.count + 1, mode="drop")
        if spec is not None:  # prompts come whole (start 0): the MTP modules see every anchor
            d, cache = spec_prefill(
                params,
                cfg,
                spec,
                h,
                pre.tokens,
                first,
                pre.n,
                cache,
                pre.page_table,
                pre.sp,
                pre.n > 0,
                draft_keys(pre.seed, pre.count),
                experts_fn,
            )
            drafts = jax.tree.map(lambda s, x: s.at[pre.slot].set(x, mode="drop"), drafts, d)
    if dec is not None and spec is not None:
        no_stops = lambda emitted, n_emit: (n_emit, jnp.zeros(n_emit.shape, bool))  # the host applies stops
        keys = _keys(dec.seed, count)  # each row's own: its draws do not depend on its batch
        drafts, cache, emitted, n_emit, _, n_acc = spec_step(
            params, cfg, spec, drafts, cache, dec.page_table, dec.sp, dec.active, no_stops, keys, experts_fn
        )
        count = count + jnp.where(dec.active, n_emit, 0)  # the rng counter: tokens emitted so far
        nxt = (emitted, n_emit, n_acc)
    elif dec is not None:
        ctx = CacheContext(cache, dec.page_table, length + 1, dec.active[:, None])
        h, ctx, *load = hidden_states(
            params,
            cfg,
            tok[:, None],
            length[:, None],
            ctx,
            True,
            experts_fn,
            dec.active[:, None] if with_load else False,
        )
        loads += load
        cache = ctx.cache
        nxt = sample_rows(logits(params, h[:, 0]), dec.sp, _keys(dec.seed, count))
        tok = jnp.where(dec.active, nxt, tok)
        length = length + dec.active
        count = count + dec.active
    load = sum(loads) if with_load else None
    return SlotState(cache, tok, length, count, drafts), first, nxt, load


engine_step = jax.jit(step_body, static_argnames=("cfg", "spec", "experts_fn", "with_load"), donate_argnames=("state",))


def planned_step(
    plan,
    cfg: ModelConfig,
    params,
    state: SlotState,
    with_prefill: bool,
    with_decode: bool,
    with_load: bool = False,
    spec: SpeculativeConfig | None = None,
):
    """engine_step under the decode plan: a shard_map over the plan's ranks, each running attention on its own slot
    rows and cache pages (page tables and slots in rank-local indices), the MoE exchanging routed tokens over EP
    (sharding.ep, exchange "auto"). Every rank runs every step; rows without work are mock rows that write nothing
    (and, with_load, add nothing to the expert loads, which are summed over the ranks)."""
    from sharding.ep import ep_experts
    from sharding.plans import param_specs

    row, pages = P("ep"), P(None, "ep")
    drafts_spec = None if state.drafts is None else jax.tree.map(lambda _: row, state.drafts)
    state_spec = SlotState(jax.tree.map(lambda _: pages, state.cache), row, row, row, drafts_spec)
    pre_spec = PrefillInputs(row, row, row, row, row, SamplingBatch(row, row, row, row), row, row)
    dec_spec = DecodeInputs(row, row, SamplingBatch(row, row, row, row), row)

    def local(params, state, pre, dec):  # sampling keys come from each row's seed and counter
        state, first, nxt, load = step_body(params, cfg, state, pre, dec, spec, ep_experts("ep"), with_load)
        return state, first, nxt, None if load is None else jax.lax.psum(load, "ep")

    specs = (
        param_specs(params, plan),
        state_spec,
        pre_spec if with_prefill else None,
        dec_spec if with_decode else None,
    )
    out = (state_spec, row if with_prefill else None, row if with_decode else None, P() if with_load else None)
    return jax.jit(jax.shard_map(local, mesh=plan.mesh, in_specs=specs, out_specs=out), donate_argnums=(1,))


def _install(state: SlotState, pages, kv, scale, slot, first, length, count, drafts) -> SlotState:
    """Writes a remotely prefilled request's cache (kv [L, n, page, D] into `pages` [n]; padding pages are out of
    range and dropped) and its slot's first token, length and rng counter, or with speculation its Drafts row."""
    cache = state.cache
    layers = kv.shape[0]
    new_kv = cache.kv.at[:layers, pages].set(kv.astype(cache.kv.dtype), mode="drop")
    new_scale = None if cache.scale is None else cache.scale.at[:layers, pages].set(scale, mode="drop")
    return dataclasses.replace(
        state,
        cache=kvcache.KVCache(new_kv, new_scale),
        tok=state.tok.at[slot].set(first, mode="drop"),
        length=state.length.at[slot].set(length, mode="drop"),
        count=state.count.at[slot].set(count, mode="drop"),
        drafts=None
        if drafts is None
        else jax.tree.map(lambda s, x: s.at[slot].set(x, mode="drop"), state.drafts, drafts),
    )


@dataclasses.dataclass
class Dispatched:
    """A step in flight: its device outputs and which requests they belong to."""

    plan: StepPlan
    first: jax.Array | None
    nxt: jax.Array | None
    chunk_epochs: list[int]  # each chunk's request epoch at dispatch (a preemption starts a new one)
    decode_slots: list[tuple]  # (request, slot, epoch) of the decode rows
    chunk_rows: list[int]  # the prefill row of each chunk
    load: jax.Array | None = None  # [n_moe_layers, E] tokens routed to each expert (with EPLB)


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
        plan=None,
        eplb=None,
    ):
        """eplb (sharding.eplb.LiveEplb, under a plan): lay the experts out in its physical slots and count the
        routed load of every step."""
        self.model, self.cfg, self.spec, self.min_bucket, self.plan = model, model.cfg, spec, min_bucket, plan
        # device ranks: slots and pages are rank major, each rank's share on its device under a decode plan
        self.ranks = 1 if plan is None else plan.mesh.shape["ep"]
        self.slots_per_rank, self.pages_per_rank = num_slots // self.ranks, num_pages // self.ranks
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
        self.params = model.params
        self._planned: dict = {}
        self.eplb = eplb
        if plan is not None:
            from sharding.plans import shard_params

            self.params = shard_params(model.params, plan) if eplb is None else eplb.place(model.params)
            rows, pages = NamedSharding(plan.mesh, P("ep")), NamedSharding(plan.mesh, P(None, "ep"))
            drafts_at = None if drafts is None else jax.tree.map(lambda _: rows, drafts)
            self.state = jax.device_put(
                self.state, SlotState(jax.tree.map(lambda _: pages, cache), rows, rows, rows, drafts_at)
            )
        shardings = None if plan is None else jax.tree.map(lambda x: x.sharding, self.state)
        self._landing = (
            NamedSharding(plan.mesh, P()) if plan is not None else jax.sharding.SingleDeviceSharding(jax.devices()[0])
        )
        if plan is None:  # committed to its device from the start, as every step's and install's output will be:
            self.state = jax.device_put(self.state, self._landing)  # one compiled shape each, whatever came first
        self._install = jax.jit(_install, donate_argnums=(0,), out_shardings=shardings)
        self.steps = 0
        self.shapes: set = set()
        self.compiles: list[tuple[tuple, float]] = []  # (shape key, seconds of the first call)

    def dispatch(self, plan: StepPlan, max_prefill_rows: int, max_chunk: int) -> Dispatched:
        pre, rows = self._prefill_inputs(plan, max_prefill_rows, max_chunk) if plan.chunks else (None, [])
        dec = self._decode_inputs(plan) if plan.decode else None
        first, nxt, load = self._call(pre, dec)
        epochs = [c.req.epoch for c in plan.chunks]
        return Dispatched(plan, first, nxt, epochs, [(r, r.slot, r.epoch) for r in plan.decode], rows, load)

    def _call(self, pre: PrefillInputs | None, dec: DecodeInputs | None):
        key = (None if pre is None else pre.tokens.shape, dec is not None)
        t0 = time.perf_counter()
        if self.plan is None:
            self.state, first, nxt, load = engine_step(self.params, self.cfg, self.state, pre, dec, self.spec)
        else:
            parts = (pre is not None, dec is not None)
            if parts not in self._planned:
                with_load = self.eplb is not None
                self._planned[parts] = planned_step(
                    self.plan, self.cfg, self.params, self.state, *parts, with_load, self.spec
                )
            fn = self._planned[parts]
            self.state, first, nxt, load = fn(self.params, self.state, pre, dec)
        self.steps += 1
        if key not in self.shapes:  # jit compiles synchronously inside the first call of a shape
            self.shapes.add(key)
            self.compiles.append((key, time.perf_counter() - t0))
            log.info("compiled step for prefill %s, decode %s in %.1f s", key[0], key[1], self.compiles[-1][1])
        return first, nxt, load

    def rebalance_experts(self, step: int) -> None:
        """Re-places the experts for the loads EPLB has seen (between steps; the compiled steps stay valid)."""
        self.params = self.eplb.rebalance(self.params, step)

    def install(self, req, first: int, kv, scale=None, drafts=None) -> None:
        """Puts a remotely prefilled request's cache into its reserved pages and its first token (with
        speculation: its Drafts row, a dict of numpy arrays) into its slot. kv [L, n_pages, page_size, D] for
        req.pages in order (L: every cache layer, the MTP modules' included); scale with an int8 cache. Page counts
        are padded to powers of two, so few shapes compile."""
        cache = self.state.cache
        n = len(req.pages)
        if (drafts is None) != (self.spec is None):
            raise ValueError(
                f"{req.id}: the prefill {'did not make' if drafts is None else 'made'} drafts, and this"
                f" worker {'speculates' if self.spec else 'does not speculate'}"
            )
        want = (cache.kv.shape[0], n, self.cache_page_size, cache.kv.shape[-1])
        if tuple(kv.shape) != want:
            raise ValueError(f"transferred cache of {req.id} has shape {tuple(kv.shape)}, expected {want}")
        if jnp.dtype(kv.dtype) != cache.kv.dtype or (scale is None) != (cache.scale is None):
            raise ValueError(
                f"transferred cache of {req.id} is {jnp.dtype(kv.dtype).name}"
                f"{' with' if scale is not None else ' without'} scales; this worker's cache is {cache.kv.dtype.name}"
            )
        if drafts is not None:
            drafts = Drafts(**{f.name: jnp.asarray(drafts[f.name]) for f in dataclasses.fields(Drafts)})
        self._install_pages(req.pages, kv, scale, req.slot, first, len(req.fill), len(req.output) + 1, drafts)

    def _install_pages(self, pages, kv, scale, slot: int, first: int, length: int, count: int, drafts=None) -> None:
        n, b = len(pages), bucket(len(pages), 1)
        table = np.full(b, self.state.cache.num_pages, np.int32)  # padding pages: out of range, dropped
        table[:n] = pages
        # numpy (host-staged transports) or device arrays (jax transfer) are put in one place first (replicated
        # over the plan's mesh, or on the engine's device): one compiled install per page bucket, any transport
        pad = lambda x: jnp.pad(jax.device_put(x, self._landing), ((0, 0), (0, b - n)) + ((0, 0),) * (x.ndim - 2))
        self.state = self._install(
            self.state,
            jnp.asarray(table),
            pad(kv),
            None if scale is None else pad(scale),
            jnp.int32(slot),
            jnp.int32(first),
            jnp.int32(length),
            jnp.int32(count),
            None if drafts is None else jax.device_put(drafts, self._landing),
        )

    def warmup_install(self) -> None:
        """Compiles install for every page count (a PD decode worker: the padding to the count's bucket, then the
        bucket's install), writing nothing."""
        cache = self.state.cache
        drafts = None if self.spec is None else jax.tree.map(lambda x: x[0], self.state.drafts)
        kv = np.zeros((cache.kv.shape[0], self.max_pages, self.cache_page_size, cache.kv.shape[-1]), cache.kv.dtype)
        scale = None if cache.scale is None else np.zeros(kv.shape[:-1] + (2,), np.float32)
        for n in range(1, self.max_pages + 1):
            part = None if scale is None else scale[:, :n]
            self._install_pages([cache.num_pages] * n, kv[:, :n], part, self.num_slots, 0, 0, 0, drafts)

    def warmup(self, max_rows: int, max_chunk: int, prefill: bool = True) -> None:
        """Compiles every step shape the engine can produce (prefill rows x chunk buckets, with and without
        decode, and decode alone; only decode without local prefill) on inputs that touch nothing, so serving
        never stops to compile."""
        s, m = self.num_slots, self.max_pages
        rows = sorted({self._rows_shape(b, max_rows) for b in range(1, max_rows + 1)})
        # every chunk length up to the longest (a whole prompt with speculation) maps to one of these shapes
        top = self.max_pages * self.cache_page_size if self.spec is not None else max(max_chunk, self.min_bucket)
        sizes = [1 << i for i in range(top.bit_length()) if 1 << i < top] + [top]
        chunks = sorted({self._chunk_shape(n, max_chunk) for n in sizes})
        sp = lambda n: jax.tree.map(self._put, SamplingBatch.of([SamplingParams()] * n))
        z = lambda *shape: self._put(np.zeros(shape, np.int32))
        dec = DecodeInputs(self._put(np.zeros(s, bool)), z(s, m), sp(s), self._put(np.zeros(s, np.uint32)))
        shapes = [(None, True)] + [((b * self.ranks, t), d) for b in rows for t in chunks for d in (False, True)]
        for shape, with_decode in shapes if prefill else shapes[:1]:
            pre = None
            if shape is not None:
                b, t = shape
                drop = self._put(np.full(b, self.slots_per_rank, np.int32))
                pre = PrefillInputs(z(b, t), z(b), z(b), z(b, m), drop, sp(b), self._put(np.zeros(b, np.uint32)), z(b))
            self._call(pre, dec if with_decode else None)

    @staticmethod
    def _rows_shape(n: int, max_rows: int) -> int:
        """Prefill rows per rank for n chunks: a power of two, at most max_rows."""
        return min(bucket(n, 1), max_rows)

    def _chunk_shape(self, n: int, max_chunk: int) -> int:
        """Prefill tokens per row for a longest chunk of n: a power of two from min_bucket, capped at the chunk
        budget (with speculation prompts come whole, so no cap)."""
        t = bucket(n, self.min_bucket)
        return t if self.spec is not None else min(t, max(max_chunk, self.min_bucket))

    def _table(self, pages_list) -> np.ndarray:
        table = np.zeros((len(pages_list), self.max_pages), np.int32)
        for i, pages in enumerate(pages_list):
            table[i, : len(pages)] = pages
        return table

    def _rank(self, req) -> int:
        return req.rank if self.plan is not None else 0

    def _local_pages(self, req) -> list[int]:
        base = self._rank(req) * self.pages_per_rank
        return [p - base for p in req.pages]

    def _prefill_inputs(self, plan: StepPlan, max_rows: int, max_chunk: int) -> tuple[PrefillInputs, list[int]]:
        """Rows rank major (rank r's chunks in rows r * b .. r * b + b - 1), slots and pages rank local."""
        chunks = plan.chunks
        per_rank, index = [0] * self.ranks, []
        for c in chunks:
            r = self._rank(c.req)
            index.append((r, per_rank[r]))
            per_rank[r] += 1
        b_local = self._rows_shape(max(per_rank), max_rows)
        rows = [r * b_local + i for r, i in index]
        b = b_local * self.ranks
        t = self._chunk_shape(max(c.n for c in chunks), max_chunk)
        tokens, start, n = np.zeros((b, t), np.int32), np.zeros(b, np.int32), np.zeros(b, np.int32)
        slot, seed, count = np.full(b, self.slots_per_rank, np.int32), np.zeros(b, np.uint32), np.zeros(b, np.int32)
        sampling = [chunks[0].req.sampling] * b
        pages: list[list[int]] = [[] for _ in range(b)]
        for i, c in zip(rows, chunks, strict=True):
            tokens[i, : c.n] = c.req.fill[c.start : c.start + c.n]
            start[i], n[i], seed[i], sampling[i], pages[i] = (
                c.start,
                c.n,
                c.req.seed,
                c.req.sampling,
                self._local_pages(c.req),
            )
            if c.final:
                slot[i], count[i] = c.req.slot - self._rank(c.req) * self.slots_per_rank, len(c.req.output)
        put = self._put
        inputs = PrefillInputs(
            *map(put, (tokens, start, n, self._table(pages), slot)),
            jax.tree.map(put, SamplingBatch.of(sampling)),
            put(seed),
            put(count),
        )
        return inputs, rows

    def _put(self, x):
        x = jnp.asarray(x)
        return x if self.plan is None else jax.device_put(x, NamedSharding(self.plan.mesh, P("ep")))

    def _decode_inputs(self, plan: StepPlan) -> DecodeInputs:
        s = self.num_slots
        active, seed = np.zeros(s, bool), np.zeros(s, np.uint32)
        pages: list[list[int]] = [[] for _ in range(s)]
        sampling = [plan.decode[0].sampling] * s
        for req in plan.decode:
            active[req.slot], seed[req.slot], sampling[req.slot] = True, req.seed, req.sampling
            pages[req.slot] = self._local_pages(req)
        put = self._put
        return DecodeInputs(
            put(active), put(self._table(pages)), jax.tree.map(put, SamplingBatch.of(sampling)), put(seed)
        )
