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


# ------------------------------------------------------------------ torch's CPU float32 sums
# The golden oracle ran torch on an x86 CPU with AVX2 kernels. Its float32 `sum`/`mean` over the
# contiguous last axis is a fixed "cascade": 8-lane vectors, 4 interleaved accumulators, partial
# sums folded in levels of 16 (ATen ReduceOps `cascade_sum` / `row_sum` / `multi_row_sum`;
# confirmed bit for bit against the oracle's mHC coefficients, where a float64 or an XLA tree sum
# is off by one ulp in ~5 % of rows). The order below is a restatement of that schedule.
_TORCH_LANES = 8
_TORCH_ILP = 4
_TORCH_LEVELS = 4


def _level_sum(rows: list) -> jax.Array:
    """Sum a list of equally shaped arrays in torch's multi-level order (`multi_row_sum`)."""
    n = len(rows)
    power = max(4, (max(n - 1, 0).bit_length()) // _TORCH_LEVELS)
    step = 1 << power
    mask = step - 1
    zero = jnp.zeros_like(rows[0])
    acc = [zero] * _TORCH_LEVELS
    i = 0
    while i + step <= n:
        for _ in range(step):
            acc[0] = acc[0] + rows[i]
            i += 1
        for j in range(1, _TORCH_LEVELS):
            acc[j] = acc[j] + acc[j - 1]
            acc[j - 1] = zero
            if i & (mask << (j * power)):
                break
    while i < n:
        acc[0] = acc[0] + rows[i]
        i += 1
    for j in range(1, _TORCH_LEVELS):
        acc[0] = acc[0] + acc[j]
    return acc[0]


def _row_sum(cols: list) -> jax.Array:
    """torch `row_sum`: 4 interleaved accumulators over `cols`, leftovers into the first."""
    n = len(cols)
    groups = n // _TORCH_ILP
    if groups:
        stacked = [jnp.stack(cols[g * _TORCH_ILP:(g + 1) * _TORCH_ILP]) for g in range(groups)]
        part = _level_sum(stacked)
        parts = [part[k] for k in range(_TORCH_ILP)]
    else:
        parts = [jnp.zeros_like(cols[0]) for _ in range(_TORCH_ILP)]
    for c in cols[groups * _TORCH_ILP:]:
        parts[0] = parts[0] + c
    total = parts[0]
    for k in range(1, _TORCH_ILP):
        total = total + parts[k]
    return total


def torch_sum_last(x: jax.Array, keepdims: bool = False) -> jax.Array:
    """float32 sum over the last axis in the order of torch's CPU (AVX2) reduction kernel."""
    n = x.shape[-1]
    if n < _TORCH_LANES:  # scalar path: row_sum over single elements
        out = _row_sum([x[..., k] for k in range(n)])
    else:
        nvec = n // _TORCH_LANES
        vecs = x[..., :nvec * _TORCH_LANES].reshape(*x.shape[:-1], nvec, _TORCH_LANES)
        lanes = _row_sum([vecs[..., v, :] for v in range(nvec)])
        out = jnp.zeros(x.shape[:-1], x.dtype)
        for k in range(nvec * _TORCH_LANES, n):
            out = out + x[..., k]
        for k in range(_TORCH_LANES):
            out = out + lanes[..., k]
    return out[..., None] if keepdims else out


def torch_sum_axis(x: jax.Array, axis: int, keepdims: bool = False) -> jax.Array:
    """float32 sum over a non-contiguous axis: each output element accumulates the reduced
    axis in order, folded in torch's levels of 16 (`vectorized_outer_sum`)."""
    axis = axis % x.ndim
    rows = [jnp.take(x, k, axis=axis) for k in range(x.shape[axis])]
    out = _level_sum(rows)
    return jnp.expand_dims(out, axis) if keepdims else out


def torch_mean_last(x: jax.Array, keepdims: bool = False) -> jax.Array:
    """torch's CPU float32 mean over the last axis: the cascade sum, then one true division."""
    return true_divide(torch_sum_last(x, keepdims), jnp.asarray(x.shape[-1], x.dtype))


def exact_sqrt(x: jax.Array) -> jax.Array:
    """Correctly rounded float32 sqrt (XLA:CPU's float32 sqrt is not, in some fusions): through
    float64, where a double rounding of sqrt is provably harmless. Needs 64-bit types enabled."""
    return jnp.sqrt(x.astype(jnp.float64)).astype(x.dtype)
