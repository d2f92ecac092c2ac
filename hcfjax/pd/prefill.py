"""The prefill worker: whole prompts under the prefill plan, their latent KV cache sent to the decode rank that
reserved pages for them.

Jobs arrive from decode workers (each names where its cache must go). The worker batches them (up to max_rows
rows and token_budget tokens; a prompt of `layerwise_threshold` tokens or more runs alone), runs the forward one
layer at a time into its own scratch pages, samples each prompt's first token exactly as the colocated engine does
(same keys, same sampling), and hands the pages to the transport:

- whole mode (short prompts): after the last layer, one piece per request with every layer (the transport merges
  pieces bound for the same decode worker into few large messages);
- layerwise mode (long prompts): each group of `layer_group` layers is sent as soon as it is dispatched. Dispatch is
  asynchronous, so the transport's thread waits for the layer while this thread dispatches the next ones: the
  transfer of layer l overlaps the compute of layers l + 1 .. L - 1, and only the last group remains after it.

With speculative decoding the worker also runs the MTP modules over the prompt (their cache layers follow the
main model's and are sent last) and makes the first k drafts; the job's result then carries the request's draft
state (a Drafts row) with its first token, which is what the decode worker needs to verify at its first step.

Prompts longer than `chunk` tokens are run layer-major in chunks (every chunk through layer l, then layer l + 1),
so attention memory stays bounded and layer l's cache is complete as soon as its last chunk ran. A job's scratch
pages are released when its transfer is acknowledged or fails; the job's future then holds its first token or
the error. Nothing here blocks on a transfer.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import math
import queue
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from hcfjax import cache as kvcache
from hcfjax import trace
from hcfjax.config import ModelConfig
from hcfjax.engine import memory
from hcfjax.engine.executables import ExecutableCache, compile_ahead, compile_all, lowering_workers, step_key
from hcfjax.engine.pages import PageAllocator
from hcfjax.generate import bucket
from hcfjax.model import Model, embed, final_hidden
from hcfjax.options import DEFAULT, Options
from hcfjax.pd.transport import Piece
from hcfjax.quantize import cache_dtype_for
from hcfjax.sampling import SamplingBatch, SamplingParams
from hcfjax.speculative import Drafts, SpeculativeConfig
from hcfjax.step import PrefillInputs, finish_prefill, prefill_layer
from pallas_kernels import lowering_cache

log = logging.getLogger("hcfjax.pd")


@dataclasses.dataclass
class PrefillJob:
    key: str  # the transfer's key: the decode worker's request id and epoch
    tokens: list[int]  # prompt (plus the output so far, for a request preempted on the decode side)
    sampling: SamplingParams
    seed: int
    count: int  # the request's rng counter at this sample (its output tokens so far)
    dest: str  # the decode worker's transport address
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    future: concurrent.futures.Future = dataclasses.field(default_factory=concurrent.futures.Future)
    arrival: float = dataclasses.field(default_factory=time.monotonic)


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    num_pages: int = 1024  # scratch pages (a job waits until its pages are free)
    page_size: int = 16  # must equal the decode workers'
    max_rows: int = 4
    token_budget: int = 4096  # prompt tokens per batch (a longer prompt runs alone)
    chunk: int = 2048  # tokens per forward chunk
    min_bucket: int = 16  # the smallest chunk shape (prompt lengths are padded to powers of two from here)
    layerwise_threshold: int = 8192  # prompts of this many tokens or more are sent layer by layer
    layer_group: int = 1  # layers per piece in layerwise mode
    transfer_timeout_s: float = 30.0
    cache_dtype: str = "auto"  # auto (the scheme's), float or int8 (quantize.cache_dtype_for): as the decoders'
    speculative: SpeculativeConfig | None = None  # the decode workers' (the first drafts are made here)
    options: Options = DEFAULT  # how the model runs (hcfjax.options)
    executable_cache: str | None = None  # a directory where compiled programs are kept (hcfjax.engine.executables)

    def __post_init__(self):
        sizes = ("num_pages", "page_size", "max_rows", "token_budget", "chunk", "min_bucket", "layerwise_threshold")
        for name in (*sizes, "layer_group"):
            if not (isinstance(getattr(self, name), int) and getattr(self, name) >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not (isinstance(self.transfer_timeout_s, int | float) and 0 < self.transfer_timeout_s < math.inf):
            raise ValueError(f"transfer_timeout_s must be a number > 0, got {self.transfer_timeout_s!r}")
        if self.speculative is not None and self.speculative.forced_acceptance is not None:
            raise ValueError("forced_acceptance is for benchmarks only; a serving worker verifies drafts for real")


# The worker's programs: each compiles ahead of time once per shape of its operands (PrefillWorker._call); static
# arguments are keyword-only, as a compiled program is called without them.
@functools.partial(jax.jit, static_argnames="chunk")
def _embed(params, tokens, *, chunk: int) -> tuple[jax.Array, ...]:
    """The prompts' embeddings [B, T, D] as chunks of `chunk` tokens."""
    x = embed(params, tokens)
    return tuple(x[:, s : s + chunk] for s in range(0, tokens.shape[1], chunk))


