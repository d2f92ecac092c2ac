"""The engine loop: admit, plan, dispatch, stream, with host work overlapping the device.

Each iteration: take new requests and aborts from the inbox, plan the next step (scheduler), dispatch it (an
asynchronous jitted call), and only then read back the previous step's sampled tokens, stream them and retire
finished requests. The host's bookkeeping for step n therefore runs while the device computes step n + 1. The price
is one step of lag: a request that finished in step n still runs (and is discarded) in step n + 1, which its pages
allow for.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator

import jax
import numpy as np

from hcfjax import trace
from hcfjax.detokenize import TextStream
from hcfjax.engine import memory
from hcfjax.engine.config import EngineConfig, EngineStopped, QueueFull, context_length, lookahead_tokens
from hcfjax.engine.executables import ExecutableCache
from hcfjax.engine.hooks import Hooks
from hcfjax.engine.request import FinishReason, Output, Request, Status, stream_events
from hcfjax.engine.runner import Dispatched, ModelRunner
from hcfjax.engine.scheduler import Scheduler, SchedulerConfig
from hcfjax.engine.shapes import StepShapes
from hcfjax.frontdoor import Checked, FrontDoor, InvalidRequest, Submitting
from hcfjax.model import Model
from hcfjax.quantize import cache_dtype_for

log = logging.getLogger("hcfjax.engine")


def _live_eplb(model: Model, c: EngineConfig, plan):
    if not c.eplb_interval:
        return None
    if plan is None:
        log.info("EPLB is off: without a decode plan the experts are not split over ranks")
        return None
    from sharding.eplb import LiveEplb

    if c.eplb_nodes > 1 and model.cfg.n_group % c.eplb_nodes:
        log.warning(
            "EPLB: %d expert groups do not split over %d nodes, so the placement is global, not hierarchical",
            model.cfg.n_group,
            c.eplb_nodes,
        )
    return LiveEplb(model.cfg, plan, c.eplb_redundant, c.eplb_interval, c.eplb_window, num_nodes=c.eplb_nodes)


class Engine(Submitting):
    def __init__(self, model: Model, config: EngineConfig | None = None, decode_plan=None, remote=None, weights=None):
        """decode_plan (sharding.plans.decode_plan): run the dp ranks on the plan's devices, attention data
        parallel and experts over EP; config.dp must equal the plan's size. Without one all ranks share a device.

        remote (a PD decode worker, hcfjax.pd.decode): prompts are prefilled elsewhere. Each admitted request (its
        slot and pages reserved) is handed to `remote.start(engine, request)`, which must not block; the prefill's
        result comes back through `land` (or `land_failed`).

        weights (a concurrent.futures.Future of model's params, without a plan): model.params holds only their
        shapes (jax.ShapeDtypeStruct), so `warmup` compiles while the weights load; `start` (or the first step)
        waits for them."""
        config = config or EngineConfig()
        self.model, self.config, self.cfg = model, config, model.cfg
        self.remote = remote
        c = config
        if decode_plan is not None and decode_plan.mesh.shape["ep"] != c.dp:
            raise ValueError(f"config.dp={c.dp} but the decode plan has {decode_plan.mesh.shape['ep']} ranks")
        if c.max_model_len is not None and c.max_model_len > self.cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {c.max_model_len} is longer than the model's context (max_position_embeddings"
                f" {self.cfg.max_position_embeddings})"
            )
        self.max_model_len = context_length(self.cfg.max_position_embeddings, c.max_model_len)
        spec = c.speculative
        if spec is not None and not model.params.get("mtp"):
            raise ValueError(
                "speculative decoding needs MTP layers, and this model has none (its checkpoint lacks them, or it was"
                " loaded with mtp=False)"
            )
        k = spec.num_draft_tokens if spec else 0
        lookahead = lookahead_tokens(k)
        max_pages = math.ceil((self.max_model_len + lookahead) / c.page_size)
        dtype = cache_dtype_for(model, c.cache_dtype)
        # the pool fits the device's memory beside the weights (loading, when `weights` is given, or in use)
        self._device = jax.devices()[0] if decode_plan is None else decode_plan.mesh.devices.flat[0]
        self._weight_bytes = memory.tree_bytes(model.params) if weights is not None else 0
        layers = self.cfg.num_hidden_layers + (len(model.params["mtp"]) if spec else 0)
        self._page_bytes = memory.page_bytes(self.cfg.kv_dim, layers, c.page_size, dtype)
        ranks_here = c.dp if decode_plan is None else 1  # the ranks whose pages share the device
        wanted = c.num_pages or max(max_pages, c.max_slots * max_pages // 2)
        if c.num_pages is None and np.dtype(dtype) == np.int8:
            wanted = memory.past_write_window(wanted, self.cfg, layers, c.page_size, ranks_here, model.dtype, c.options)
        num_pages = memory.fit_pages(
            wanted,
            c.num_pages is not None,
            self._page_bytes * ranks_here,
            memory.device_memory(self._device),
            self._weight_bytes,
            max_pages,
        )
        self.context_from_pages = num_pages < max_pages  # an explicit pool smaller than one longest request
        if self.context_from_pages:
            if num_pages * c.page_size - lookahead < 2:
                raise ValueError(
                    f"num_pages {num_pages} of {c.page_size} tokens cannot hold one request (a prompt token, an"
                    f" output token and {lookahead} tokens of a step's lookahead)"
                )
            # A request runs on one rank's pages: one longer than they hold would wait forever, so the context a
            # request may ask for is what they hold.
            self.max_model_len, max_pages = num_pages * c.page_size - lookahead, num_pages
        self.door = FrontDoor(self.cfg, model.tokenizer, self.max_model_len)
        shapes = StepShapes(
            c.token_budget, c.max_prefill_rows, c.min_prefill_bucket, spec is not None, max_pages * c.page_size
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                dp=c.dp,
                max_slots=c.max_slots,
                num_pages=num_pages,
                page_size=c.page_size,
                token_budget=c.token_budget,
                mixed_token_budget=c.mixed_token_budget,
                max_prefill_rows=c.max_prefill_rows,
                step_tokens=k + 1,
                page_slack=k,
                whole_prompts=spec is not None,
                spf_window_s=c.spf_window_s,
                max_wait_s=c.max_wait_s,
                balance=c.balance,
                remote_prefill=remote is not None,
                shapes=shapes,
            )
        )
        self.runner = ModelRunner(
            model,
            c.dp * c.max_slots,
            c.dp * num_pages,
            c.page_size,
            max_pages,
            dtype,
            spec,
            shapes,
            decode_plan,
            _live_eplb(model, c, decode_plan),
            c.options,
            None if c.executable_cache is None else ExecutableCache(c.executable_cache),
            c.min_decode_rows,
            weights,
        )
        self.total_pages = c.dp * num_pages
        self.clock = time.monotonic
        self._requests: dict[str, Request] = {}
        self._inbox: list[Request] = []
        self._aborts: list[str] = []
        self._landed: list[tuple] = []  # (request id, epoch, first token, kv, scale) or (request id, epoch, error)
        self._idle = False  # the last step had nothing to run: wait for an event before the next
        self._lock = threading.Condition()
        self._pending: Dispatched | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.failure: str | None = None  # why the loop stopped, if an error stopped it
        self._on_failure, self._after_step = Hooks(), Hooks()
        self.steps = 0

    # -- the caller's side (any thread) ----------------------------------------------------------------------------
    def tokenize(self, text: str) -> list[int]:
        """A text prompt's token ids as a request's would be (raises InvalidRequest for text that cannot fit)."""
        return self.door.encode(text)

    def add(self, request_id: str, c: Checked, events=None) -> Request:
        """Queues a request that passed the front door (submit, or a front end in another process, checked it);
        `events` (anything with put(Output), by default a queue of the request's own) receives its Outputs. Raises
        QueueFull, EngineStopped, or InvalidRequest for an id in use."""
        rid = request_id
        tok = self.model.tokenizer
        text = TextStream(tok, c.stop_ids, c.stop) if tok is not None else None
        with self._lock:
            if self._stopping:
                if self.failure:
                    raise EngineStopped(f"the engine stopped after an error: {self.failure}")
                raise EngineStopped("the engine is shutting down")
            queued = len(self._inbox) + len(self.scheduler.waiting)
            if queued >= self.config.max_queue:
                raise QueueFull(f"{queued} requests are waiting (max_queue={self.config.max_queue}); retry later")
            if rid in self._requests:
                raise InvalidRequest(f"request id {rid!r} is in use", "request_id")
            req = Request(rid, c.prompt, c.sampling, c.max_new_tokens, c.stop_ids, c.seed, self.clock(), text=text)
            if events is not None:
                req.events = events
            self._requests[rid] = req
            self._inbox.append(req)
            trace.mark("arrive", rid, n=len(c.prompt))
            self._lock.notify()
        return req

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
            self._lock.notify()

    def land(self, request_id: str, epoch: int, first_token: int, kv, scale=None, drafts=None) -> None:
        """A remote prefill finished: kv [L, n_pages, page_size, D] (+ scale) for the request's reserved pages, in
        order, the first token it sampled, and with speculation its draft state (a Drafts row). Ignored if the
        request ended or was preempted (epoch changed). The cache is checked and put on the devices here, on the
        caller's thread; the loop then writes it into the request's pages."""
        try:
            landed = (int(first_token), self.runner.landing.stage(kv, scale), drafts)
        except Exception as e:  # noqa: BLE001 - a bad transfer fails its request, not the worker
            log.exception("staging the transferred cache of %s failed", request_id)
            landed = (f"{type(e).__name__}: {e}",)
        with self._lock:
            self._landed.append((request_id, epoch, *landed))
            self._lock.notify()

    def land_failed(self, request_id: str, epoch: int, error: str) -> None:
        """A remote prefill or its transfer failed: the request ends with an error and its pages are freed."""
        with self._lock:
            self._landed.append((request_id, epoch, error))
            self._lock.notify()

    def stream(self, request: Request, timeout: float | None = None) -> Iterator[Output]:
        """The request's Output events until the one with `finish` set (those queued together merged:
        `next_output`)."""
        return stream_events(request.events, timeout)

    def ready(self) -> bool:
        """Whether requests are served: the loop runs and the engine is not shutting down."""
        return self._thread is not None and not self._stopping

    def snapshot(self) -> dict:
        s = self.scheduler
        free = sum(a.num_free for a in s.alloc)
        return {
            "queued": len(s.waiting) + len(self._inbox),
            "running": len(s.running),
            "free_pages": free,
            "total_pages": self.total_pages,
            "cache_used": 1 - free / self.total_pages,
            "steps": self.steps,
            "compiles": len(self.runner.executables),  # step shapes compiled (by warm-up or on first use)
            "compiling": self.runner.compiling(),  # step shapes still compiling in the background
            "preemptions": s.preemptions,
            "should_grow": s.should_grow,
            "expected_output": s.expected_output,
        }

    # -- the loop (one thread) -------------------------------------------------------------------------------------
    def start(self) -> None:
        """Starts the loop, once the weights are in (`weights`: they may still be loading)."""
        if (params := self.runner.take_weights()) is not None:
            self.model = dataclasses.replace(self.model, params=params)
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="hcfjax-engine", daemon=True)
            self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stops taking requests, aborts the ones in flight (each gets a terminal Output), stops the loop and drops
        the background compiles not yet started."""
        self.runner.stop_compiling()
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():  # a step (a compile?) outlasted the timeout: end the streams from here
                self._end_streams(FinishReason.ABORT, "engine shut down")
                self._outputs_out()
            self._thread = None
        else:
            self._abort_all()
            self._outputs_out()

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    while not (self._stopping or self._inbox or self._aborts or self._landed or self._runnable()):
                        self._lock.wait()
                    if self._stopping:
                        break
                self.step()
                self._outputs_out()
        except Exception as e:  # noqa: BLE001 - an error outside a step's dispatch (the device failed, say)
            log.exception("the engine's loop failed: it serves no more requests")
            self._fail_all(f"{type(e).__name__}: {e}")
            return
        self._abort_all()
        self._outputs_out()

    def _outputs_out(self) -> None:
        """The after-step hooks: a step's Outputs, or the last ones, are out."""
        for done in self._after_step:
            done()

    def _fail_all(self, error: str) -> None:
        """The loop cannot go on: not ready (health turns NOT_SERVING), new requests refused with the error, and
        every request held ends with it, from here (the scheduler's state may be what failed)."""
        with self._lock:
            self.failure, self._stopping = error, True  # (submit adds no request from here)
        self._end_streams(FinishReason.ERROR, error)
        self._requests.clear()
        for tell in self._on_failure:
            tell(error)

    def _end_streams(self, reason: FinishReason, error: str) -> None:
        """Every request's last event, sent from outside the loop's bookkeeping (the loop is stuck or gone)."""
        for req in list(self._requests.values()):
            req.events.put(Output(req.id, [], "", reason, req.usage(), error))

    def on_failure(self, tell: Callable[[str], None]) -> Callable[[], None]:
        """tell(error) runs (on the loop's thread) if an error stops the loop: a front end turns unhealthy.
        -> a call that removes it."""
        return self._on_failure.add(tell)

    def after_step(self, done: Callable[[], None]) -> Callable[[], None]:
        """done() runs after each step, once the step's Outputs are out (a front end in another process sends them
        on together), and after the last ones when the engine stops. -> a call that removes it."""
        return self._after_step.add(done)

    def warmup(self, progress=None, rest_later: bool = False) -> float:
        """Compiles every step shape before serving (call before start()); returns the seconds it took.
        progress(done, total) is told as each shape's compile ends. rest_later: only the shapes that hold all the
        others now, the rest in the background while serving (steps pad to a compiled shape meanwhile)."""
        t0 = time.perf_counter()
        self.runner.warmup(prefill=self.remote is None, progress=progress, rest_later=rest_later)
        loading = self._weight_bytes if self.runner.weights_pending else 0
        temps, device = self.runner.temp_bytes(), memory.device_memory(self._device)
        try:  # (the runner's ranks are devices: its pages per rank are those on one device)
            memory.check_steps_fit(temps, device, loading, self.runner.pages_per_rank, self._page_bytes)
        except ValueError:
            self.runner.stop_compiling()  # the engine will not serve: drop the shapes queued in the background
            raise
        if self.remote is not None:
            self.runner.warmup_install(device_arrays=not self.remote.receiver.on_host)
        return time.perf_counter() - t0

    def _runnable(self) -> bool:
        """Work a step can do now: not when the last step was empty (what waits is a remote prefill or a request
        that does not fit), until an event (a request, an abort, a landed prefill) arrives."""
        return self.has_work() and not self._idle

    def has_work(self) -> bool:
        s = self.scheduler
        return bool(s.waiting or s.running or self._pending)

    def _abort_all(self) -> None:
        self._pending = None
        with self._lock:
            self._aborts += list(self._requests)
        self._take_inbox()

    def step(self) -> None:
        """One iteration: plan and dispatch step n + 1, then process step n's outputs."""
        trace.mark("step", "")
        self._take_inbox()
        plan = self.scheduler.schedule(self.clock())
        for req in plan.remote:
            self.remote.start(self, req)
        current = None
        if not plan.empty:
            try:
                current = self.runner.dispatch(plan)
                self.steps += 1
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, not the server
                log.exception("engine step failed")
                self._fail(plan, e)
        self._idle = plan.empty and self._pending is None
        if self._pending is not None:
            self._process(self._pending)
            self._balance_experts(self._pending)
        self._pending = current

    def _take_inbox(self) -> None:
        with self._lock:
            inbox, aborts, landed = self._inbox, self._aborts, self._landed
            self._inbox, self._aborts, self._landed = [], [], []
        for req in inbox:
            self.scheduler.add(req)
        for rid in aborts:
            req = self._requests.get(rid)
            if req is not None and not req.done:
                self._finish(req, FinishReason.ABORT)
        for rid, epoch, *result in landed:
            req = self._requests.get(rid)
            if req is None or req.done or req.epoch != epoch or req.status != Status.TRANSFERRING:
                continue  # ended or preempted while its prefill ran: the result is stale
            if len(result) == 1:
                self._finish(req, FinishReason.ERROR, result[0])
                continue
            first, cache, drafts = result
            try:
                self.runner.install(req, first, cache, drafts)
            except Exception as e:  # noqa: BLE001 - a bad transfer fails its request, not the worker
                log.exception("installing the transferred cache of %s failed", rid)
                self._finish(req, FinishReason.ERROR, f"{type(e).__name__}: {e}")
                continue
            self.scheduler.activate(req)
            self._accept(req, [first], self.clock())

    def _fail(self, plan, err: Exception) -> None:
        for req in [c.req for c in plan.chunks] + plan.decode:
            if not req.done:
                self._finish(req, FinishReason.ERROR, f"{type(err).__name__}: {err}")

    def _process(self, d: Dispatched) -> None:
        now = self.clock()
        first = np.asarray(jax.device_get(d.first)) if d.first is not None else None
        nxt = jax.device_get(d.nxt) if d.nxt is not None else None
        spec = self.config.speculative
        new: dict[str, list[int]] = {}
        for c, epoch, row in zip(d.plan.chunks, d.chunk_epochs, d.chunk_rows, strict=True):
            if c.final and not c.req.done and c.req.epoch == epoch:
                new[c.req.id] = [int(first[row])]
        for req, row, epoch in d.decode_rows:
            if req.done or req.epoch != epoch:  # a request preempted since dispatch drops its token
                continue
            if spec is None:
                new[req.id] = [int(nxt[row])]
                continue
            emitted, n_emit, n_acc = nxt
            new[req.id] = [int(t) for t in emitted[row, : n_emit[row]]]
            req.drafts += spec.num_draft_tokens
            req.accepted += int(n_acc[row])
        for rid, toks in new.items():
            req = self._requests[rid]
            if self._accept(req, toks, now) and spec is not None:
                # the bound assumed every draft accepted: correct it (one step in flight)
                req.cached_bound = req.length - 1 + spec.num_draft_tokens + 1

    def _balance_experts(self, d: Dispatched) -> None:
        """EPLB: adds a finished step's expert loads to the window (read one step late, like its tokens) and
        re-places the experts when due. The step in flight still reads the old placement; the next one the new."""
        eplb = self.runner.eplb
        if eplb is None or d.load is None:
            return
        eplb.observe(np.asarray(jax.device_get(d.load)))
        if eplb.due(self.steps):
            self.runner.rebalance_experts(self.steps)

    def _accept(self, req: Request, toks: list[int], now: float) -> bool:
        """Appends new tokens up to the first stop (token or string), streams them and their text, finishes the
        request at a stop or its length; -> whether it goes on."""
        kept, text, reason = [], [], None
        for t in toks:
            kept.append(t)
            if req.text is not None:
                piece, hit = req.text.add(t)
                text.append(piece)
                if hit:
                    reason = FinishReason.STOP
                    break
            if t in req.stop_ids:
                reason = FinishReason.STOP
                break
            if len(req.output) + len(kept) >= req.max_new_tokens:
                reason = FinishReason.LENGTH
                break
        req.output += kept
        if req.first_token_time is None:
            trace.mark("first", req.id)
        req.first_token_time = req.first_token_time or now
        req.last_token_time = now
        if reason is not None:
            self._finish(req, reason, emit_tokens=kept, text="".join(text))
            return False
        req.events.put(Output(req.id, kept, "".join(text), None, req.usage()))
        return True

    def _finish(
        self, req: Request, reason: FinishReason, error: str | None = None, emit_tokens=(), text: str = ""
    ) -> None:
        """Ends the request with its last event: the tokens and text not streamed yet, and any text held back (a
        partial character, the start of what might have been a stop string)."""
        if req.status == Status.TRANSFERRING and self.remote is not None:
            self.remote.cancel(req)  # stop its prefill and transfer; its pages here are freed below
        if req.text is not None:  # after a stop string it has nothing left
            rest, hit = req.text.finish()
            text += rest
            if hit and reason is FinishReason.LENGTH:  # the held-back text completed a stop string
                reason = FinishReason.STOP
        self.scheduler.finish(req, reason)
        self._requests.pop(req.id, None)
        req.events.put(Output(req.id, list(emit_tokens), text, reason, req.usage(), error))
