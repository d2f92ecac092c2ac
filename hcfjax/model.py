"""The DeepSeek model as pure functions over a params pytree: decoder layers, the layer stack, MTP modules.

params = {
  "embed": [V, D], "norm": [D], "lm_head": [D, V] (absent when tied),
  "segments": [ {layer params stacked over a run of layers of one kind}, ... ],   # cfg.layer_segments
  "mtp": [ {"enorm", "hnorm", "eh_proj" [2D, D], "layer": {...}, "head_norm", "head" [D, V]}, ... ],
}
A layer is {"attn_norm", "mlp_norm", "attn": {...}, "mlp": {...}} (tensor_specs.layer_specs lists every leaf).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hcfjax.attention import CacheContext, mla, with_decode_plan
from hcfjax.config import ModelConfig
from hcfjax.layers import StackRow, mlp, rms_norm, rms_norm_int8, rope_table
from hcfjax.moe import moe
from hcfjax.options import DEFAULT, Options
from hcfjax.quant import int8_activations, int8_kernel_mode, linear
from hcfjax.tensor_specs import stacked_shapes, tensor_specs, to_pytree


@dataclasses.dataclass(frozen=True)
class Model:
    """A loaded model: config, params pytree, and the tokenizer when the checkpoint has one."""

    cfg: ModelConfig
    params: dict
    tokenizer: Any = None
    path: str | None = None

    @property
    def dtype(self):
        return self.params["embed"].dtype


def decoder_layer(
    p: dict,
    cfg: ModelConfig,
    x,
    positions,
    ctx,
    layer,
    is_moe: bool,
    absorbed: bool,
    experts_fn=None,
    with_load=False,
    opts: Options = DEFAULT,
    real=None,
):
    """Pre-norm residual block: x + MLA(norm(x)), then + MLP or MoE.  x [B, T, D]. The norms' weights in p are
    arrays [D] or, in the layer loop, layers.StackRow's of the stacked ones.

    Returns (x, ctx), or (x, ctx, tokens per expert [E]) for a MoE layer when with_load (True, or a bool mask
    [B, T] of the tokens to count). real: a bool mask [B, T] of the tokens whose output counts, or None (all):
    the others skip the routed experts (moe.moe)."""
    h, h_q = _norm(x, p["attn_norm"], cfg, int8_tokens(x, p["attn"], opts), opts)
    h, ctx = mla(p["attn"], cfg, h, positions, ctx, layer, absorbed, opts, h_q)
    x = x + h
    h, h_q = _norm(x, p["mlp_norm"], cfg, int8_tokens(x, p["mlp"], opts, local_experts=experts_fn is None), opts)
    if not is_moe:
        return x + mlp(p["mlp"], h, opts, h_q), ctx
    if with_load is not False:
        y, load = moe(p["mlp"], cfg, h, experts_fn, with_load, opts, real, h_q)
        return x + y, ctx, load
    return x + moe(p["mlp"], cfg, h, experts_fn, opts=opts, real=real, x_q=h_q), ctx


def int8_tokens(x: jax.Array, p: dict, opts: Options = DEFAULT, local_experts: bool = True) -> bool:
    """Whether a block (attention, dense MLP or MoE params) multiplies its normed tokens on int8 kernels: its first
    projections' (q_a or q, kv_a, gate; the shared experts' gate) or the routed experts' (int8 activations) where
    they run here (`local_experts`; an expert-parallel experts_fn ships the bf16 tokens and quantises what it
    receives)."""
    dense = [p.get("q_a"), p.get("q"), p.get("kv_a"), p.get("gate"), p.get("shared", {}).get("gate")]
    routed = local_experts and "experts" in p and int8_activations(p["experts"]["gate"])
    return routed or any(int8_kernel_mode(x, w, opts) != "reference" for w in dense)


def _norm(x: jax.Array, weight, cfg: ModelConfig, int8: bool, opts: Options):
    """A block's input norm, with its int8 rows when the block takes them (layers.rms_norm_int8)."""
    if int8:
        return rms_norm_int8(x, weight, cfg.rms_norm_eps, opts)
    return rms_norm(x, weight, cfg.rms_norm_eps), None


