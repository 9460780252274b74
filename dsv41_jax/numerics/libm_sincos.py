"""float32 cos/sin with the rounding of glibc's ``cosf``/``sinf`` (what ``torch.polar`` calls on CPU).

The reference builds its RoPE tables with ``torch.polar``, whose CPU kernel is scalar C++ calling
``std::cos``/``std::sin`` on float, i.e. glibc's ``cosf``/``sinf`` (docs/NUMERICS.md, "RoPE
tables"). Those are not correctly rounded (worst case 0.56 ulp): rounding a float64 cos to float32
differs from them on ~1 % of the RoPE angles, XLA's cos on an accelerator differs too. So the
tables are built on the host with this transcription of glibc's algorithm (glibc 2.28+,
sysdeps/ieee754/flt-32: ``s_sinf.c``, ``s_cosf.c``, ``s_sincosf.h``, ``sincosf_poly.h``):

  * |y| < pi/4: a polynomial in double directly;
  * |y| < 120: one-step reduction by pi/2 in double (``reduce_fast``, quadrant from a scaled
    truncating float-to-int conversion);
  * otherwise: a 32x96-bit integer product with 4/pi (``reduce_large``);
  * then a degree-4 cosine or degree-3 (odd) sine polynomial in double, rounded once to float32.

x86-64 glibc selects its FMA build on FMA-capable CPUs (every AVX2/AVX512 machine), where GCC
contracts each ``a + b * c`` into one fused multiply-add; `fma=True` (the default) follows that.
Plain numpy float64, vectorised; checked against the C library and torch in
tests/layers/test_rope_tables.py.
"""
from __future__ import annotations

import numpy as np

_HPI_INV_SCALED = float.fromhex("0x1.45F306DC9C883p+23")  # 2/pi * 2^24 (non-TOINT build)
_HPI = float.fromhex("0x1.921FB54442D18p0")  # pi/2
_PI63 = float.fromhex("0x1.921FB54442D18p-62")  # 2 pi * 2^-64
_PIO4_F32 = np.float32(float.fromhex("0x1.921FB54442D18p-1"))
_SIGN = np.array([1.0, -1.0, -1.0, 1.0])
# (c0..c4, s1..s3); the second table negates the cosine polynomial
_COS = [float.fromhex(h) for h in ("0x1p0", "-0x1.ffffffd0c621cp-2", "0x1.55553e1068f19p-5",
                                   "-0x1.6c087e89a359dp-10", "0x1.99343027bf8c3p-16")]
_SIN = [float.fromhex(h) for h in ("-0x1.555545995a603p-3", "0x1.1107605230bc4p-7", "-0x1.994eb3774cf24p-13")]
_INV_PIO4 = np.array([
    0xa2, 0xa2f9, 0xa2f983, 0xa2f9836e, 0xf9836e4e, 0x836e4e44, 0x6e4e4415, 0x4e441529,
    0x441529fc, 0x1529fc27, 0x29fc2757, 0xfc2757d1, 0x2757d1f5, 0x57d1f534, 0xd1f534dd, 0xf534ddc0,
    0x34ddc0db, 0xddc0db62, 0xc0db6295, 0xdb629599, 0x6295993c, 0x95993c43, 0x993c4390, 0x3c439041,
], dtype=np.uint64)


def _two_prod(a, b):
    """a * b = p + e exactly (Veltkamp/Dekker in float64)."""
    p = a * b
    split = 134217729.0  # 2^27 + 1
    ca, cb = split * a, split * b
    ah = ca - (ca - a)
    bh = cb - (cb - b)
    al, bl = a - ah, b - bh
    return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


def _fma(a, b, c):
    """float64 a * b + c with one rounding (error-free product and sum; exact for these ranges)."""
    p, e = _two_prod(a, b)
    s = p + c
    bb = s - p
    t = (p - (s - bb)) + (c - bb)
    return s + (t + e)


def _muladd(c, a, b, fma):
    """c + a * b the way the compiled glibc evaluates it."""
    return _fma(a, b, c) if fma else c + a * b


def _abstop12(y: np.ndarray) -> np.ndarray:
    return (y.view(np.uint32) >> np.uint32(20)) & np.uint32(0x7FF)


def _reduce_fast(x, fma):
    r = x * _HPI_INV_SCALED
    n = (np.trunc(r).astype(np.int64).astype(np.int32) + np.int32(0x800000)) >> np.int32(24)
    return _muladd(x, -n.astype(np.float64), _HPI, fma), n.astype(np.int64)


