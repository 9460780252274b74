"""Float32 operations whose rounding XLA must not change (needed for bit-exact oracle parity).

XLA's algebraic simplifier rewrites ``a / broadcast(b)`` (and ``a / constant``) into
``a * (1 / b)``, which rounds twice; under ``jit`` that flips e.g. 0.0732421875 / 0.05859375 = 1.25
to 1.2500001. ``lax.optimization_barrier`` does not prevent it on CPU (the barrier is expanded away
first), so the divisor is routed through a select the simplifier cannot fold; the quotient is
fenced too, or (a / b) / c is folded into a / (b * c). The same select keeps multiply-then-add in
two roundings (`no_fma`), which XLA would otherwise contract into an FMA.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _fence(x: jax.Array) -> jax.Array:
    return jnp.where(x == x, x, jnp.asarray(jnp.nan, x.dtype))


def true_divide(a: jax.Array, b: jax.Array) -> jax.Array:
    """IEEE a / b with numpy broadcasting, one rounding, also under jit."""
    shape = jnp.broadcast_shapes(jnp.shape(a), jnp.shape(b))
    a = jnp.broadcast_to(a, shape)
    b = jnp.broadcast_to(jnp.asarray(b, a.dtype), shape)
    # a == a is false only for NaN a, where a / a is NaN just like a / b. The fence on the result
    # stops the simplifier folding (a / b) / c into a / (b * c).
    return _fence(a / jnp.where(a == a, b, a))


def sum_in_order(x: jax.Array, axis: int) -> jax.Array:
    """Left-to-right sum along a short `axis`, keeping it (an XLA reduce may reassociate)."""
    parts = jnp.split(x, x.shape[axis], axis=axis)
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def no_fma(x: jax.Array) -> jax.Array:
    """Round x to its dtype here, so a following add cannot fuse with the multiply that made x.

    Under jit, XLA's CPU and GPU backends contract ``a * b + c`` into one fused multiply-add (one
    rounding instead of two); torch's eager CPU kernels never do. A select on ``x == x`` (NaN
    stays NaN) is opaque to the contraction and costs one compare per element.
    """
    return _fence(x)