def run_layers(
    params: dict,
    cfg: ModelConfig,
    x,
    positions,
    ctx: CacheContext | None,
    absorbed: bool,
    experts_fn=None,
    with_load=False,
    unroll: int | bool = 1,
    opts: Options = DEFAULT,
    real=None,
):
    """The main layer stack, one loop per run of same-kind layers.  -> (x [B, T, D] before final norm, ctx),
    plus the routing load of every MoE layer [n_moe_layers, E] when with_load (EPLB's counters, a bincount per
    layer on the side of the forward). unroll: layers a loop iteration in each run of layers (True: no loop).
    real: decoder_layer's."""
    loads = []
    if absorbed:
        ctx = with_decode_plan(cfg, ctx, positions, opts)  # one MLA kernel plan for every layer (when it runs)
    if ctx is not None:  # one rope table for every layer
        ctx = dataclasses.replace(ctx, rope_table=rope_table(positions, cfg.rope, cfg.qk_rope_head_dim))
    for seg, (first, count, is_moe) in zip(params["segments"], cfg.layer_segments, strict=True):
        collect = with_load is not False and is_moe
        # The norms' weights are read by row in place (layers.StackRow), the latent's norm and kv_b too.
        norms = {k: seg[k] for k in ("attn_norm", "mlp_norm")}
        kv_norm, kv_b = seg["attn"]["kv_a_norm"], seg["attn"]["kv_b"]
        rest = {k: v for k, v in seg.items() if k not in norms}
        rest["attn"] = {k: v for k, v in seg["attn"].items() if k not in ("kv_a_norm", "kv_b")}

        def body(carry, xs, is_moe=is_moe, collect=collect, norms=norms, kv_norm=kv_norm, kv_b=kv_b, first=first):
            # The layer's params, its number and its place in the run. The kernels' layer operands come from the
            # numbers, which XLA slices in one kernel an iteration; kv_b's rows from the place, which _scan_in_runs
            # computes from its loop's counter, so that XLA reads them in place inside the products there (under
            # lax.scan the place is a slice of an index array too, and the row is copied).
            x, ctx = carry
            (p, layer), k = xs
            p = p | {name: StackRow(stack, layer - first) for name, stack in norms.items()}
            p["attn"] = p["attn"] | {"kv_a_norm": StackRow(kv_norm, layer - first), "kv_b": StackRow(kv_b, k)}
            load_mask = with_load if collect else False
            x, ctx, *load = decoder_layer(
                p, cfg, x, positions, ctx, layer, is_moe, absorbed, experts_fn, load_mask, opts, real
            )
            return (x, ctx), (load[0] if collect else None)

        xs = (rest, first + jnp.arange(count))
        if type(unroll) is int and 1 < unroll < count:
            (x, ctx), load = _scan_in_runs(body, (x, ctx), xs, count, unroll)
        else:
            (x, ctx), load = jax.lax.scan(body, (x, ctx), (xs, jnp.arange(count)), unroll=unroll)
        if collect:
            loads.append(load)
    if ctx is not None:
        ctx = dataclasses.replace(ctx, plan=None, rope_table=None)  # for this forward's lengths and positions only
    if with_load is not False:
        e = cfg.n_routed_experts
        return x, ctx, jnp.concatenate(loads) if loads else jnp.zeros((0, e), jnp.int32)
    return x, ctx


