"""float32 log1p with the rounding of glibc's ``log1pf``: torch's *scalar* CPU path (docs/NUMERICS.md).

torch's float32 softplus runs ``log1p(exp(x))``: SLEEF (`sleef_exp.log1pf_u10`) on the vector
body, ``std::log1p`` (glibc ``log1pf``) on the elements its scalar lambda takes (the tail of a
contiguous run, `torch_loops.scalar_tail_mask`; every decode step of the sqrtsoftplus gate).

Algorithm: glibc's ``sysdeps/ieee754/flt-32/s_log1pf.c`` up to glibc 2.40 (the fdlibm code
converted to float by Cygnus; glibc 2.41 replaced it with CORE-MATH's correctly rounded one):
all float32 arithmetic, no fused multiply-adds (x86-64 builds it for the baseline ISA):
k and f with 1 + x = 2^k (1 + f), a correction c for the rounding of 1 + x, s = f / (2 + f), a
degree-7 polynomial in s^2, and k ln2 split in a high and a low part. Each product is fenced
(`no_fma`) so XLA cannot contract it. Checked against the C library and torch's scalar path in
tests/numerics/test_glibc_log1pf.py.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.numerics.exact_ops import no_fma, true_divide

_LN2_HI = 6.9313812256e-01  # 0x3f317180
_LN2_LO = 9.0580006145e-06  # 0x3717f7d1
_LP = (6.6666668653e-01, 4.0000000596e-01, 2.8571429849e-01, 2.2222198546e-01, 1.8183572590e-01,
       1.5313838422e-01, 1.4798198640e-01)


def _bits(x):
    return jax.lax.bitcast_convert_type(x, jnp.int32)


def _float(i):
    return jax.lax.bitcast_convert_type(i.astype(jnp.int32), jnp.float32)


def log1pf_glibc(x: jax.Array) -> jax.Array:
    """log1p(x) in float32, bit-identical to glibc's (<= 2.40) ``log1pf``."""
    f32 = jnp.float32
    x = jnp.asarray(x, f32)
    one, half = f32(1.0), f32(0.5)
    hx = _bits(x)
    ax = hx & 0x7FFFFFFF

    # k = 0 branch: -0.2929 < x < 0.41422 (and the tiny-|x| early returns)
    small = hx < 0x3ED413D7
    k0 = small & ((hx > 0) | (hx <= jnp.int32(-1097468385)))  # (int32_t)0xbe95f61f

    # k != 0: 1 + x = 2^k u with the rounding of 1 + x corrected by c
    u = no_fma(one + x)
    big = hx >= 0x5A000000
    hu = jnp.where(big, hx, _bits(u))
    k = (hu >> 23) - 127
    c = jnp.where(k > 0, no_fma(one - no_fma(u - x)), no_fma(x - no_fma(u - one)))
    c = jnp.where(big, f32(0.0), true_divide(c, u))
    hu = hu & 0x007FFFFF
    low = hu < 0x3504F7
    u_n = jnp.where(low, _float(hu | 0x3F800000), _float(hu | 0x3F000000))
    k = jnp.where(low, k, k + 1)
    hu = jnp.where(low, hu, (0x00800000 - hu) >> 2)
    f = no_fma(u_n - one)

    f = jnp.where(k0, x, f)
    k = jnp.where(k0, 0, k)
    hu = jnp.where(k0, 1, hu)
    c = jnp.where(k0, f32(0.0), c)
    # tied to x so XLA cannot prove kf non-NaN and drop the `no_fma` fences on its products
    kf = jnp.where(x == x, k.astype(f32), f32(jnp.nan))

    hfsq = no_fma(no_fma(half * f) * f)
    klo = no_fma(no_fma(kf * f32(_LN2_LO)) + c)
    khi = no_fma(kf * f32(_LN2_HI))
    # |f| < 2^-20 (hu == 0)
    r0 = no_fma(hfsq * no_fma(one - no_fma(f32(0.66666666666666666) * f)))
    tiny_f = jnp.where(k == 0, no_fma(f - r0), no_fma(khi - no_fma(no_fma(r0 - klo) - f)))
    zero_f = jnp.where(k == 0, f32(0.0), no_fma(khi + klo))
    tiny_f = jnp.where(f == 0, zero_f, tiny_f)
    # general case
    s = true_divide(f, no_fma(f32(2.0) + f))
    z = no_fma(s * s)
    r = f32(_LP[6])
    for coef in _LP[5::-1]:
        r = no_fma(f32(coef) + no_fma(z * r))
    r = no_fma(z * r)
    sr = no_fma(s * no_fma(hfsq + r))
    gen = jnp.where(k == 0, no_fma(f - no_fma(hfsq - sr)),
                    no_fma(khi - no_fma(no_fma(hfsq - no_fma(sr + klo)) - f)))
    out = jnp.where(hu == 0, tiny_f, gen)

    # special cases, in the C code's order of precedence
    out = jnp.where(hx >= 0x7F800000, no_fma(x + x), out)  # +inf, nan with the sign bit clear
    tiny = small & (ax < 0x31000000)
    out = jnp.where(tiny, jnp.where(ax < 0x24800000, x, no_fma(x - no_fma(no_fma(x * x) * half))), out)
    le_m1 = small & (ax >= 0x3F800000)
    out = jnp.where(le_m1, jnp.where(x == -one, f32(-jnp.inf), f32(jnp.nan)), out)
    return out