def _reduce_large(xi: np.ndarray):
    """|y| >= 120: Payne-Hanek with a 192-bit 4/pi; xi are the float32 bits (sign ignored)."""
    xi = xi.astype(np.uint64)
    idx = ((xi >> np.uint64(26)) & np.uint64(15)).astype(np.int64)
    shift = (xi >> np.uint64(23)) & np.uint64(7)
    m = ((xi & np.uint64(0xFFFFFF)) | np.uint64(0x800000)) << shift
    m &= np.uint64(0xFFFFFFFF)  # xi is a uint32 in C
    mask32 = np.uint64(0xFFFFFFFF)
    res0 = (m * _INV_PIO4[idx]) & mask32  # 32-bit product
    res1 = m * _INV_PIO4[idx + 4]
    res2 = m * _INV_PIO4[idx + 8]
    res0 = (res2 >> np.uint64(32)) | (res0 << np.uint64(32))
    res0 = res0 + res1
    n = (res0 + (np.uint64(1) << np.uint64(61))) >> np.uint64(62)
    res0 = res0 - (n << np.uint64(62))
    return res0.view(np.int64).astype(np.float64) * _PI63, n.astype(np.int64)


def _poly(x, x2, negate_cos, use_cos, fma):
    """sinf_poly: the odd sine polynomial, or the (possibly negated) cosine one, rounded to f32."""
    csign = np.where(negate_cos, -1.0, 1.0)
    c0, c1, c2, c3, c4 = (csign * c for c in _COS)
    s1c, s2c, s3c = _SIN
    # sine branch
    x3 = x * x2
    s1 = _muladd(s2c, x2, s3c, fma)
    x7 = x3 * x2
    s = _muladd(x, x3, s1c, fma)
    sin_val = _muladd(s, x7, s1, fma)
    # cosine branch
    x4 = x2 * x2
    cc2 = _muladd(c3, x2, c4, fma)
    cc1 = _muladd(c0, x2, c1, fma)
    x6 = x4 * x2
    c = _muladd(cc1, x4, c2, fma)
    cos_val = _muladd(c, x6, cc2, fma)
    return np.where(use_cos, cos_val, sin_val).astype(np.float32)


def _eval(y: np.ndarray, want_cos: bool, fma: bool) -> np.ndarray:
    with np.errstate(invalid="ignore", over="ignore"):  # lanes of other branches / non-finite y
        return _eval_lanes(np.ascontiguousarray(y, dtype=np.float32), want_cos, fma)


def _eval_lanes(y: np.ndarray, want_cos: bool, fma: bool) -> np.ndarray:
    shape = y.shape
    y = y.reshape(-1)
    x = y.astype(np.float64)
    top = _abstop12(y)
    small = top < _abstop12(np.array([_PIO4_F32]))[0]
    tiny = top < _abstop12(np.array([np.float32(2.0 ** -12)]))[0]
    mid = ~small & (top < _abstop12(np.array([np.float32(120.0)]))[0])
    finite = np.isfinite(y)
    big = ~small & ~mid & finite

    xr_f, n_f = _reduce_fast(np.where(mid, x, 0.0), fma)
    xi = y.view(np.uint32)
    xr_l, n_l = _reduce_large(np.where(big, xi, np.uint32(0x43000000)))
    sign = (xi >> np.uint32(31)).astype(np.int64)
    q = np.where(mid, n_f, np.where(big, n_l + sign, 0))  # quadrant picking the sign and table
    n = np.where(mid, n_f, np.where(big, n_l, 0))  # quadrant picking sin vs cos polynomial
    xr = np.where(mid, xr_f, np.where(big, xr_l, x))
    s = np.where(small, 1.0, _SIGN[q & 3])
    negate = ~small & ((q & 2) != 0)
    use_cos = ((n ^ 1) & 1) == 1 if want_cos else (n & 1) == 1
    out = _poly(xr * s, xr * xr, negate, use_cos, fma)
    out = np.where(tiny, np.float32(1.0) if want_cos else y, out)
    out = np.where(finite, out, np.float32(np.nan))
    return out.reshape(shape)


def cosf(y, *, fma: bool = True) -> np.ndarray:
    """glibc ``cosf`` of float32 `y`, elementwise (float32 result)."""
    return _eval(np.asarray(y, np.float32), True, fma)


def sinf(y, *, fma: bool = True) -> np.ndarray:
    """glibc ``sinf`` of float32 `y`, elementwise (float32 result)."""
    return _eval(np.asarray(y, np.float32), False, fma)
