"""Elementwise nonlinearities with an exact mode that rounds like torch's CPU kernels.

torch evaluates float32 `sigmoid`, `silu` and `softplus` on CPU through SLEEF's vectorized exp
(and log1p), dividing with a true IEEE division; XLA's own logistic/exp/log1p differ by an ulp on
a sizeable fraction of inputs, which moves routing weights and bf16 roundings downstream. Fast
mode uses XLA's functions.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.numerics.exact_ops import no_fma, true_divide
from dsv41_jax.numerics.glibc_expf import expf_glibc
from dsv41_jax.numerics.glibc_log1pf import log1pf_glibc
from dsv41_jax.numerics.mkl_sqrt import sqrt_mkl
from dsv41_jax.numerics.sleef_exp import expf_u10, fma64, log1pf_u10
from dsv41_jax.numerics.torch_loops import scalar_tail_mask


def with_scalar_tail(x: jax.Array, body, scalar, tail_dims: int | None) -> jax.Array:
    """torch's split of one elementwise call (docs/NUMERICS.md, "torch's vector body and scalar
    tail"): `scalar` where the oracle's loop takes its scalar lambda, `body` elsewhere. The last
    `tail_dims` dims of `x` are one oracle call's contiguous tensor; None: body everywhere."""
    if tail_dims is None:
        return body(x)
    return jnp.where(scalar_tail_mask(x.shape, tail_dims), scalar(x), body(x))


def sigmoid_scalar(x: jax.Array) -> jax.Array:
    """torch's scalar sigmoid lambda, 1 / (1 + std::exp(-x)): glibc expf (needs 64-bit types)."""
    x = x.astype(jnp.float32)
    return true_divide(jnp.ones_like(x), 1.0 + expf_glibc(-x))


def softplus_scalar(x: jax.Array) -> jax.Array:
    """torch's scalar softplus lambda (beta 1, threshold 20): x > 20 ? x : std::log1p(std::exp(x)),
    glibc expf and log1pf (needs 64-bit types)."""
    x = x.astype(jnp.float32)
    return jnp.where(x > 20.0, x, log1pf_glibc(expf_glibc(jnp.minimum(x, 20.0))))


def sigmoid(x: jax.Array, mode: str = "fast", tail_dims: int | None = None) -> jax.Array:
    """1 / (1 + exp(-x)) in float32. Exact mode: SLEEF's exp (torch's vector body); with
    `tail_dims`, the elements torch's scalar path computes use glibc's (`with_scalar_tail`).
    The Engram gate's sigmoid takes it (its [T, hc] call per sequence has a tail)."""
    if mode == "exact":
        x = x.astype(jnp.float32)
        return with_scalar_tail(x, lambda v: true_divide(jnp.ones_like(v), 1.0 + expf_u10(-v)), sigmoid_scalar,
                                tail_dims)
    return jax.nn.sigmoid(x)


def silu(x: jax.Array, mode: str = "fast") -> jax.Array:
    """x / (1 + exp(-x)) in float32 (torch's vectorized silu)."""
    if mode == "exact":
        x = x.astype(jnp.float32)
        return true_divide(x, 1.0 + expf_u10(-x))
    return jax.nn.silu(x)


def softplus(x: jax.Array, mode: str = "fast", tail_dims: int | None = None) -> jax.Array:
    """torch's softplus (beta 1, threshold 20): log1p(exp(x)), the identity above 20. Exact mode:
    SLEEF's exp and log1p (vector body); with `tail_dims`, glibc's on torch's scalar path (the
    sqrtsoftplus gate's [T, experts] call: the last tokens of a prefill, every decode step)."""
    if mode == "exact":
        x = x.astype(jnp.float32)
        body = lambda v: jnp.where(v > 20.0, v, log1pf_u10(expf_u10(jnp.minimum(v, 20.0))))
        return with_scalar_tail(x, body, softplus_scalar, tail_dims)
    return jnp.where(x > 20.0, x, jnp.log1p(jnp.exp(jnp.minimum(x, 20.0))))