def _scan_in_runs(body, carry, xs, length: int, n: int):
    """lax.scan(body, carry, (xs, jnp.arange(length))) with n steps a loop iteration, each step indexing the whole
    of xs at the loop's counter times n plus its place. lax.scan's own unroll first slices a block of n steps out of
    every leaf of xs, and XLA's GPU backend copies that block of the layers' weights each iteration; a step's own
    slice goes straight to its kernels, as in a loop of one step. The step's index is computed from the counter, so
    a slice the step takes at it is also one XLA reads in place (a slice of an array of indices is not).
    -> (carry, stacked ys)."""
    trips = length // n

    def take(k):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, k, keepdims=False), xs), k

    def put(ys, y, k):
        return jax.tree.map(lambda a, b: jax.lax.dynamic_update_index_in_dim(a, b, k, 0), ys, y)

    y_like = jax.eval_shape(body, carry, take(jnp.int32(0)))[1]
    ys = jax.tree.map(lambda s: jnp.zeros((length, *s.shape), s.dtype), y_like)

    def iteration(state):
        i, carry, ys = state
        for j in range(n):
            carry, y = body(carry, take(i * n + j))
            ys = put(ys, y, i * n + j)
        return i + 1, carry, ys

    _, carry, ys = jax.lax.while_loop(lambda state: state[0] < trips, iteration, (jnp.int32(0), carry, ys))
    for k in range(trips * n, length):  # the remainder, at fixed places
        carry, y = body(carry, take(jnp.int32(k)))
        ys = put(ys, y, k)
    return carry, ys


def embed(params: dict, tokens: jax.Array) -> jax.Array:
    return params["embed"][tokens]


def final_hidden(params: dict, cfg: ModelConfig, x: jax.Array) -> jax.Array:
    return rms_norm(x, params["norm"], cfg.rms_norm_eps)


def logits(params: dict, h: jax.Array) -> jax.Array:
    """Final-normed hidden [..., D] -> float32 logits [..., V]."""
    head = params["lm_head"] if "lm_head" in params else params["embed"].T
    return jnp.einsum("...D,DV->...V", h, head, preferred_element_type=jnp.float32)


def hidden_states(
    params: dict,
    cfg: ModelConfig,
    tokens,
    positions,
    ctx: CacheContext | None = None,
    absorbed: bool = False,
    experts_fn=None,
    with_load=False,
    opts: Options = DEFAULT,
    real=None,
):
    """tokens [B, T] at positions [B, T] -> (final-normed hidden [B, T, D], ctx).

    experts_fn: how routed experts run (default local; sharding/ep.py gives the expert-parallel one).
    with_load: also return the tokens routed to each expert of every MoE layer [n_moe_layers, E]; True counts every
    token, a bool mask [B, T] only its tokens (so padding and mock rows do not count).
    real: a bool mask [B, T] of the tokens whose output the caller reads, or None (all): the others (a prefill
    chunk's padding, a decode step's inactive rows) skip the routed experts.

    Decode forwards (absorbed) unroll the layer loops where opts.unroll_decode says so, and one query token (batch-1
    decode) runs as two identical rows where `two_rows` does."""
    unroll = opts.decode_unroll() if absorbed else 1
    if two_rows(tokens, ctx, experts_fn, opts):
        return _as_two_rows(params, cfg, tokens, positions, ctx, absorbed, with_load, unroll, opts)
    x, ctx, *load = run_layers(
        params, cfg, embed(params, tokens), positions, ctx, absorbed, experts_fn, with_load, unroll, opts, real
    )
    return (final_hidden(params, cfg, x), ctx, *load)


def two_rows(tokens, ctx, experts_fn, opts: Options = DEFAULT) -> bool:
    """Whether hidden_states runs this forward as two rows (opts.two_rows): one query token over the cache, routed
    experts local (an expert-parallel exchange would carry the copy too)."""
    return opts.on("two_rows") and ctx is not None and experts_fn is None and tuple(tokens.shape) == (1, 1)


