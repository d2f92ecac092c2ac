"""MTP speculative step cost on a random model of a real shape, at FORCED acceptance (benchmark only).

    python -m hcfjax.bench.generate --speculative 3 --forced-acceptance 0.85,0.65,0.45 [--preset v2-lite]
        [--scheme bf16|w4a16|w4a8|w4a8c8|w8a8] [--batches 32] [--context 2048] [--mtp-modules N]
        [--spec-method exact] [--steps 16] [--out FILE]

A random model has no trained MTP heads, so its drafts are almost never accepted. Here verification runs as usual
but accepts draft depth i with the given probability when depth i-1 was accepted (SpeculativeConfig.
forced_acceptance: conditional per depth, the capacity simulator's meaning), so a step costs what a step of a model
with trained heads costs and emits as many tokens as such a model would at that acceptance. Only the method's accept
test itself drops out of the compiled step (elementwise over [B, k]; for typical also an entropy over [B, k, V]).

For each batch: one prefill fills every row's cache with `context` random tokens; then for k = 0 (plain decoding)
and k = 1..K, `steps` decode steps of `hcfjax.step` are timed back to back (dispatched without waiting, after two
warm-up steps; the context grows by the tokens emitted meanwhile). One step is one call of one compiled executable
(the step is lowered and compiled once and that executable is called: the target forward over [last, drafts],
verification, MTP extend and the next k drafts all run in it), and no compilation happens while the steps run
(checked). The draft state starts from random drafts (the MTP layers' cache over the prompt is empty): the warm-up
steps replace it with the MTP modules' own; a step's cost depends on lengths, not on cache values.

output tokens/s = measured tokens emitted per row per step x rows / step time.
"""

from __future__ import annotations

import contextlib
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from hcfjax import cache as kvcache
from hcfjax.bench.common import count, layers_per_iteration
from hcfjax.model import Model
from hcfjax.options import Options
from hcfjax.quantize import default_cache_dtype
from hcfjax.sampling import SamplingBatch, SamplingParams
from hcfjax.speculative import Drafts, SpeculativeConfig
from hcfjax.step import DecodeInputs, PrefillInputs, SlotState, empty_state, step_program

LABEL = "forced acceptance (benchmark only)"
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax's monitoring event per XLA compile
WARM_STEPS = 2


@contextlib.contextmanager
def counting_compiles():
    """Yields a list that collects one entry per XLA backend compilation while the block runs."""
    seen: list[float] = []

    def listener(event: str, duration: float, **_):
        if event == BACKEND_COMPILE_EVENT:
            seen.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def expected_tokens_per_step(rates) -> float:
    """1 + a_1 + a_1 a_2 + ... for conditional acceptance per depth (the simulator's tokens_per_step)."""
    return 1.0 + sum(math.prod(rates[: i + 1]) for i in range(len(rates)))


def prefilled(model: Model, batch: int, context: int, room: int, opts: Options, seed: int = 0, max_tokens=16384):
    """Slot state after one prefill of `context` random tokens in every row (greedy), in row groups of at most
    max_tokens tokens, over a cache with the MTP modules' layers and `room` more tokens a row. -> (state, dec)."""
    cfg = model.cfg
    page_size = 64
    pages = math.ceil((context + room) / page_size)
    layers = cfg.num_hidden_layers + len(model.params.get("mtp", []))
    cache = kvcache.init_cache(cfg, batch * pages, page_size, default_cache_dtype(model), layers)
    state = empty_state(cfg, batch, cache, None, model.dtype)
    rng = np.random.default_rng(seed)
    tokens = jnp.asarray(rng.integers(2, cfg.vocab_size, (batch, context)), jnp.int32)
    table = jnp.arange(batch * pages, dtype=jnp.int32).reshape(batch, pages)
    sp = SamplingBatch.of([SamplingParams()] * batch)
    seeds = jnp.asarray(rng.integers(0, 2**32, batch, dtype=np.uint32))
    zeros, lengths = jnp.zeros(batch, jnp.int32), jnp.full(batch, context, jnp.int32)
    group = max(g for g in range(1, batch + 1) if batch % g == 0 and (g == 1 or g * context <= max_tokens))
    prefill = step_program(opts.compiler_options(prefill=True))
    for r0 in range(0, batch, group):
        part = slice(r0, r0 + group)
        pre = PrefillInputs(
            tokens[part],
            zeros[part],
            lengths[part],
            table[part],
            jnp.arange(batch)[part],
            jax.tree.map(lambda x, part=part: x[part], sp),
            seeds[part],
            zeros[part],
        )
        state, *_ = prefill(model.params, cfg, state, pre, None, None, opts)
    return state, DecodeInputs(jnp.ones(batch, bool), table, sp, seeds)