@functools.partial(jax.jit, static_argnames=("cfg", "is_moe", "opts"), donate_argnames="cache")
def _layer(seg, i, layer, x, start, cache, table, n, *, cfg: ModelConfig, is_moe: bool, opts: Options):
    """Layer `layer` (params: row i of the stacked segment) over one chunk of x [B, Tc, D] at positions start.."""
    p = jax.tree.map(lambda a: a[i], seg)
    return prefill_layer(p, cfg, is_moe, layer, x, start, cache, table, n, opts)


@functools.partial(jax.jit, static_argnames=("cfg", "spec", "opts"), donate_argnames="cache")
def _finish(params, chunks, pre: PrefillInputs, cache, *, cfg: ModelConfig, spec: SpeculativeConfig | None, opts):
    """The first tokens (and with speculation the MTP modules over the prompts and the first drafts), as the
    engine's step makes them after its prefill: the same keys, the same tokens and drafts."""
    x = chunks[0] if len(chunks) == 1 else jnp.concatenate(chunks, axis=1)
    return finish_prefill(params, cfg, final_hidden(params, cfg, x), pre, cache, spec, opts)


@functools.partial(jax.jit, static_argnames="layers")
def _take_pages(cache: kvcache.KVCache, pages, lo, *, layers: int):
    """Layers [lo, lo + layers) of these pages [n]: kv [layers, n, page_size, D] and the scales (None for a bf16
    cache). One compile per page count and number of layers (lo is traced)."""
    take = lambda x: None if x is None else jax.lax.dynamic_slice_in_dim(x, lo, layers)[:, pages]
    return take(cache.kv), take(cache.scale)


