"""The MTP chain over whole sequences (teacher forcing), shared by MTP-head training and evaluation.

Depth k (1-based) combines the previous depth's hidden state at row t (the main model's at k = 1) with the embedding
of token t+k, at position t+k, and predicts token t+k+1 (DeepSeek-V3 section 2.2). Each depth keeps all T rows:
windows carry T + depth + 1 tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hcfjax.config import ModelConfig
from hcfjax.model import hidden_states, mtp_module


def module_for_depth(num_modules: int, depth: int) -> int:
    """Index of the MTP module drafting at `depth` (1-based): module depth-1 when the checkpoint has that many
    (independent heads), otherwise the last one it has (one shipped layer is reused for every depth)."""
    return min(depth, num_modules) - 1


def base_hidden(params: dict, cfg: ModelConfig, tokens: jax.Array, rows: int) -> jax.Array:
    """Main model's final-normed hidden states [B, rows, D] for tokens[:, :rows]."""
    x = tokens[:, :rows]
    return hidden_states(params, cfg, x, jnp.broadcast_to(jnp.arange(rows), x.shape))[0]


def chain_logits(
    modules: list[dict], params: dict, cfg: ModelConfig, h0: jax.Array, tokens: jax.Array, depth: int
) -> list[jax.Array]:
    """Logits [B, T, V] of depths 1..depth; depth k's row t predicts tokens[:, t + k + 1]."""
    rows = h0.shape[1]
    pos = jnp.broadcast_to(jnp.arange(rows), h0.shape[:2])
    h, out = h0, []
    for k in range(1, depth + 1):
        m = module_for_depth(len(modules), k)
        h, lg, _ = mtp_module(modules[m], cfg, m, h, tokens[:, k : k + rows], pos + k, params["embed"])
        out.append(lg)
    return out


def chain_loss(modules: list[dict], params: dict, cfg: ModelConfig, tokens: jax.Array, rows: int, depth: int):
    """Mean cross-entropy over depths with the base frozen; metrics per depth."""
    from train_mtp.common import cross_entropy

    h0 = jax.lax.stop_gradient(base_hidden(params, cfg, tokens, rows))
    losses = [
        cross_entropy(lg, tokens[:, k + 1 : k + 1 + rows])
        for k, lg in enumerate(chain_logits(modules, params, cfg, h0, tokens, depth), start=1)
    ]
    return sum(losses) / depth, {f"depth{k}_loss": v for k, v in enumerate(losses, start=1)}