def speculative_state(state: SlotState, model: Model, k: int, seed: int = 0) -> SlotState:
    """A copy of a plain prefilled state with a draft state for k drafts: random greedy drafts after each row's
    newest token (what the first warm-up steps overwrite with the MTP modules' drafts)."""
    cfg, b = model.cfg, state.tok.shape[0]
    rng = np.random.default_rng(seed)
    drafts = jnp.asarray(rng.integers(2, cfg.vocab_size, (b, k)), jnp.int32)
    r = 2 * k + 1
    d = Drafts(
        state.tok,
        state.length,
        drafts,
        jax.nn.one_hot(drafts, cfg.vocab_size, dtype=jnp.float32),  # greedy drafts' distributions
        jnp.zeros((b, r, cfg.hidden_size), model.dtype),
        jnp.asarray(rng.integers(2, cfg.vocab_size, (b, r)), jnp.int32).at[:, -1].set(state.tok),
    )
    return jax.tree.map(jnp.copy, SlotState(state.cache, state.tok, state.length, state.count, d))


def time_steps(model: Model, state: SlotState, dec: DecodeInputs, spec, opts: Options, steps: int):
    """Seconds per decode step and tokens emitted per row per step, over `steps` steps of one compiled executable
    (after WARM_STEPS); RuntimeError if anything compiles while they run."""
    program = step_program(opts.compiler_options())
    compiled = program.lower(model.params, model.cfg, state, None, dec, spec, opts).compile()
    emitted = []
    with counting_compiles() as compiles:
        for _ in range(WARM_STEPS):
            state, _, out, _ = compiled(model.params, state, None, dec)
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        for _ in range(steps):
            state, _, out, _ = compiled(model.params, state, None, dec)
            emitted.append(out[1] if spec is not None else None)  # plain decoding: one token per row
        jax.block_until_ready((state, emitted))
        elapsed = time.perf_counter() - t0
    if compiles:
        raise RuntimeError(f"{len(compiles)} compilations while the steps ran: a step is not one executable")
    tokens = 1.0 if spec is None else float(np.mean(np.stack([np.asarray(e) for e in emitted])))
    return elapsed / steps, tokens


def spec_rows(model: Model, batch: int, args, opts: Options) -> list[str]:
    """Table rows for k = 0..args.speculative at one batch."""
    rates = args.forced_acceptance
    room = (WARM_STEPS + args.steps) * (args.speculative + 1) + 2 * (2 * args.speculative + 1) + 1
    state, dec = prefilled(model, batch, args.context, room, opts)
    rows, plain = [], None
    for k in range(args.speculative + 1):
        if k == 0:
            spec, start = None, jax.tree.map(jnp.copy, state)
        else:
            spec = SpeculativeConfig(k, args.spec_method, forced_acceptance=tuple(rates[:k]))
            start = speculative_state(state, model, k)
        step_s, tokens = time_steps(model, start, dec, spec, opts, args.steps)
        tps = tokens * batch / step_s
        plain = plain or (step_s, tps)
        acc = " / ".join(f"{a:.2f}" for a in rates[:k]) or "-"
        rows.append(
            f"| {LABEL} | {batch} | {args.context} | {k} | {acc} | {expected_tokens_per_step(rates[:k]):.2f} | "
            f"{tokens:.2f} | {step_s * 1e3:.2f} ms | {step_s / plain[0]:.2f}x | {tps:,.0f} | {tps / plain[1]:.2f}x |"
        )
        print(rows[-1], flush=True)
    return rows


def table(model: Model, preset: str, scheme: str, n_params: int, args, opts: Options, header: str) -> str:
    rows = [row for b in args.batches for row in spec_rows(model, b, args, opts)]
    n_mtp = len(model.params["mtp"])
    reuse = ", the last one reused at deeper depths"
    rates = ",".join(f"{a:g}" for a in args.forced_acceptance)
    return "\n".join(
        [
            f"## `python -m hcfjax.bench.generate --preset {preset} --scheme {scheme} --speculative "
            f"{args.speculative} --forced-acceptance {rates}`: MTP step cost, {LABEL}",
            "",
            f"{header}; model {preset} with random weights ({count(n_params)} parameters, {scheme}, "
            f"{n_mtp} MTP module{'s' if n_mtp > 1 else ''}{reuse if n_mtp < args.speculative else ''}"
            f"), {jnp.dtype(default_cache_dtype(model)).name} KV cache, page size 64, method {args.spec_method}, "
            f"greedy; decode layers a loop iteration: {layers_per_iteration(opts)}. "
            "The acceptance is FORCED: verification "
            "accepts depth i with the given probability after depth i-1 (SpeculativeConfig.forced_acceptance), not "
            f"by the random heads' drafts. {args.steps} steps timed back to back per k, each one call of one compiled "
            "executable (target forward, verification, MTP extend and drafting together).",
            "",
            "| acceptance | batch | context | k | forced acceptance per depth | expected tokens/step | "
            "measured tokens/step | time per step | step / plain step | output tokens/s | vs plain |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
            *rows,
        ]
    )
