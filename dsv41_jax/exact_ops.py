"""Float32 operations whose rounding XLA must not change (needed for bit-exact oracle parity).

XLA's algebraic simplifier rewrites ``a / broadcast(b)`` (and ``a / constant``) into
``a * (1 / b)``, which rounds twice; under ``jit`` that flips e.g. 0.0732421875 / 0.05859375 = 1.25
to 1.2500001. ``lax.optimization_barrier`` does not prevent it on CPU (the barrier is expanded away
first), so the divisor is routed through a select the simplifier cannot fold.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def true_divide(a: jax.Array, b: jax.Array) -> jax.Array:
    """IEEE a / b with numpy broadcasting, one rounding, also under jit."""
    shape = jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b))
    a = jnp.broadcast_to(a, shape)
    b = jnp.broadcast_to(jnp.asarray(b, a.dtype), shape)
    # a == a is false only for NaN a, where a / a is NaN just like a / b
    return a / jnp.where(a == a, b, a)


def sum_in_order(x: jax.Array, axis: int) -> jax.Array:
    """Left-to-right sum along a short `axis`, keeping it (an XLA reduce may reassociate)."""
    parts = jnp.split(x, x.shape[axis], axis=axis)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total