class PrefillWorker:
    def __init__(self, model: Model, sender, config: PrefillConfig = PrefillConfig(), plan=None):
        """sender: a hcfjax.pd.transport Sender; plan: a sharding.plans prefill plan (TP + small EP), or None."""
        self.model, self.cfg, self.config, self.sender, self.plan = model, model.cfg, config, sender, plan
        c = config
        self.params = model.params
        if plan is not None:
            from sharding.plans import shard_params

            self.params = shard_params(model.params, plan)
        dtype = cache_dtype_for(model, c.cache_dtype)
        self.spec = c.speculative
        if self.spec is not None and not model.params.get("mtp"):
            raise ValueError("speculative decoding needs MTP layers, and this model has none")
        self.layers = self.cfg.num_hidden_layers + (len(model.params["mtp"]) if self.spec else 0)
        # the scratch pages fit the device beside the weights, or the worker says so (a padding page besides, where
        # padding rows point, within the steps' reserve)
        device = jax.devices()[0] if plan is None else plan.mesh.devices.flat[0]
        per_page = memory.page_bytes(self.cfg.kv_dim, self.layers, c.page_size, dtype)
        memory.fit_pages(c.num_pages, True, per_page, memory.device_memory(device), 0, 1, "--prefill-pages")
        # every operand that is not a weight lives on all of the plan's devices (replicated), so each program has
        # one sharding to compile for
        self._sharding = NamedSharding(plan.mesh, P()) if plan is not None else SingleDeviceSharding(device)
        new_cache = lambda: kvcache.init_cache(self.cfg, c.num_pages + 1, c.page_size, dtype, num_layers=self.layers)
        with memory.allocating(f"the prefill worker's KV scratch ({c.num_pages} pages)", "--prefill-pages"):
            self.cache = jax.block_until_ready(jax.jit(new_cache, out_shardings=self._sharding)())
        self._programs: dict[tuple, jax.stages.Compiled] = {}  # key (_call) -> its compiled program
        self._recording: dict | None = None  # while the warm-up records a forward's programs (_recorded)
        self.compiles: list[tuple[tuple, float]] = []  # (key, seconds) of each program compiled on first use
        self.disk = None if c.executable_cache is None else ExecutableCache(c.executable_cache)
        self.alloc = PageAllocator(c.num_pages, c.page_size)
        self._pad_page = c.num_pages
        self._queue: queue.Queue[PrefillJob | None] = queue.Queue()
        self._held: dict[str, list[int]] = {}  # job key -> scratch pages until its transfer ends
        self._lock = threading.Lock()
        self._pages_freed = threading.Condition(self._lock)
        self._flushers = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="hcfjax-prefill-flush")
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.stats = {"jobs": 0, "batches": 0, "layerwise": 0, "failed": 0}

    # -- any thread ------------------------------------------------------------------------------------------------
    def submit(self, job: PrefillJob) -> concurrent.futures.Future:
        """Queues a job; its future gives the first token once the cache has been delivered (or the error)."""
        if self._stopping:
            raise RuntimeError("the prefill worker is shutting down")
        if not job.tokens:
            raise ValueError("a prefill job needs at least one token")
        if self.alloc.pages_for(len(job.tokens)) > self.config.num_pages:
            raise ValueError(f"a prompt of {len(job.tokens)} tokens needs more than the worker's scratch pages")
        trace.mark("submit", job.key, n=len(job.tokens))
        self._queue.put(job)
        return job.future

    @property
    def pages_held(self) -> int:
        return self.alloc.num_used

    @property
    def queued(self) -> int:
        """Jobs submitted and not yet taken into a batch by the loop."""
        return self._queue.qsize()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="hcfjax-prefill", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._queue.put(None)
        if self._thread is not None:
            self._thread.join(10)
        self._flushers.shutdown(wait=False, cancel_futures=True)

    # -- the loop ----------------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        pending: list[PrefillJob] = []
        while not self._stopping:
            if not pending:
                job = self._queue.get()
                if job is None:
                    break
                pending.append(job)
            while True:  # everything that arrived meanwhile
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    self._stopping = True
                    break
                pending.append(job)
            pending = [j for j in pending if not self._drop_cancelled(j)]
            batch = self._take_batch(pending)
            if not batch:
                continue
            pending = [j for j in pending if j not in batch]
            try:
                self._run(batch)
            except Exception as e:  # noqa: BLE001 - a failed batch fails its jobs, not the worker
                log.exception("prefill batch failed")
                for j in batch:
                    self._release(j)
                    if not j.future.done():
                        j.future.set_exception(e)
        for j in pending:
            j.future.set_exception(RuntimeError("the prefill worker shut down"))

    def _drop_cancelled(self, job: PrefillJob) -> bool:
        if job.cancelled.is_set():
            job.future.cancel()
            return True
        return False

    def _take_batch(self, pending: list[PrefillJob]) -> list[PrefillJob]:
        """Shortest prompts first; a long (layerwise) prompt runs alone. Waits for scratch pages if the first job
        does not fit; jobs after it that do not fit wait for the next batch."""
        c = self.config
        order = sorted(pending, key=lambda j: (len(j.tokens), j.arrival))
        batch, tokens = [], 0
        for j in order:
            long = len(j.tokens) >= c.layerwise_threshold
            if batch and (long or len(batch) >= c.max_rows or tokens + len(j.tokens) > c.token_budget):
                break
            need = self.alloc.pages_for(len(j.tokens))
            with self._lock:
                if not batch:
                    while self.alloc.num_free < need and not self._stopping:
                        self._pages_freed.wait(0.1)
                    if self._stopping:
                        return []
                elif self.alloc.num_free < need:
                    break
                self._held[j.key] = self.alloc.allocate(need)
            batch.append(j)
            tokens += len(j.tokens)
            if long:
                break
        return batch

    def _release(self, job: PrefillJob) -> None:
        with self._lock:
            pages = self._held.pop(job.key, None)
            if pages:
                self.alloc.release(pages)
                self._pages_freed.notify_all()

    def _run(self, batch: list[PrefillJob]) -> None:
        c = self.config
        lens = [len(j.tokens) for j in batch]
        b, tc, t, m = self._shape(len(batch), max(lens))
        tokens, n = np.zeros((b, t), np.int32), np.zeros(b, np.int32)
        table = np.full((b, m), self._pad_page, np.int32)
        seed, count = np.zeros(b, np.uint32), np.zeros(b, np.int32)
        sampling = [SamplingParams()] * b
        for i, j in enumerate(batch):
            tokens[i, : lens[i]], n[i], seed[i], count[i], sampling[i] = j.tokens, lens[i], j.seed, j.count, j.sampling
            pages = self._held[j.key]
            table[i, : len(pages)] = pages
        layerwise = max(lens) >= c.layerwise_threshold
        send = lambda lo, hi: self._send(batch, lo, hi)
        for j in batch:
            trace.mark("batch", j.key, shape=[b, tc, t, m])
        result = self._forward(tokens, n, table, seed, count, sampling, tc, send, layerwise)
        for j in batch:
            trace.mark("dispatched", j.key)
        self.stats["jobs"] += len(batch)
        self.stats["batches"] += 1
        self.stats["layerwise"] += len(batch) if layerwise else 0
        for i, j in enumerate(batch):
            self._flushers.submit(self._finish, j, result, i)

    def _shape(self, rows: int, longest: int) -> tuple[int, int, int, int]:
        """(rows, chunk, padded length, page-table width) of a batch. A layer compiles per (rows, chunk, width),
        all powers of two (or the chunk cap), so few shapes compile."""
        c = self.config
        tc = min(bucket(longest, c.min_bucket), c.chunk)
        t = math.ceil(longest / tc) * tc
        return bucket(rows, 1), tc, t, bucket(math.ceil(t / c.page_size), 1)

    def _forward(self, tokens, n, table, seed, count, sampling, tc: int, send, layerwise: bool):
        """The layer-major forward of a batch; send(lo, hi) hands layers [lo, hi) to the transport (each group
        once dispatched in layerwise mode, all at the end otherwise; None: nothing is sent).
        -> (first tokens [B], Drafts [B] or None), on the device."""
        cfg, opts = self.cfg, self.config.options
        (b, t), m = tokens.shape, table.shape[1]
        total = cfg.num_hidden_layers
        with self._mesh():
            zeros = np.zeros(n.shape, np.int32)
            sp = SamplingBatch.host(sampling, filters=True)  # one program for any request
            tokens_j, table_j, n_j, zeros, sp, seed_j, count_j = self._put((tokens, table, n, zeros, sp, seed, count))
            xs = self._call(("embed", b, t, tc), _embed, self.params, tokens_j, chunk=tc)
            groups = iter(self._groups())
            group = next(groups)
            segments = zip(self.params["segments"], cfg.layer_segments, strict=True)
            for k, (seg, (first, count_seg, is_moe)) in enumerate(segments):
                static = dict(cfg=cfg, is_moe=is_moe, opts=opts)
                for i in range(count_seg):
                    layer, outs = first + i, []
                    for c, x in enumerate(xs):
                        args = (seg, i, layer, x, c * tc, self.cache, table_j, n_j)
                        xo, self.cache = self._call(("layer", k, b, tc, m), _layer, *args, **static)
                        outs.append(xo)
                    xs = tuple(outs)
                    if layerwise and layer + 1 == group[1]:
                        send(*group)
                        group = next(groups, None)
            pre = PrefillInputs(tokens_j, zeros, n_j, table_j, zeros, sp, seed_j, count_j)
            static = dict(cfg=cfg, spec=self.spec, opts=opts)
            key = ("finish", b, t, tc, m)
            first_tok, drafts, self.cache = self._call(key, _finish, self.params, xs, pre, self.cache, **static)
            if self.spec is not None and layerwise and send is not None:
                send(total, self.layers)
            if not layerwise and send is not None:
                send(0, self.layers)
        return first_tok, drafts

    def _call(self, key: tuple, fn, *args, **static):
        """Runs fn's program for these operands: compiled ahead of time and kept under `key` (the operands' shapes
        it was compiled for), or compiled now (a pause for the batch, logged). While the warm-up records a forward
        (_recorded), the program is only noted and its outputs' shapes returned."""
        if self._recording is not None:
            self._recording.setdefault(key, (fn, args, static))
            return jax.tree.map(self._spec, fn.eval_shape(*args, **static))  # traced once per operands' shapes
        program = self._programs.get(key)
        if program is None:
            t0 = time.perf_counter()
            program = self._programs[key] = self._compiled(key, fn, args, static)
            self.compiles.append((key, time.perf_counter() - t0))
            log.info("compiled the prefill program %s in %.1f s", key, self.compiles[-1][1])
        return program(*args)

    def _compiled(self, key: tuple, fn, args, static) -> jax.stages.Compiled:
        """fn's program for these operands (compiled, or loaded from the executable cache), checked to leave its
        outputs where the worker's next programs take them: every operand lives on all the worker's devices."""
        with self._mesh():
            compile_now = lambda: compile_ahead(fn, *args, **static)  # noqa: E731
            if self.disk is None or self.plan is not None:  # (a stored program loads onto one device)
                program = compile_now()
            else:
                stored = step_key(("prefill", fn.__name__, tuple(sorted(static.items()))), args)
                program = self.disk.get_or_compile(stored, compile_now, self._sharding.device_set)
        for out in jax.tree.leaves(program.out_info):
            if not out.sharding.is_equivalent_to(self._sharding, len(out.shape)):
                raise RuntimeError(f"the prefill program {key} leaves an output as {out.sharding}, not replicated")
        return program

    def _put(self, tree):
        """Host arrays onto the worker's devices, in one transfer (their shapes while the warm-up records)."""
        if self._recording is not None:
            return jax.tree.map(self._spec, tree)
        return jax.device_put(tree, self._sharding)

    def _spec(self, a) -> jax.ShapeDtypeStruct:
        """An operand's shape and dtype on the worker's devices."""
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self._sharding)

    def _recorded(self, shape: tuple[int, int, int, int]) -> dict:
        """The programs a batch of this shape runs, {key: (fn, operands, static arguments)}: the forward traced on
        the operands' shapes, nothing run or compiled."""
        self._recording, cache = {}, self.cache
        try:
            self.run_empty(shape)
            return self._recording
        finally:
            self._recording, self.cache = None, cache

    def warmup(self, max_len: int, progress=None) -> float:
        """Compiles every program a batch of prompts up to max_len tokens runs (for every rows x chunk x length
        shape: the embedding, each segment's layer and the last step) and the gathers of every page count a send
        takes, several at once and nothing run, so no request waits for a compile; returns the seconds it took.
        progress(done, total) is told as each compile ends."""
        if self._thread is not None:
            raise RuntimeError("warm the prefill worker up before start(): its batches would run on shapes alone")
        t0 = time.perf_counter()
        on_gpu = any(d.platform == "gpu" for d in self._sharding.device_set)
        # on a GPU the forwards are recorded with the kernels they meet handed to processes of their own, which
        # lower them meanwhile (largest shapes first, whose kernels take longest)
        lowering = lowering_cache.lowering_processes(lowering_workers())
        with lowering if on_gpu else contextlib.nullcontext():
            with lowering_cache.discovering():
                todo = {}
                for shape in sorted(self.shapes(max_len), key=lambda s: (-s[0] * s[1], -s[2])):
                    todo.update(self._recorded(shape))
            todo.update(self._gathers(max_len))
            log.info("recorded %d prefill programs in %.1f s", len(todo), time.perf_counter() - t0)
            jobs = {k: functools.partial(self._compiled, k, *v) for k, v in todo.items() if k not in self._programs}
            compile_all(jobs, self._programs.__setitem__, on_gpu, progress)
        return time.perf_counter() - t0

    def _gathers(self, max_len: int) -> dict:
        """The programs of what a send gathers, for every page width: the whole cache, or a layerwise piece (a
        batch with a prompt past the threshold sends every row's cache layerwise, short rows' too)."""
        c, total = self.config, self.cfg.num_hidden_layers
        groups = self._groups() + ([(total, self.layers)] if self.spec is not None else [])
        widths = {self._gather_width(n) for n in range(1, min(self.alloc.pages_for(max_len), c.num_pages) + 1)}
        layerwise = max_len >= c.layerwise_threshold
        pieces = sorted({self.layers} | ({hi - lo for lo, hi in groups} if layerwise else set()))
        lo = self._spec(np.int32(0))
        return {
            ("take", w, layers): (_take_pages, (self.cache, self._spec(np.zeros(w, np.int32)), lo), dict(layers=layers))
            for w in sorted(widths)
            for layers in pieces
        }

    def _gather_width(self, n: int) -> int:
        """The pages a send of n pages gathers: its power of two over a host-staged transport (the padding is cut
        on the host, so few gathers compile), else exactly n (a device transport sends what is gathered)."""
        return bucket(n, 1) if self.sender.host else n

    def _groups(self) -> list[tuple[int, int]]:
        """The layer ranges a layerwise send makes of the decoder layers: `layer_group` at a time."""
        total, g = self.cfg.num_hidden_layers, self.config.layer_group
        return [(lo, min(lo + g, total)) for lo in range(0, total, g)]

    def shapes(self, max_len: int) -> list[tuple[int, int, int, int]]:
        """Every (rows, chunk, padded length, page-table width) a batch of prompts up to max_len tokens takes (a
        prompt past the chunk runs as whole chunks: its length pads to a multiple of the chunk). A
        batch of r > 1 rows holds no prompt past the token budget less the other rows' tokens (one each at least),
        nor a layerwise one (`_take_batch`), so its longest prompt is shorter than max_len may be."""
        c = self.config

        def longest(rows: int) -> int:
            return max_len if rows == 1 else min(max_len, c.token_budget - (rows - 1), c.layerwise_threshold - 1)

        def lengths(rows: int) -> list[int]:  # a length of each bucket and of each multiple of the chunk, up to top
            top = max(longest(rows), 1)
            return [min(k, top) for k in [*_powers(1, top), *range(c.chunk, top + c.chunk, c.chunk)]]

        return sorted({self._shape(r, k) for r in range(1, c.max_rows + 1) for k in lengths(r)})

    def run_empty(self, shape: tuple[int, int, int, int]):
        """Dispatches one forward of this batch shape on rows that write nothing (the warm-up's, and what
        hcfjax.bench.sim_validate times); -> its (first tokens, drafts), not waited for."""
        b, tc, t, m = shape
        z = np.zeros(b, np.int32)
        table = np.full((b, m), self._pad_page, np.int32)
        tokens, sampling = np.zeros((b, t), np.int32), [SamplingParams()] * b
        return self._forward(tokens, z, table, z.astype(np.uint32), z, sampling, tc, None, False)

    def _mesh(self):
        return jax.set_mesh(self.plan.mesh) if self.plan is not None else contextlib.nullcontext()

    def _send(self, batch: list[PrefillJob], lo: int, hi: int) -> None:
        total = self.layers
        for j in batch:
            held = self._held[j.key]
            pages = np.full(self._gather_width(len(held)), self._pad_page, np.int32)
            pages[: len(held)] = held
            pages, lo_j = self._put((pages, np.int32(lo)))
            kv, scale = self._call(("take", len(pages), hi - lo), _take_pages, self.cache, pages, lo_j, layers=hi - lo)
            self.sender.send(j.dest, Piece(j.key, (lo, hi), kv, scale, total, pages=len(held)))

    def _finish(self, job: PrefillJob, result, row: int) -> None:
        """(a flusher thread) Waits for the job's transfer; frees its pages; resolves its future with
        (first token, the row's Drafts as numpy arrays or None)."""
        try:
            if trace.enabled():  # when the batch's compute ended (its first token is sampled after the last layer)
                jax.block_until_ready(result[0])
                trace.mark("computed", job.key)
            self.sender.flush(job.key, self.config.transfer_timeout_s)
            trace.mark("flushed", job.key)
            first, drafts = result
            if drafts is not None:  # the row's Drafts, as {field: numpy array}
                drafts = {f.name: np.asarray(getattr(drafts, f.name))[row] for f in dataclasses.fields(Drafts)}
            if not job.future.done():
                job.future.set_result((int(np.asarray(first)[row]), drafts))
        except Exception as e:  # noqa: BLE001 - the job's caller gets the error
            self.stats["failed"] += 1
            if not job.future.done():
                job.future.set_exception(e)
        finally:
            self._release(job)


def _powers(lo: int, hi: int) -> list[int]:
    """lo, 2 lo, 4 lo, ... up to the first >= hi (every bucket a length in [1, hi] maps to)."""
    out = [lo]
    while out[-1] < hi:
        out.append(out[-1] * 2)
    return out
