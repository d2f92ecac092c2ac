"""Per-request sampling: greedy, temperature, top-k, top-p, min-p, as pure functions of (logits, params, rng)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np


class InvalidSampling(ValueError):
    """A sampling parameter out of its range; `param` names it."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


MIN_TEMPERATURE = 1e-5  # below this (and above 0) logits / temperature can overflow float32


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; top_k 0 and top_p 1 and min_p 0 switch those filters off. A batch holds them in
    float32 and int32 arrays (SamplingBatch), so values must fit those."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    def __post_init__(self):
        number = lambda x: isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)  # noqa: E731
        t = self.temperature
        if not (number(t) and (t == 0 or MIN_TEMPERATURE <= t)):
            raise InvalidSampling(
                "temperature", f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got {t!r}"
            )
        if not (isinstance(self.top_k, int) and not isinstance(self.top_k, bool) and 0 <= self.top_k < 2**31):
            raise InvalidSampling("top_k", f"top_k must be an integer in [0, 2^31) (0 = off), got {self.top_k!r}")
        if not (number(self.top_p) and 0 < self.top_p <= 1):
            raise InvalidSampling("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (number(self.min_p) and 0 <= self.min_p < 1):
            raise InvalidSampling("min_p", f"min_p must be in [0, 1), got {self.min_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filters(self) -> bool:
        """Whether a draw of this request filters the vocabulary (top-k, top-p or min-p on, and not greedy)."""
        return not self.greedy and (self.top_k > 0 or self.top_p < 1 or self.min_p > 0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingBatch:
    """SamplingParams of a batch as arrays [B], so one compiled step serves any mix of requests. `filters` (static:
    part of a compiled step's signature) says whether the step filters at all: False for a batch in which no row
    filters, whose step then skips the filters' [B, V] sort without a branch on the device."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    min_p: jax.Array
    filters: bool = dataclasses.field(default=True, metadata={"static": True})

    @classmethod
    def of(cls, params: list[SamplingParams], filters: bool | None = None) -> SamplingBatch:
        return jax.device_put(cls.host(params, filters))  # (jnp.asarray would compile a program per shape)

    @classmethod
    def host(cls, params: list[SamplingParams], filters: bool | None = None) -> SamplingBatch:
        """The batch as numpy arrays (to be put on a device with the rest of a step's inputs, in one transfer).
        filters: whether its step filters (default: whether any row does; True serves any batch)."""
        col = lambda f, dt: np.array([getattr(p, f) for p in params], dt)  # noqa: E731
        needed = any(p.filters for p in params)
        if filters is None:
            filters = needed
        elif needed and not filters:
            raise ValueError("a batch in which a row filters needs filters=True")
        return cls(
            col("temperature", np.float32),
            col("top_k", np.int32),
            col("top_p", np.float32),
            col("min_p", np.float32),
            filters,
        )


def filtered_logprobs(logits: jax.Array, sp: SamplingBatch, branch_free: bool = True) -> jax.Array:
    """Temperature-scaled log-probabilities [B, V] with top-k / top-p / min-p filtered tokens at -inf.

    Rows with temperature 0 are returned at temperature 1 (greedy rows only use the argmax). The filters sort the
    vocabulary per row (a [B, V] sort), unless the batch says none of its rows filters (sp.filters, known when the
    step is traced). branch_free=False also skips the sort by a `lax.cond` when no row of the batch filters: cheap
    on a CPU, but on a GPU a conditional makes the host wait for the device (Options.branch_free_sampling).
    """
    temp = jnp.where(sp.temperature > 0, sp.temperature, 1.0)[:, None]
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / temp, axis=-1)
    if not sp.filters:
        return logp
    if branch_free:
        return _filter(logp, sp)
    filtering = (sp.top_k > 0) | (sp.top_p < 1) | (sp.min_p > 0)
    return jax.lax.cond(jnp.any(filtering), _filter, lambda logp, _: logp, logp, sp)


def _filter(logp: jax.Array, sp: SamplingBatch) -> jax.Array:
    """logp [B, V] with each row's top-k / top-p / min-p filtered tokens at -inf (a filter that is off keeps all)."""
    v = logp.shape[-1]
    sorted_logp = jnp.sort(logp, axis=-1)[:, ::-1]  # descending
    # top-k: keep values >= the k-th largest.
    k = jnp.where(sp.top_k > 0, jnp.minimum(sp.top_k, v), v)
    kth = jnp.take_along_axis(sorted_logp, (k - 1)[:, None], axis=-1)
    keep = logp >= kth
    # top-p: keep the smallest prefix of the sorted distribution whose mass reaches top_p. top_p = 1 is off, not
    # "mass 1": the f32 running sum can reach 1.0 before the tail, which would drop its tokens.
    cum = jnp.cumsum(jnp.exp(sorted_logp), axis=-1)
    last = jnp.sum(cum - jnp.exp(sorted_logp) < sp.top_p[:, None], axis=-1)  # tokens needed, >= 1
    pth = jnp.take_along_axis(sorted_logp, (jnp.maximum(last, 1) - 1)[:, None], axis=-1)
    keep &= (sp.top_p[:, None] >= 1) | (logp >= pth)
    # min-p: keep tokens with p >= min_p * p_max.
    min_p_floor = sorted_logp[:, :1] + jnp.log(jnp.maximum(sp.min_p, 1e-30))[:, None]
    keep &= (sp.min_p[:, None] <= 0) | (logp >= min_p_floor)
    return jnp.where(keep, logp, -jnp.inf)


def sample(logits: jax.Array, sp: SamplingBatch, key: jax.Array, branch_free: bool = True) -> jax.Array:
    """logits [B, V] -> tokens [B] int32."""
    return _greedy_or_drawn(logits, sp, lambda lp: jax.random.categorical(key, lp, axis=-1), branch_free)


def sample_rows(logits: jax.Array, sp: SamplingBatch, keys: jax.Array, branch_free: bool = True) -> jax.Array:
    """logits [B, V] -> tokens [B] int32 with one rng key per row (keys [B]), so a request's draws do not depend on
    which other requests share its batch (the serving engine's case)."""

    def draw(lp):
        gumbel = jax.vmap(lambda k: jax.random.gumbel(k, logits.shape[-1:]))(keys)
        return jnp.argmax(lp + gumbel, axis=-1)

    return _greedy_or_drawn(logits, sp, draw, branch_free)


def _greedy_or_drawn(logits: jax.Array, sp: SamplingBatch, draw, branch_free: bool) -> jax.Array:
    """The argmax for rows at temperature 0, draw(filtered_logprobs) for the others. branch_free: drawn for every
    row, then selected; else an all-greedy batch skips the draw by a `lax.cond` (see filtered_logprobs)."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def drawn():
        lp = filtered_logprobs(logits, sp, branch_free)
        return jnp.where(sp.temperature > 0, draw(lp).astype(jnp.int32), greedy)

    if branch_free:
        return drawn()
    return jax.lax.cond(jnp.any(sp.temperature > 0), drawn, lambda: greedy)