def sqrt(x: jax.Array, mode: str = "fast") -> jax.Array:
    """float32 sqrt; exact mode rounds like torch.sqrt on the oracle's CPU (MKL, `mkl_sqrt`), which
    differs from IEEE on 17 % of inputs (the oracle's gate traces match it, docs/NUMERICS.md)."""
    return sqrt_mkl(x) if mode == "exact" else jnp.sqrt(x)


def swiglu(gate: jax.Array, up: jax.Array, limit: float, mode: str = "fast") -> jax.Array:
    """silu(min(gate, L)) * clamp(up, ±L) in fp32 (the clamps come from training)."""
    gate, up = gate.astype(jnp.float32), up.astype(jnp.float32)
    if limit > 0:
        up = jnp.clip(up, -limit, limit)
        gate = jnp.minimum(gate, limit)
    out = silu(gate, mode) * up
    return no_fma(out) if mode == "exact" else out


# torch's AVX512 `Vectorized<float>::erf` (Abramowitz-Stegun 7.1.26 with FMAs and SLEEF's exp):
# GELU of BF16 activations on CPU runs it on float32 lanes.
_ERF_P = 0.3275911
_ERF_POLY = (1.061405429, -1.453152027, 1.421413741, -0.284496736, 0.254829592)


def _erf_torch_vec(x: jax.Array) -> jax.Array:
    f32 = jnp.float32
    a = jnp.abs(x)
    t = true_divide(jnp.ones_like(x), fma64(f32(_ERF_P), a, f32(1.0)))
    r = f32(_ERF_POLY[0])
    for c in _ERF_POLY[1:]:
        r = fma64(r, t, f32(c))
    e = -expf_u10(-no_fma(x * x))
    y = fma64(no_fma(e * t), r, f32(1.0))
    return jnp.where(jnp.signbit(x), -y, y)


def gelu_erf(x: jax.Array, mode: str = "fast") -> jax.Array:
    """Exact (erf) GELU in float32: x * 0.5 * (1 + erf(x / sqrt 2)), in torch's CPU order."""
    x = x.astype(jnp.float32)
    if mode == "exact":
        alpha = jnp.float32(0.7071067811865476)
        return no_fma(no_fma(x * jnp.float32(0.5)) * no_fma(jnp.float32(1.0) + _erf_torch_vec(no_fma(x * alpha))))
    return jax.nn.gelu(x, approximate=False)


def softmax_lastdim(x: jax.Array, mode: str = "fast") -> jax.Array:
    """float32 softmax over the last axis. Exact mode follows torch's vectorised CPU kernel:
    exp(x - max) with SLEEF's exp, the lane-wise `reduce_all` sum, then a multiply by 1/sum."""
    x = x.astype(jnp.float32)
    if mode != "exact":
        return jax.nn.softmax(x, axis=-1)
    e = expf_u10(x - jnp.max(x, axis=-1, keepdims=True))
    total = _torch_reduce_all_sum(e)
    return e * true_divide(jnp.ones_like(total), total)


_AVX512_LANES = 16


def _torch_reduce_all_sum(x: jax.Array) -> jax.Array:
    """torch's `vec::reduce_all` sum over the last axis (AVX512: 16 lanes), keepdims.

    Fewer elements than lanes: a left-to-right scalar sum. Otherwise lane-wise accumulation of
    whole vectors, the tail added into its lanes, then the shuffle tree (lanes i^8, i^4, i^2, i^1).
    """
    n, L = x.shape[-1], _AVX512_LANES
    if n < L:
        total = x[..., 0]
        for k in range(1, n):
            total = total + x[..., k]
        return total[..., None]
    acc = x[..., :L]
    full = n - n % L
    for d in range(L, full, L):
        acc = acc + x[..., d:d + L]
    if full < n:
        tail = n - full
        acc = jnp.concatenate([acc[..., :tail] + x[..., full:], acc[..., tail:]], -1)
    width = L
    while width > 1:  # lane i takes lane i ^ (width/2); only the low lanes are read afterwards
        width //= 2
        acc = acc[..., :width] + acc[..., width:2 * width]
    return acc