def _as_two_rows(params, cfg, tokens, positions, ctx: CacheContext, absorbed, with_load, unroll, opts):
    """hidden_states over [row, copy of row]: the copy reads the same page table and length, so it sees the cache
    entry the row writes in each layer and computes exactly what the row does (the same attention, the same
    experts: no extra weights are read), but it writes nothing (valid False) and counts no load. -> row 0's."""
    twice = lambda a: jnp.concatenate([a, a])  # noqa: E731
    valid = jnp.concatenate([ctx.valid, jnp.zeros_like(ctx.valid)])
    ctx2 = CacheContext(ctx.cache, twice(ctx.page_table), twice(ctx.kv_len), valid)
    if with_load is not False:
        counted = jnp.broadcast_to(jnp.asarray(with_load, bool), tokens.shape)
        with_load = jnp.concatenate([counted, jnp.zeros_like(ctx.valid)])
    x, out_ctx, *load = run_layers(
        params, cfg, embed(params, twice(tokens)), twice(positions), ctx2, absorbed, None, with_load, unroll, opts
    )
    out_ctx = dataclasses.replace(ctx, cache=out_ctx.cache)
    return (final_hidden(params, cfg, x[:1]), out_ctx, *load)


def mtp_module(
    p: dict,
    cfg: ModelConfig,
    k: int,
    h_prev,
    next_tokens,
    positions,
    embed_table,
    ctx: CacheContext | None = None,
    absorbed: bool = False,
    head_norm: bool = True,
    experts_fn=None,
    opts: Options = DEFAULT,
):
    """MTP module k (DeepSeek-V3 section 2.2): combines the previous depth's hidden state h_prev [B, T, D] for token
    t with the embedding of token t+1 (next_tokens [B, T], at `positions` = t+1), runs one decoder block, and
    returns (hidden [B, T, D] for the next depth, float32 logits [B, T, V] for token t+2, ctx).

    h_prev at depth 0 is the main model's final-normed hidden state (as vLLM and SGLang feed DeepSeek's MTP layer).
    The block's KV entries live in cache layer num_hidden_layers + k. head_norm=False skips the RMSNorm before the
    shared LM head (the open-source baseline the reference compared against; DeepSeek's checkpoints carry the norm).
    """
    e = rms_norm(embed_table[next_tokens], p["enorm"], cfg.rms_norm_eps)
    h = rms_norm(h_prev, p["hnorm"], cfg.rms_norm_eps)
    x = linear(jnp.concatenate([e, h], axis=-1), p["eh_proj"], opts)
    layer = cfg.num_hidden_layers + k
    x, ctx = decoder_layer(
        p["layer"], cfg, x, positions, ctx, layer, cfg.is_moe_layer(layer), absorbed, experts_fn, opts=opts
    )
    y = rms_norm(x, p["head_norm"], cfg.rms_norm_eps) if head_norm else x
    out = jnp.einsum("...D,DV->...V", y, p["head"], preferred_element_type=jnp.float32)
    return x, out, ctx


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.bfloat16, mtp: bool = True, each=None) -> dict:
    """Random params with the checkpoint's structure (benchmarks, tests, a model made on the fly).

    Matrices ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.1^2), router bias ~ U(0, 0.1): activations stay O(1) through
    any depth, and routing is far from uniform.

    each(path, x): applied to every large tensor as it is made, a stacked one (layers, experts) one leading slice
    at a time, and its results stacked; a quantiser here means the model's float weights never exist whole on the
    device, only one slice of them beside what is made so far (hcfjax.random_model's quantised models).
    """
    specs = tensor_specs(cfg, mtp=mtp)
    stacked = {s.path: len(s.index) > 0 for s in specs}
    shapes = sorted(stacked_shapes(specs).items(), key=str)
    # Each random op is a compile of its own, which XLA:CPU makes slow, so tensors up to _SHARED_DRAW elements are
    # cut from one shared draw, on the host (cut in a program, each tensor is an output of its own: about a second
    # of compile on a CPU); larger ones are drawn one slice at a time (_draw: a program per kind, slice shape and
    # dtype).
    small = [(path, spec) for path, spec in shapes if math.prod(spec[0]) <= _SHARED_DRAW]
    large = [(path, spec) for path, spec in shapes if math.prod(spec[0]) > _SHARED_DRAW]

    def init(name, shape, z, u, dt):
        return _init(_kind(name), z, u, _scale(cfg, name, shape), dt)

    def make_small(k_small, k_u):
        sizes = [math.prod(shape) for _, (shape, _) in small]
        z_all, u_all = _shared_draws(k_small, k_u, sum(sizes))
        if not isinstance(z_all, jax.core.Tracer):  # (traced: under eval_shape, for the params' shapes)
            z_all, u_all = np.asarray(z_all), np.asarray(u_all)
        out, start = {}, 0
        for (path, (shape, fp32)), n in zip(small, sizes, strict=True):
            z, u = (x[start : start + n].reshape(shape) for x in (z_all, u_all))
            out[path] = jax.device_put(init(path[-1], shape, z, u, jnp.float32 if fp32 else dtype))
            start += n
        return out

    def draw(k, name, shape, dt):
        return _draw(k, _kind(name), shape, dt, jnp.float32(_scale(cfg, name, shape)))

    each = each or (lambda path, x: x)
    k_small, k_u, *k_large = jax.random.split(key, 2 + len(large))
    out = make_small(k_small, k_u)
    for k, (path, (shape, fp32)) in zip(k_large, large, strict=True):
        dt = jnp.dtype(jnp.float32 if fp32 else dtype)
        if not stacked[path]:
            out[path] = each(path, draw(k, path[-1], shape, dt))
            continue
        parts = [each(path, draw(jax.random.fold_in(k, i), path[-1], shape[1:], dt)) for i in range(shape[0])]
        out[path] = jax.tree.map(lambda *xs: jnp.stack(xs), *parts)
        del parts  # before the next tensor's slices are made
    return to_pytree(out)


