"""Small building blocks: RMSNorm, rotary embedding (default and YaRN), SwiGLU MLP."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from hcfjax.config import RopeConfig
from hcfjax.options import DEFAULT, Options
from hcfjax.quant import gated_linear, linear, token_quant_mode


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackRow:
    """Row `index` of a weight stacked over a run of layers [L, ...], read where it is used: in the layer loop a
    slice of the stack is a copy (a kernel of its own a layer), which the norm's kernel does without."""

    stack: jax.Array
    index: jax.Array

    def value(self) -> jax.Array:
        return self.stack[self.index]


def rms_norm(x: jax.Array, weight, eps: float) -> jax.Array:
    """Normalises in float32, then scales in the input dtype (as DeepSeek and transformers do). weight [D] or a
    StackRow of one."""
    if isinstance(weight, StackRow):
        weight = weight.value()
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def rms_norm_int8(x: jax.Array, weight, eps: float, opts: Options = DEFAULT):
    """(rms_norm(x, weight, eps), its rows quantised as `quant.quantize_tokens` gives them) for the int8 products
    that read the normed tokens: one kernel where the tokens' quantisation kernel runs (`quant.token_quant_mode`;
    XLA runs the norm and the quantisation as two kernels or more); else (rms_norm's, None), and each product
    quantises the tokens itself."""
    mode = token_quant_mode(x, opts)
    stack, index = (weight.stack, weight.index) if isinstance(weight, StackRow) else (weight, 0)
    if mode == "reference" or stack.dtype != x.dtype:
        return rms_norm(x, weight, eps), None
    from pallas_kernels.int8_rows import norm_quantize_rows

    h, q, s = norm_quantize_rows(x.reshape(-1, x.shape[-1]), stack, eps, index, interpret=mode == "interpret")
    return h.reshape(x.shape), (q.reshape(x.shape), s.reshape(x.shape[:-1]))


def rope_inv_freq(rope: RopeConfig, dim: int) -> np.ndarray:
    """Inverse frequencies [R/2] (float32), with YaRN's blend of interpolated and extrapolated frequencies."""
    pos_freqs = rope.theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    inv_freq = (1.0 / pos_freqs).astype(np.float32)
    if rope.type != "yarn":
        return inv_freq

    def correction_dim(rotations: float) -> float:
        return (
            dim
            * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(rope.theta))
        )

    low = max(math.floor(correction_dim(rope.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rope.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1.0 - ramp
    interp = (1.0 / (rope.factor * pos_freqs)).astype(np.float32)
    return (interp * (1 - extrapolation) + inv_freq * extrapolation).astype(np.float32)


def rope_table(positions: jax.Array, rope: RopeConfig, dim: int) -> tuple[jax.Array, jax.Array]:
    """(cos, sin) [B, T, dim/2] f32 at integer positions [B, T], the attention factor included: what apply_rope
    rotates by. A forward makes it once for all its layers (model.run_layers): made in the layer loop, it was a
    kernel in every layer of XLA's program, which did not move it out of the loop."""
    inv_freq = jnp.asarray(rope_inv_freq(rope, dim))
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, R/2]
    return jnp.cos(angles) * rope.attention_factor, jnp.sin(angles) * rope.attention_factor


def apply_rope(x: jax.Array, positions: jax.Array, rope: RopeConfig, table=None) -> jax.Array:
    """Rotates x [B, T, ..., R] at integer positions [B, T] (by `table`, rope_table's for them, where the caller has
    it).

    The output is laid out as (rotated first elements of each pair, rotated second elements): for interleaved pairs
    this permutes the R dims, identically for q and k, so every q.k product equals DeepSeek's interleaved rotation.
    """
    r = x.shape[-1]
    cos, sin = rope_table(positions, rope, r) if table is None else table
    shape = cos.shape[:2] + (1,) * (x.ndim - 3) + cos.shape[-1:]
    cos, sin = cos.reshape(shape).astype(x.dtype), sin.reshape(shape).astype(x.dtype)
    if rope.interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x[..., : r // 2], x[..., r // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def mlp(p: dict, x: jax.Array, opts: Options = DEFAULT, x_q=None) -> jax.Array:
    """SwiGLU: down(silu(x @ gate) * (x @ up)).  x [..., D]; gate/up [D, F]; down [F, D] (arrays, QWeights or
    Fp8Weights: `hcfjax.quant.linear`; x_q: its)."""
    return linear(gated_linear(x, p["gate"], p["up"], opts, x_q), p["down"], opts)
