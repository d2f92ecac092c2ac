"""The engine's device side: the paged cache and per-slot decode state, and hcfjax.step for every engine iteration
(its prefill chunks, then its decode rows; under a decode plan, the plan's shard_map of each).

Decode slots are fixed (dp x max_slots, rank major). A step packs each device rank's decoding requests into its
first rows, whatever their slots (without a decode plan, one rank holds every DP rank's slots), N rows per rank,
N the `shapes.decode_bucket` of the most any rank has (a power of two or 3 x one, from min_decode_rows); rows without
a request are inactive.
Prefill parts are padded to the shapes of hcfjax.engine.shapes, which the scheduler keeps within the token budget.
An iteration runs its prefill part and its decode part as two programs, so the decode part compiles once per N, not
once per prefill shape. `warmup` compiles every program ahead of time, several at once, so serving never stops to
compile; a shape met without warm-up compiles on first use and is logged. The tokens a step samples stay on the
device as the next step's input: the host only sends page tables and masks, and reads the sampled tokens back one
step later (see engine.py).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from hcfjax import cache as kvcache
from hcfjax.engine import landing, memory
from hcfjax.engine.executables import ExecutableCache, compile_ahead, compile_all, step_key
from hcfjax.engine.landing import LandedCache
from hcfjax.engine.scheduler import StepPlan
from hcfjax.engine.shapes import StepShapes, decode_bucket
from hcfjax.model import Model
from hcfjax.options import DEFAULT, Options
from hcfjax.sampling import SamplingBatch, SamplingParams
from hcfjax.speculative import Drafts, SpeculativeConfig
from hcfjax.step import DecodeInputs, PrefillInputs, empty_state, step_program

log = logging.getLogger("hcfjax.engine")


def decode_key(rows: int, filters: bool = True) -> tuple[str, int, bool]:
    """The executables' key of the decode part of `rows` rows (all ranks) that samples with the vocabulary filters
    or without (SamplingBatch.filters); a prefill part's key is its tokens' shape (rows, tokens)."""
    return ("decode", rows, filters)


def is_decode(key) -> bool:
    return key[0] == "decode"


@dataclasses.dataclass(frozen=True)
class _DecodeRows:
    """The last decode part: who is in its rows (key), the pages each request held (counts) in the host copy of
    its page table (table), and its inputs on the device."""

    key: tuple
    counts: list[int]
    table: np.ndarray
    inputs: DecodeInputs


@dataclasses.dataclass
class Dispatched:
    """A step in flight: its device outputs and which requests they belong to."""

    plan: StepPlan
    first: jax.Array | None
    nxt: jax.Array | None
    chunk_epochs: list[int]  # each chunk's request epoch at dispatch (a preemption starts a new one)
    decode_rows: list[tuple]  # (request, row of the decode output, epoch) of the decode rows
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
        shapes: StepShapes | None = None,
        plan=None,
        eplb=None,
        options: Options = DEFAULT,
        disk: ExecutableCache | None = None,
        min_decode_rows: int = 8,
        weights: concurrent.futures.Future | None = None,
    ):
        """shapes: the prefill shapes steps pad to (default: 4 rows of up to 256 tokens). plan (a sharding.plans
        decode plan): the dp ranks on the plan's devices, each with its share of the slots
        and pages. eplb (sharding.eplb.LiveEplb, under a plan): lay the experts out in its physical slots and count
        the routed load of every step. options: how the model runs (hcfjax.options). disk: keep compiled steps there
        (hcfjax.engine.executables; steps without a plan). min_decode_rows: the smallest decode part (rows per
        rank; decode parts are `decode_bucket`s from here, up to the slots per rank). weights: a future of the
        model's params where model.params holds only their shapes (jax.ShapeDtypeStruct, on the device the steps
        run on): steps compile from the shapes while the weights load, and the first step waits for them
        (`take_weights`); not under a plan."""
        if weights is not None and plan is not None:
            raise ValueError("weights that load while the steps compile: not under a plan")
        self.model, self.cfg, self.spec, self.plan = model, model.cfg, spec, plan
        self.shapes = shapes or StepShapes(256, 4, whole_prompts=spec is not None, max_len=max_pages * page_size)
        self.options = options
        # device ranks: slots and pages are rank major, each rank's share on its device under a decode plan
        self.ranks = 1 if plan is None else plan.ranks
        self.slots_per_rank, self.pages_per_rank = num_slots // self.ranks, num_pages // self.ranks
        self.num_slots, self.max_pages, self.cache_page_size = num_slots, max_pages, page_size
        layers = self.cfg.num_hidden_layers + (len(model.params["mtp"]) if spec else 0)
        self.params = model.params
        self._weights = weights
        self._planned: dict = {}
        self.eplb = eplb
        if plan is not None:
            self.params = plan.place_params(model.params) if eplb is None else eplb.place(model.params)
        pool = memory.size(num_pages * memory.page_bytes(self.cfg.kv_dim, layers, page_size, cache_dtype))
        with memory.allocating(f"the KV cache ({num_pages} pages, {pool})"):
            cache = kvcache.init_cache(self.cfg, num_pages, page_size, cache_dtype, num_layers=layers)
            state = empty_state(self.cfg, num_slots, cache, spec, model.dtype)
            if plan is None:  # committed to its device from the start, as every step's and install's output will be:
                self._landing = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # one compiled shape each
                self.state = jax.device_put(state, self._landing)
            else:
                self._landing = plan.replicated()
                self.state = plan.place_state(state)
            jax.block_until_ready(self.state)
        shardings = None if plan is None else jax.tree.map(lambda x: x.sharding, self.state)
        self._install = jax.jit(landing.install, donate_argnums=(0,), out_shardings=shardings)
        self.landing = landing.Landing(self.state.cache, page_size, self._landing)
        self.steps = 0
        spr = self.slots_per_rank
        self.decode_sizes = sorted({min(decode_bucket(n, min_decode_rows), spr) for n in range(1, spr + 1)})
        # a decode step without the sampling filters too, where the filters cost a sort even when no row filters
        # (branch-free sampling); elsewhere a branch skips it inside the one step
        self.decode_filters = (True, False) if options.on("branch_free_sampling") else (True,)
        self.executables: dict = {}  # key (decode_key, or a prefill part's shape) -> the compiled step
        self.disk = disk
        self.compiles: list[tuple[tuple, float]] = []  # (key, seconds) of each step compiled on first use
        self._last_decode: _DecodeRows | None = None
        self._later: threading.Thread | None = None  # warmup's background compiles (rest_later)
        self._later_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._stop_later = threading.Event()

    def dispatch(self, plan: StepPlan) -> Dispatched:
        pre, rows = self._prefill_inputs(plan) if plan.chunks else (None, [])
        dec, dec_rows = self._decode_inputs(plan) if plan.decode else (None, [])
        first, nxt, load = self._call(pre, dec)
        epochs = [c.req.epoch for c in plan.chunks]
        decoded = [(r, i, r.epoch) for r, i in zip(plan.decode, dec_rows, strict=True)]
        return Dispatched(plan, first, nxt, epochs, decoded, rows, load)

    def _call(self, pre: PrefillInputs | None, dec: DecodeInputs | None):
        """One engine step: the prefill program, then the decode program (each part its own executable, so the
        decode part compiles once, not once per prefill shape). -> (first, next, load)."""
        first = nxt = None
        loads = []
        if pre is not None:
            self.state, first, _, load = self._run(tuple(pre.tokens.shape), pre, None)
            loads.append(load)
        if dec is not None:
            self.state, _, nxt, load = self._run(decode_key(dec.active.shape[0], dec.sp.filters), None, dec)
            loads.append(load)
        self.steps += 1
        loads = [x for x in loads if x is not None]
        return first, nxt, (sum(loads) if loads else None)

    @property
    def weights_pending(self) -> bool:
        """Whether the weights still load (`weights`): they are not yet in the device's memory."""
        return self._weights is not None

    def temp_bytes(self) -> list[int]:
        """The temporaries (bytes on a device) of every step compiled so far, from XLA's memory analysis."""
        analyses = (fn.memory_analysis() for fn in list(self.executables.values()))
        return [a.temp_size_in_bytes for a in analyses if a is not None]

    def take_weights(self) -> dict | None:
        """Waits for the weights that load while the steps compile (`weights`), checks that they have the shapes
        the steps were compiled for, and returns them; None once they are in, or without them."""
        if self._weights is None:
            return None
        params = self._weights.result()
        shape = lambda tree: (jax.tree.structure(tree), [(x.shape, x.dtype) for x in jax.tree.leaves(tree)])  # noqa: E731
        if shape(params) != shape(self.params):
            raise ValueError("the loaded weights do not have the shapes the steps were compiled for")
        self.params, self._weights = params, None
        return params

    def _run(self, key, pre: PrefillInputs | None, dec: DecodeInputs | None):
        self.take_weights()
        fn = self.executables.get(key)
        if fn is None:  # not warmed up: compile now (a pause every request in flight feels)
            t0 = time.perf_counter()
            fn = self.executables[key] = self._compile(pre, dec)
            self.compiles.append((key, time.perf_counter() - t0))
            what = f"{key[1]}-row decode{'' if key[2] else ' (no filters)'}" if is_decode(key) else f"{key} prefill"
            log.info("compiled the %s step in %.1f s", what, self.compiles[-1][1])
        return fn(self.params, self.state, pre, dec)

    def _compile(self, pre: PrefillInputs | None, dec: DecodeInputs | None):
        """The step for these inputs' shapes (one part or the other), compiled ahead of time: fn(params, state, pre,
        dec)."""
        xla = self.options.compiler_options(prefill=pre is not None)
        if self.plan is None:
            args = (self.params, self.cfg, self.state, pre, dec, self.spec, self.options)
            compile_now = lambda: compile_ahead(step_program(xla), *args)  # noqa: E731
            if self.disk is None:
                return compile_now()
            key = step_key(("step", self.cfg, self.spec, self.options), (self.params, self.state, pre, dec))
            return self.disk.get_or_compile(key, compile_now, self._landing.device_set)
        parts = (pre is not None, dec is not None)
        if parts not in self._planned:
            self._planned[parts] = self.plan.wrap_step(
                self.cfg, self.params, self.state, *parts, self.eplb is not None, self.spec, self.options
            )
        return compile_ahead(self._planned[parts], self.params, self.state, pre, dec)

    def rebalance_experts(self, step: int) -> None:
        """Re-places the experts for the loads EPLB has seen (between steps; the compiled steps stay valid)."""
        self.params = self.eplb.rebalance(self.params, step)

    def install(self, req, first: int, landed: LandedCache, drafts=None) -> None:
        """Puts a remotely prefilled request's cache (staged by `self.landing.stage`, which any thread may call) into
        its reserved pages and its first token (with speculation: its Drafts row, a dict of numpy arrays) into its
        slot. The cache holds every cache layer (the MTP modules' included) for req.pages in order."""
        if (drafts is None) != (self.spec is None):
            raise ValueError(
                f"{req.id}: the prefill {'did not make' if drafts is None else 'made'} drafts, and this"
                f" worker {'speculates' if self.spec else 'does not speculate'}"
            )
        if landed.pages != len(req.pages):
            raise ValueError(f"transferred cache of {req.id} has {landed.pages} pages, expected {len(req.pages)}")
        if drafts is not None:
            drafts = Drafts(**{f.name: np.asarray(drafts[f.name]) for f in dataclasses.fields(Drafts)})
        self._install_pages(req.pages, landed, req.slot, first, len(req.fill), len(req.output) + 1, drafts)

    def _install_pages(self, pages, landed: LandedCache, slot: int, first: int, length: int, count: int, drafts=None):
        table = np.full(landed.kv.shape[1], self.state.cache.num_pages, np.int32)  # padding: out of range, dropped
        table[: len(pages)] = pages
        self.state = self._install(
            self.state,
            jax.device_put(table, self._landing),
            landed.kv,
            landed.scale,
            jnp.int32(slot),
            jnp.int32(first),
            jnp.int32(length),
            jnp.int32(count),
            None if drafts is None else jax.device_put(drafts, self._landing),
        )

    def warmup_install(self, device_arrays: bool = False) -> None:
        """Compiles install for every power of two of pages (a PD decode worker), writing nothing; device_arrays (a
        transport that delivers jax arrays): also their padding from every page count."""
        cache = self.state.cache
        drafts = None if self.spec is None else jax.tree.map(lambda x: x[0], self.state.drafts)
        b = 1
        while b < 2 * self.max_pages:
            kv = np.zeros((cache.kv.shape[0], b, self.cache_page_size, cache.kv.shape[-1]), cache.kv.dtype)
            scale = None if cache.scale is None else np.zeros(kvcache.scale_shape(kv.shape), cache.scale.dtype)
            self._install_pages([], self.landing.stage(kv, scale), self.num_slots, 0, 0, 0, drafts)
            b *= 2
        if device_arrays:
            self.landing.compile_device_pads(self.max_pages)

    def warmup(
        self, prefill: bool = True, progress: Callable[[int, int], None] | None = None, rest_later: bool = False
    ) -> int:
        """Compiles the decode step of every row count and, unless only decoding here (a PD decode worker), the
        prefill step of every shape in `shapes`, several at once. progress(done, total) is told as each compile
        ends. rest_later: only the decode step of all slots and the prefill shapes no other one holds
        (`StepShapes.maximal`) now, the others in a background thread; until a step is compiled, a step that needs
        it runs padded to the smallest compiled one that holds it. -> the number of programs compiled now."""
        inputs = {
            decode_key(n * self.ranks, f): (None, self.idle_decode(n, f))
            for n in self.decode_sizes
            for f in self.decode_filters
        }
        for b, t in self.shapes.all() if prefill else []:
            pre = self.idle_prefill((b, t))
            inputs[tuple(pre.tokens.shape)] = (pre, None)
        # the decode steps, then the largest shapes first: their kernels take longest to lower and compile
        order = lambda k: (0, -k[1], not k[2]) if is_decode(k) else (1, -k[0] * k[1])  # noqa: E731
        todo = sorted((k for k in inputs if k not in self.executables), key=order)
        later = []
        if rest_later:
            top = {decode_key(self.num_slots)} | {(b * self.ranks, t) for b, t in self.shapes.maximal()}
            later = [k for k in todo if k not in top]
            todo = [k for k in todo if k in top]
        self._compile_all(todo, inputs, progress)
        if later:
            self._later = threading.Thread(
                target=self._compile_later, args=(later, inputs), name="hcfjax-compile-later", daemon=True
            )
            self._later.start()
        return len(todo)

    def _compile_later(self, keys, inputs) -> None:
        t0 = time.perf_counter()
        try:
            self._compile_all(keys, inputs, background=True)
        except Exception:  # noqa: BLE001 - a shape that fails to compile here compiles on first use instead
            if not self._stop_later.is_set():
                log.exception("compiling step shapes in the background failed")
            return
        log.info("compiled %d more step shapes in the background in %.1f s", len(keys), time.perf_counter() - t0)

    def compiling(self) -> bool:
        """Whether step shapes are still being compiled in the background (warmup's rest_later)."""
        return self._later is not None and self._later.is_alive()

    def stop_compiling(self) -> None:
        """Drops the background compiles not yet started (a server shutting down); those in flight run to their
        end, which nothing waits for but the interpreter's exit."""
        self._stop_later.set()
        if (pool := self._later_pool) is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def _compile_all(self, todo, inputs, progress=None, background: bool = False) -> None:
        def register(pool):
            if background:
                self._later_pool = pool
                if self._stop_later.is_set():  # stopped before the thread got here
                    pool.shutdown(wait=False, cancel_futures=True)

        def check():
            if self._weights is not None and self._weights.done() and self._weights.exception():
                raise self._weights.exception()  # the weights cannot load: no use compiling for them

        on_gpu = any(d.platform == "gpu" for d in self._landing.device_set)
        jobs = {k: functools.partial(self._compile, *inputs[k]) for k in todo}
        compile_all(jobs, self.executables.__setitem__, on_gpu, progress, check, register)

    def idle_prefill(self, shape: tuple[int, int]) -> PrefillInputs:
        """A prefill part that writes nothing: `shape` (rows per rank, tokens) rows that end no prompt."""
        b, t = shape[0] * self.ranks, shape[1]
        z = lambda *dims: np.zeros(dims, np.int32)  # noqa: E731
        sp = SamplingBatch.host([SamplingParams()] * b, filters=True)
        drop = np.full(b, self.slots_per_rank, np.int32)
        return self._put(
            PrefillInputs(z(b, t), z(b), z(b), z(b, self.max_pages), drop, sp, z(b).astype(np.uint32), z(b))
        )

    def idle_decode(self, rows: int | None = None, filters: bool = True) -> DecodeInputs:
        """A decode part that writes nothing: `rows` rows per rank (default: every slot), all inactive."""
        return self._put(self._decode_arrays((rows or self.slots_per_rank) * self.ranks, [], [], filters))

    def _table(self, pages_list) -> np.ndarray:
        table = np.zeros((len(pages_list), self.max_pages), np.int32)
        for i, pages in enumerate(pages_list):
            table[i, : len(pages)] = pages
        return table

    def _rank(self, req) -> int:
        return req.rank if self.plan is not None else 0

    def _local_pages(self, req, start: int = 0) -> list[int]:
        """req's pages from its start-th on, as indices into its rank's share of the cache."""
        base = self._rank(req) * self.pages_per_rank
        return [p - base for p in req.pages[start:]]

    def _prefill_inputs(self, plan: StepPlan) -> tuple[PrefillInputs, list[int]]:
        """Rows rank major (rank r's chunks in rows r * b .. r * b + b - 1), slots and pages rank local."""
        chunks = plan.chunks
        per_rank, index = [0] * self.ranks, []
        for c in chunks:
            r = self._rank(c.req)
            index.append((r, per_rank[r]))
            per_rank[r] += 1
        longest = max(c.n for c in chunks)
        b_local, t = self._prefill_shape(self.shapes.rows(max(per_rank)), self.shapes.tokens(longest))
        rows = [r * b_local + i for r, i in index]
        b = b_local * self.ranks
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
        sp = SamplingBatch.host(sampling, filters=True)  # (a few rows: one prefill step serves every request)
        return self._put(PrefillInputs(tokens, start, n, self._table(pages), slot, sp, seed, count)), rows

    def _prefill_shape(self, rows: int, tokens: int) -> tuple[int, int]:
        """The (rows per rank, tokens) a prefill part of that shape runs as (`_compiled_cover`)."""
        b = rows * self.ranks
        holds = lambda k: not is_decode(k) and k[0] >= b and k[1] >= tokens  # noqa: E731
        key = self._compiled_cover((b, tokens), holds, size=lambda k: (k[0] * k[1], k[1]))
        return key[0] // self.ranks, key[1]

    def _compiled_cover(self, key, holds, size):
        """The step `key` runs as: itself, unless it is still being compiled in the background, then the smallest
        (by size(k)) compiled step k that holds it (holds(k))."""
        if not self.compiling() or key in self.executables:
            return key
        return min((k for k in list(self.executables) if holds(k)), key=size, default=key)

    def _put(self, tree):
        """A step's inputs (numpy arrays) onto the device, or over a plan's ranks by rows, in one transfer."""
        return jax.device_put(tree, None if self.plan is None else self.plan.rows())

    def _decode_inputs(self, plan: StepPlan) -> tuple[DecodeInputs, list[int]]:
        """The decode rows (N rows per rank, a rank's requests packed into its first rows, in plan order) and each
        request's row. They change only when a request joins or leaves, which builds them anew, or takes a new
        page, which at a large batch happens nearly every step: then only the new pages are written into the last
        page table and only the table goes to the device (a decoding request's pages only grow, Scheduler._grow
        appending them, and a preemption changes its epoch, so the key; fewer pages would build them anew)."""
        ranks, seen = [self._rank(r) for r in plan.decode], [0] * self.ranks
        index = []  # each request's place among its rank's
        for k in ranks:
            index.append(seen[k])
            seen[k] += 1
        filters = len(self.decode_filters) == 1 or any(r.sampling.filters for r in plan.decode)
        n, filters = self._decode_size(max(index) + 1, filters)
        rows = [k * n + i for k, i in zip(ranks, index, strict=True)]
        key = (n, filters, tuple((r.slot, r.id, r.epoch) for r in plan.decode))
        counts = [len(r.pages) for r in plan.decode]
        last = self._last_decode
        if last is None or last.key != key or any(has < had for had, has in zip(last.counts, counts, strict=True)):
            host = self._decode_arrays(n * self.ranks, plan.decode, rows, filters)
            self._last_decode = _DecodeRows(key, counts, host.page_table, self._put(host))
        elif last.counts != counts:
            table = last.table.copy()  # (the last inputs' device copy may share the host array's memory)
            for req, i, had, has in zip(plan.decode, rows, last.counts, counts, strict=True):
                if has != had:
                    table[i, had:has] = self._local_pages(req, had)
            inputs = dataclasses.replace(last.inputs, page_table=self._put(table))
            self._last_decode = _DecodeRows(key, counts, table, inputs)
        return self._last_decode.inputs, rows

    def _decode_size(self, need: int, filters: bool) -> tuple[int, bool]:
        """(rows per rank, filters) of the decode part that holds `need` rows on every rank: the smallest
        decode size that does, without the filters where no row needs them (`_compiled_cover`; a step with the
        filters serves any batch)."""
        rows = next(s for s in self.decode_sizes if s >= need) * self.ranks
        holds = lambda k: is_decode(k) and k[1] >= rows and (k[2] or not filters)  # noqa: E731
        key = self._compiled_cover(decode_key(rows, filters), holds, size=lambda k: (k[1], k[2]))
        return key[1] // self.ranks, key[2]

    def _decode_arrays(self, size: int, reqs, rows: list[int], filters: bool = True) -> DecodeInputs:
        """The decode inputs of `reqs` in `rows` of `size`, as numpy arrays."""
        active, seed = np.zeros(size, bool), np.zeros(size, np.uint32)
        slot = np.full(size, self.slots_per_rank, np.int32)  # (no slot: the step drops the row's writes)
        pages: list[list[int]] = [[] for _ in range(size)]
        sampling = [reqs[0].sampling if reqs else SamplingParams()] * size
        for req, i in zip(reqs, rows, strict=True):
            active[i], seed[i], sampling[i], pages[i] = True, req.seed, req.sampling, self._local_pages(req)
            slot[i] = req.slot - self._rank(req) * self.slots_per_rank
        sp = SamplingBatch.host(sampling, filters)
        return DecodeInputs(active, self._table(pages), sp, seed, slot)
