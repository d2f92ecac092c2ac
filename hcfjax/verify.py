"""Verification of speculative drafts: pure functions of (target probs, draft probs, drafts, rng).

p [B, k+1, V]: the target's sampling distribution at each of the k+1 verified positions (after the request's
temperature and filters; one-hot for greedy requests). q [B, k, V]: the distribution each draft was sampled from.
d [B, k]: the drafts. Every method returns (n [B] accepted drafts, extra [B] the token emitted after them).

  exact      d_i is accepted iff it equals the target's own sample t_i ~ p_{i-1}; emits t_{n+1}.
             The output is exactly what non-speculative sampling would give (identical under greedy).
  rejection  accept with probability min(1, p(d_i) / q(d_i)); at the first rejection emit a sample of
             norm(max(p - q, 0)); if all are accepted, a bonus sample of p_k (Leviathan et al. 2023). The output
             distribution equals the target's.
  typical    accept iff p(d_i) > min(epsilon, delta * exp(-H(p))) (Medusa); at the first rejection (or after all k)
             emit the target's own sample t_{n+1}.
Methods can differ per position (the `tuned` configuration): position i uses methods[i].

forced (benchmark only, SpeculativeConfig.forced_acceptance): draft i passes with probability forced[i] (a uniform
draw of the row's key) instead of its method's test; the token after the accepted drafts is chosen as the method
would at that position (the target's sample there, or the rejection residual), so it follows the emitted prefix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

METHODS = ("exact", "rejection", "typical")


def leading_accepts(accept: jax.Array) -> jax.Array:
    """[B, k] bool -> [B] number of leading Trues."""
    return jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)


def typical_threshold(p: jax.Array, epsilon: float, delta: float) -> jax.Array:
    """min(epsilon, delta * exp(-entropy(p))) per distribution; p [..., V] -> [...]."""
    entropy = -jnp.sum(jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0), axis=-1)
    return jnp.minimum(epsilon, delta * jnp.exp(-entropy))


def sample_probs(key: jax.Array, probs: jax.Array) -> jax.Array:
    """Categorical samples from probabilities [..., V] (zeros are never drawn)."""
    return jax.random.categorical(key, jnp.log(jnp.maximum(probs, 0.0)), axis=-1).astype(jnp.int32)


def row_keys(key: jax.Array, b: int) -> jax.Array:
    """One key per row [B]: `key` itself when it already is (the engine's, from each request's seed and counter, so
    a row's draws do not depend on its batch), else b keys split from one batch key."""
    return key if key.ndim == 1 else jax.random.split(key, b)


def split_rows(keys: jax.Array, n: int) -> jax.Array:
    """keys [B] -> [B, n]: n independent keys per row."""
    return jax.vmap(lambda k: jax.random.split(k, n))(keys)


def sample_probs_rows(keys: jax.Array, probs: jax.Array) -> jax.Array:
    """Row r of probs [B, ..., V] sampled with keys[r]."""
    return jax.vmap(sample_probs)(keys, probs)


def verify(
    methods: tuple[str, ...],
    p: jax.Array,
    q: jax.Array,
    d: jax.Array,
    key: jax.Array,
    epsilon: float = 0.09,
    delta: float = 0.3,
    forced: tuple[float, ...] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Accept a prefix of the drafts and choose the next token; `methods` has one entry per draft position. key: one
    key, or one per row [B] (`row_keys`). forced: per-position acceptance probabilities replacing the methods'
    tests (benchmark only, see the module docstring)."""
    b, k = d.shape
    if len(methods) != k or any(m not in METHODS for m in methods):
        raise ValueError(f"need {k} methods from {METHODS}, got {methods}")
    keys = split_rows(row_keys(key, b), 3)
    k_target, k_uniform, k_residual = keys[:, 0], keys[:, 1], keys[:, 2]
    t = sample_probs_rows(k_target, p)  # [B, k+1] the target's own samples
    p_d = jnp.take_along_axis(p[:, :k], d[..., None], axis=-1)[..., 0]  # [B, k]
    q_d = jnp.take_along_axis(q, d[..., None], axis=-1)[..., 0]
    u = jax.vmap(lambda kk: jax.random.uniform(kk, (k,)))(k_uniform)
    by_method = {
        "exact": d == t[:, :k],
        "rejection": u * q_d < p_d,  # u < p/q without dividing by q
        "typical": p_d > typical_threshold(p[:, :k], epsilon, delta),
    }
    accept = jnp.stack([by_method[m][:, i] for i, m in enumerate(methods)], axis=1)
    if forced is not None:
        if len(forced) != k:
            raise ValueError(f"need {k} forced acceptance probabilities, got {forced}")
        accept = u < jnp.asarray(forced, jnp.float32)[None]  # u: the row's own uniforms, as rejection draws them
    n = leading_accepts(accept)
    rows = jnp.arange(b)
    extra = t[rows, n]
    if "rejection" in methods:
        # residual for a rejection at position n (< k): norm(max(p_n - q_n, 0)), or p_n where p <= q everywhere
        n_c = jnp.minimum(n, k - 1)
        residual = jnp.maximum(p[rows, n_c] - q[rows, n_c], 0.0)
        residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p[rows, n_c])
        recovered = sample_probs_rows(k_residual, residual)
        is_rej = jnp.asarray([m == "rejection" for m in methods])[n_c]
        extra = jnp.where((n < k) & is_rej, recovered, extra)
    return n, extra
