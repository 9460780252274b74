"""Elementwise nonlinearities with an exact mode that rounds like torch's CPU kernels.

torch evaluates float32 `sigmoid`, `silu` and `softplus` on CPU through SLEEF's vectorized exp
(and log1p), dividing with a true IEEE division; XLA's own logistic/exp/log1p differ by an ulp on
a sizeable fraction of inputs, which moves routing weights and bf16 roundings downstream. Fast
mode uses XLA's functions.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.numerics.exact_ops import exact_sqrt, no_fma, true_divide
from dsv41_jax.numerics.sleef_exp import expf_u10, log1pf_u10


def sigmoid(x: jax.Array, mode: str = "fast") -> jax.Array:
    """1 / (1 + exp(-x)) in float32."""
    if mode == "exact":
        x = x.astype(jnp.float32)
        return true_divide(jnp.ones_like(x), 1.0 + expf_u10(-x))
    return jax.nn.sigmoid(x)


def silu(x: jax.Array, mode: str = "fast") -> jax.Array:
    """x / (1 + exp(-x)) in float32 (torch's vectorized silu)."""
    if mode == "exact":
        x = x.astype(jnp.float32)
        return true_divide(x, 1.0 + expf_u10(-x))
    return jax.nn.silu(x)


def softplus(x: jax.Array, mode: str = "fast") -> jax.Array:
    """torch's softplus (beta 1, threshold 20): log1p(exp(x)), the identity above 20."""
    if mode == "exact":
        x = x.astype(jnp.float32)
        return jnp.where(x > 20.0, x, log1pf_u10(expf_u10(jnp.minimum(x, 20.0))))
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def sqrt(x: jax.Array, mode: str = "fast") -> jax.Array:
    """float32 sqrt; exact mode guarantees IEEE rounding (see `exact_ops.exact_sqrt`)."""
    return exact_sqrt(x) if mode == "exact" else jnp.sqrt(x)


def swiglu(gate: jax.Array, up: jax.Array, limit: float, mode: str = "fast") -> jax.Array:
    """silu(min(gate, L)) * clamp(up, ±L) in fp32 (the clamps come from training)."""
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    if limit > 0:
        up = jnp.clip(up, -limit, limit)
        gate = jnp.minimum(gate, limit)
    out = silu(gate, mode) * up
    return no_fma(out) if mode == "exact" else out
