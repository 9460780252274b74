"""float32 exp with the rounding of torch's CPU kernels (SLEEF ``expf_u10``, FMA variant).

The golden oracle ran torch on CPU, where ``torch.exp`` / ``sigmoid`` / ``softmax`` evaluate
float32 exp with SLEEF's ``xexpf`` (1-ulp accurate, not correctly rounded). XLA's exp agrees with it
on ~99 % of inputs; the rest differ by 1 ulp. Exact-parity paths (Sinkhorn, sparse attention in
``mode="exact"``) use this emulation so those 1-ulp flips do not appear.

Algorithm (public SLEEF ``xexpf``): Cody-Waite reduction by ln 2 in two parts, a degree-6 Horner
polynomial with fused multiply-adds, then scaling by 2^q in two exact steps. FMA is not a JAX
primitive, so it is emulated in float32 with error-free transformations (Dekker product + Knuth
sum), which is exact for every operand range that occurs here.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.exact_ops import no_fma

# SLEEF constants (sleef/src/libm/misc.h and sleefsimdsp.c)
_R_LN2 = 1.442695040888963407359924681001892137426645954152985934135449406931
_L2U = 0.693145751953125
_L2L = 1.428606765330187045e-06
_POLY = (
    0.000198527617612853646278381,
    0.00139304355252534151077271,
    0.00833336077630519866943359,
    0.0416664853692054748535156,
    0.166666671633720397949219,
    0.5,
)


def _f32(v: float) -> jax.Array:
    return jnp.float32(v)


def _split(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Veltkamp split of a float32 into two 12-bit halves (a = hi + lo exactly)."""
    c = no_fma(_f32(4097.0) * a)
    hi = c - (c - a)
    return hi, a - hi


def _fma(a: jax.Array, b: jax.Array, c: jax.Array) -> jax.Array:
    """a * b + c with a single rounding (emulated: exact product, exact sum, one final add).

    Every intermediate is fenced with `no_fma` so XLA's own contraction cannot break the
    error-free transformations.
    """
    a, b, c = no_fma(a), no_fma(b), no_fma(c)
    p = no_fma(a * b)
    ah, al = _split(a)
    bh, bl = _split(b)
    p_err = ((no_fma(ah * bh) - p) + no_fma(ah * bl) + no_fma(al * bh)) + no_fma(al * bl)
    s = p + c
    bb = s - p
    s_err = (p - (s - bb)) + (c - bb)
    return s + (s_err + p_err)


def _pow2(k: jax.Array) -> jax.Array:
    """2^k for integer k in [-126, 127], from the exponent bits."""
    return jax.lax.bitcast_convert_type(((k + 127) << 23).astype(jnp.int32), jnp.float32)


def expf_u10(x: jax.Array) -> jax.Array:
    """exp(x) in float32, bit-identical to SLEEF's FMA ``expf_u10`` (torch's CPU float exp)."""
    d = jnp.asarray(x, jnp.float32)
    q = jnp.round(no_fma(d * _f32(_R_LN2)))  # round half to even, like the vector rint
    s = _fma(q, _f32(-_L2U), d)
    s = _fma(q, _f32(-_L2L), s)
    u = jnp.full_like(d, _f32(_POLY[0]))
    for coeff in _POLY[1:]:
        u = _fma(u, s, _f32(coeff))
    u = _f32(1.0) + _fma(no_fma(s * s), u, s)
    qi = jnp.clip(q, -150, 150).astype(jnp.int32)
    half = qi >> 1
    u = u * _pow2(half) * _pow2(qi - half)
    u = jnp.where(d < -104.0, _f32(0.0), u)
    u = jnp.where(d > 104.0, _f32(jnp.inf), u)
    return jnp.where(jnp.isnan(d), d, u)
