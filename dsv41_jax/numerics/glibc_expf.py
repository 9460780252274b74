"""float32 exp with the rounding of glibc's ``expf``: torch's *scalar* CPU path (docs/NUMERICS.md).

torch's vectorised float32 kernels evaluate exp with SLEEF (`sleef_exp.expf_u10`); the elements a
kernel hands to its scalar lambda (the tail of a contiguous run shorter than a vector step, see
docs/NUMERICS.md) call ``std::exp``, i.e. glibc's ``expf``. The two differ by one ulp on a few
per cent of inputs, which is how the oracle's mHC ``post`` came out 1 ulp off ours on some rows.

Algorithm (glibc 2.27+ ``e_expf.c``, table size 32, FMA build as x86-64 glibc selects it): in
float64, z = x * 32/ln2, k = round(z) by the 1.5 * 2^52 shift trick, r = z - k,
2^(k/32) from a 32-entry table plus exponent bits, a degree-3 polynomial in r with fused
multiply-adds, then one rounding to float32. Needs 64-bit types (exact mode enables them).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.numerics.exact_ops import no_fma

_N = 32
EXP2_TABLE = np.array([
    0x3ff0000000000000, 0x3fefd9b0d3158574, 0x3fefb5586cf9890f, 0x3fef9301d0125b51,
    0x3fef72b83c7d517b, 0x3fef54873168b9aa, 0x3fef387a6e756238, 0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715, 0x3feef1a7373aa9cb, 0x3feedea64c123422, 0x3feece086061892d,
    0x3feebfdad5362a27, 0x3feeb42b569d4f82, 0x3feeab07dd485429, 0x3feea47eb03a5585,
    0x3feea09e667f3bcd, 0x3fee9f75e8ec5f74, 0x3feea11473eb0187, 0x3feea589994cce13,
    0x3feeace5422aa0db, 0x3feeb737b0cdc5e5, 0x3feec49182a3f090, 0x3feed503b23e255d,
    0x3feee89f995ad3ad, 0x3feeff76f2fb5e47, 0x3fef199bdd85529c, 0x3fef3720dcef9069,
    0x3fef5818dcfba487, 0x3fef7c97337b9b5f, 0x3fefa4afa2a490da, 0x3fefd0765b6e4540,
], dtype=np.uint64)
_SHIFT = float.fromhex("0x1.8p+52")
_INVLN2N = float.fromhex("0x1.71547652b82fep+0") * _N
_C = (float.fromhex("0x1.c6af84b912394p-5") / _N / _N / _N,
      float.fromhex("0x1.ebfce50fac4f3p-3") / _N / _N,
      float.fromhex("0x1.62e42ff0c52d6p-1") / _N)
_OVERFLOW = float(np.float32(float.fromhex("0x1.62e42ep6")))
_UNDERFLOW = float(np.float32(-float.fromhex("0x1.9fe368p6")))


def _fma64(a, b, c):
    """float64 a * b + c with one rounding: Dekker product + Knuth sum, every step fenced so XLA
    cannot contract it."""
    a, b, c = no_fma(a), no_fma(b), no_fma(c)
    p = no_fma(a * b)
    split = jnp.float64(134217729.0)  # 2^27 + 1

    def halves(v):
        t = no_fma(split * v)
        hi = no_fma(t - no_fma(t - v))
        return hi, no_fma(v - hi)

    ah, al = halves(a)
    bh, bl = halves(b)
    err = no_fma(no_fma(no_fma(no_fma(ah * bh) - p) + no_fma(ah * bl)) + no_fma(al * bh)) + no_fma(al * bl)
    s = no_fma(p + c)
    bb = no_fma(s - p)
    t = no_fma(no_fma(p - no_fma(s - bb)) + no_fma(c - bb))
    return no_fma(s + no_fma(t + no_fma(err)))


def expf_glibc(x: jax.Array) -> jax.Array:
    """exp(x) in float32, bit-identical to glibc's FMA ``expf``."""
    if jax.dtypes.canonicalize_dtype(jnp.float64) != jnp.float64:
        raise RuntimeError("expf_glibc computes in float64; wrap the call in `with jax.enable_x64(True):`")
    f64 = jnp.float64
    x = jnp.asarray(x, jnp.float32)
    xd = x.astype(f64)
    z = no_fma(f64(_INVLN2N) * xd)
    kd = no_fma(z + f64(_SHIFT))
    ki = jax.lax.bitcast_convert_type(kd, jnp.uint64)
    kd = no_fma(kd - f64(_SHIFT))
    r = no_fma(z - kd)
    t = jnp.asarray(EXP2_TABLE)[(ki % np.uint64(_N)).astype(jnp.int32)] + (ki << np.uint64(52 - 5))
    s = jax.lax.bitcast_convert_type(t, f64)
    zz = _fma64(f64(_C[0]), r, f64(_C[1]))
    r2 = no_fma(r * r)
    y = _fma64(f64(_C[2]), r, f64(1.0))
    y = _fma64(zz, r2, y)
    y = no_fma(y * s).astype(jnp.float32)
    y = jnp.where(x > _OVERFLOW, jnp.float32(jnp.inf), y)
    y = jnp.where(x < _UNDERFLOW, jnp.float32(0.0), y)
    return jnp.where(jnp.isnan(x), x, y)
