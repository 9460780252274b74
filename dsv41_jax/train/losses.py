"""Loss terms and the router-bias rule.

  * next-token cross-entropy over the loss mask (chat prompts and padding are masked);
  * the MoE sequence-balance loss (DeepSeek-V3 "complementary sequence-wise auxiliary loss"):
    per row, sum_i f_i P_i with f_i = E/(k T) * (tokens routed to i) and P_i the mean of the
    normalised gate scores, averaged over rows and MoE layers;
  * the aux-loss-free bias rule (DeepSeek-V3): after each step, b_i += rate * sign(mean load -
    load_i); the bias only selects experts, so it is updated outside the optimizer;
  * the indexer KL (computed in `forward`), averaged over sampled positions and index layers.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array):
    """(mean CE over masked tokens, token count). logits fp32 [B,T,V]."""
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    mask = mask.astype(jnp.float32)
    n = jnp.sum(mask)
    return jnp.sum((logz - picked) * mask) / jnp.maximum(n, 1.0), n


def sequence_balance(gate_scores: jax.Array, experts: jax.Array, valid: jax.Array) -> jax.Array:
    """Sequence-wise balance loss of one MoE layer (mean over rows).

    gate_scores [B,T,E] (unbiased affinities), experts [B,T,k] chosen ids, valid [B,T] tokens
    that count (padding excluded).
    """
    B, T, E = gate_scores.shape
    k = experts.shape[-1]
    valid = valid.astype(jnp.float32)
    n = jnp.maximum(jnp.sum(valid, -1), 1.0)  # [B]
    chosen = jnp.sum(jax.nn.one_hot(experts, E, dtype=jnp.float32), axis=2)  # [B,T,E]
    f = E / (k * n)[:, None] * jnp.sum(chosen * valid[..., None], 1)
    s = gate_scores / jnp.maximum(jnp.sum(gate_scores, -1, keepdims=True), 1e-20)
    p = jnp.sum(s * valid[..., None], 1) / n[:, None]
    return jnp.mean(jnp.sum(jax.lax.stop_gradient(f) * p, -1))


def expert_load(experts: jax.Array, valid: jax.Array, n_experts: int) -> jax.Array:
    """Tokens routed to each expert [E] (float, padding excluded)."""
    onehot = jax.nn.one_hot(experts, n_experts, dtype=jnp.float32)
    return jnp.sum(onehot * valid.astype(jnp.float32)[..., None, None], axis=(0, 1, 2))


def bias_update(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
    """Aux-loss-free balancing: raise under-loaded experts' bias, lower over-loaded ones."""
    return bias + jnp.float32(rate) * jnp.sign(jnp.mean(load) - load)


def load_imbalance(load: jax.Array) -> jax.Array:
    """max load / mean load (1 = perfectly balanced)."""
    return jnp.max(load) / jnp.maximum(jnp.mean(load), 1e-9)
