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

from dsv41_jax.numerics.exact_ops import no_fma

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


# ----------------------------------------------------------------------------------- log1p
# SLEEF 3.6+ ``xlog1pf`` (AVX2 + FMA build, as torch's ``Vectorized<float>::log1p`` calls it):
# reduce 1 + d to m in [0.75, 1.5) * 2^e, write log(1 + m') = 2 atanh(m / (2 + m)) with a
# double-float quotient, a degree-2 polynomial in x^2 and double-float accumulation with e ln 2.
_LN2_HI, _LN2_LO = 0.69314718246459960938, -1.904654323148236017e-09
_LOG1P_POLY = (0.3027294874, 0.3996108174, 0.6666694880)


def fma64(a: jax.Array, b: jax.Array, c: jax.Array) -> jax.Array:
    """float32 fused multiply-add through float64: the product of two float32 is exact there, so
    only the final sum rounds (twice, f64 then f32; a tie broken differently needs a 2^-29 event)."""
    f64 = jnp.float64
    return (a.astype(f64) * b.astype(f64) + c.astype(f64)).astype(jnp.float32)


def log1pf_u10(d: jax.Array) -> jax.Array:
    """float32 log1p(d) with the rounding of SLEEF's ``xlog1pf`` (needs 64-bit types enabled)."""
    f32 = jnp.float32
    d = jnp.asarray(d, f32)
    one = f32(1.0)
    dp1 = no_fma(d + one)
    tiny = dp1 < f32(1.1754943508222875e-38)
    dp1 = jnp.where(tiny, no_fma(dp1 * f32(2.0 ** 64)), dp1)
    scaled = no_fma(dp1 * f32(1.0 / 0.75))
    e = ((jax.lax.bitcast_convert_type(scaled, jnp.int32) >> 23) & 0xFF) - 0x7F
    t = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(one, jnp.int32) + ((-e) << 23), f32)
    m = fma64(d, t, no_fma(t - one))
    e = jnp.where(tiny, e - 64, e).astype(f32)
    # s = (ln2_hi, ln2_lo) * e as a double-float
    s_hi = no_fma(f32(_LN2_HI) * e)
    s_lo = fma64(f32(_LN2_LO), e, no_fma(fma64(f32(_LN2_HI), e, -s_hi)))
    # x = m / (2 + m) as a double-float
    den_hi = no_fma(f32(2.0) + m)
    den_lo = no_fma(no_fma(f32(2.0) - den_hi) + m)
    rec = one / den_hi
    x_hi = no_fma(m * rec)
    u = fma64(rec, m, -x_hi)
    v = fma64(-den_lo, rec, fma64(-den_hi, rec, one))
    x_lo = fma64(x_hi, v, u)
    x2 = no_fma(x_hi * x_hi)
    p = f32(_LOG1P_POLY[0])
    p = fma64(p, x2, f32(_LOG1P_POLY[1]))
    p = fma64(p, x2, f32(_LOG1P_POLY[2]))
    # s += 2x (|s| >= |2x| branch-free form), then s += x^3 p
    tx_hi, tx_lo = no_fma(x_hi * f32(2.0)), no_fma(x_lo * f32(2.0))
    hi = no_fma(s_hi + tx_hi)
    lo = no_fma(no_fma(no_fma(no_fma(s_hi - hi) + tx_hi) + s_lo) + tx_lo)
    s_hi, s_lo = hi, lo
    tail = no_fma(no_fma(x2 * x_hi) * p)
    hi = no_fma(s_hi + tail)
    lo = no_fma(no_fma(no_fma(s_hi - hi) + tail) + s_lo)
    r = no_fma(hi + lo)
    r = jnp.where(d > f32(1e38), f32(jnp.inf), r)
    r = jnp.where(d < -one, f32(jnp.nan), r)
    r = jnp.where(d == -one, f32(-jnp.inf), r)
    return jnp.where((d == 0) & jnp.signbit(d), f32(-0.0), r)