_SHARED_DRAW = 1 << 20  # elements


@functools.partial(jax.jit, static_argnums=2)
def _shared_draws(k_normal, k_uniform, n: int):
    """n standard normals and n uniforms: the small tensors' shared draw."""
    return jax.random.normal(k_normal, (n,), jnp.float32), jax.random.uniform(k_uniform, (n,), jnp.float32)


def _kind(name: str) -> str:
    return "norm" if "norm" in name else "bias" if name == "router_bias" else "matrix"


def _scale(cfg: ModelConfig, name: str, shape: tuple[int, ...]) -> float:
    """A matrix's standard deviation, 1/sqrt(fan_in) (1 for the other kinds, which do not use it)."""
    if _kind(name) != "matrix":
        return 1.0
    return (cfg.hidden_size if name == "embed" else _fan_in(name, shape)) ** -0.5


def _init(kind: str, z, u, scale, dt):
    """A tensor from standard normals z or uniforms u (float32, jax or numpy arrays): norms 1 + N(0, 0.1^2), router
    bias U(0, 0.1), matrices N(0, scale^2)."""
    if kind == "norm":
        return (1.0 + 0.1 * z).astype(dt)
    if kind == "bias":
        return 0.1 * u
    return (z * scale).astype(dt)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _draw(k, kind: str, shape: tuple[int, ...], dt, scale):
    """One large tensor (or slice), a program per kind, shape and dtype (the scale an operand)."""
    u = jax.random.uniform(k, shape, jnp.float32) if kind == "bias" else None
    z = None if u is not None else jax.random.normal(k, shape, jnp.float32)
    return _init(kind, z, u, scale, dt)


def _fan_in(name: str, shape: tuple[int, ...]) -> int:
    """Input width of a stored [in, out...] matrix: the first non-stacking dim, found from the end (kv_b's
    [.., 2, H, C, N]: C, second from the end, as in a plain matrix)."""
    per_head = {"q_b": 3, "q": 3}  # [.., in, H, K]
    return shape[-per_head.get(name, 2)]
