"""float32 pow with the rounding of SLEEF's ``xpowf`` (u10, AVX-512 FMA build): torch's vector body.

torch's ``pow(Scalar, Tensor)`` and ``pow(Tensor, Tensor)`` run ``Sleef_powf16_u10`` on whole
vector steps (2 x 16 lanes with AVX-512) and glibc ``powf`` on the rest (docs/NUMERICS.md). The
RoPE frequencies ``base ** exps`` have rope_head_dim / 2 exponents, so with rope_head_dim >= 64 the
first 32 * floor(n / 32) of them come from here (`rope_pow` below), the tail from
`libm_powf.powf`.

Transcription of SLEEF 3.6 ``src/libm/sleefsimdsp.c`` (``xpowf``, ``logkf``, ``expkf``) with the
FMA double-float helpers of ``df.h`` (ENABLE_FMA_SP) and the AVX-512 ``getexp``/``getmant``
(mantissa normalised to [0.75, 1.5)). Host-side numpy float32; each fused multiply-add is
computed exactly (`_fma32`: the float64 product of two float32 is exact, the sum is rounded to
odd in float64 and then to nearest in float32), so the result does not depend on numpy's CPU
dispatch. Checked against torch 2.14.1 in tests/numerics/test_sleef_powf.py (slow).
"""
from __future__ import annotations

import numpy as np

from dsv41_jax.numerics.libm_powf import powf, two_sum
from dsv41_jax.numerics.torch_loops import TORCH_AVX512_STEP

F32 = np.float32
_L2U, _L2L = F32(0.693145751953125), F32(1.428606765330187045e-06)
_R_LN2 = F32(1.442695040888963407359924681001892137426645954152985934135449406931)


def _fma32(a, b, c) -> np.ndarray:
    """float32 a * b + c with one rounding."""
    p = np.asarray(a, np.float64) * np.asarray(b, np.float64)  # exact: 24 + 24 bits
    s, t = two_sum(p, np.asarray(c, np.float64))
    odd = (s.view(np.int64) & 1) == 1
    s = np.where((t != 0) & ~odd, np.nextafter(s, np.where(t > 0, np.inf, -np.inf)), s)
    return s.astype(F32)


def _add(a, b):
    return (np.asarray(a, F32) + np.asarray(b, F32)).astype(F32)


def _sub(a, b):
    return (np.asarray(a, F32) - np.asarray(b, F32)).astype(F32)


def _mul(a, b):
    return (np.asarray(a, F32) * np.asarray(b, F32)).astype(F32)


# double-float helpers (df.h, FMA variants); a pair is (hi, lo)
def _dfadd2_f_f(x, y):
    rx = _add(x, y)
    v = _sub(rx, x)
    return rx, _add(_sub(x, _sub(rx, v)), _sub(y, v))


def _dfadd2_f2_f(x, y):
    rx = _add(x[0], y)
    v = _sub(rx, x[0])
    ry = _add(_sub(x[0], _sub(rx, v)), _sub(y, v))
    return rx, _add(ry, x[1])


def _dfadd2_f2_f2(x, y):
    rx = _add(x[0], y[0])
    v = _sub(rx, x[0])
    ry = _add(_sub(x[0], _sub(rx, v)), _sub(y[0], v))
    return rx, _add(ry, _add(x[1], y[1]))


def _dfadd_f2_f2(x, y):  # |x| >= |y|
    rx = _add(x[0], y[0])
    return rx, _add(_add(_add(_sub(x[0], rx), y[0]), x[1]), y[1])


def _dfadd_f_f2(x, y):
    rx = _add(x, y[0])
    return rx, _add(_add(_sub(x, rx), y[0]), y[1])


def _dfnormalize(t):
    sx = _add(t[0], t[1])
    return sx, _add(_sub(t[0], sx), t[1])


def _dfscale(d, s):
    return _mul(d[0], s), _mul(d[1], s)


def _dfmul_f2_f(x, y):
    rx = _mul(x[0], y)
    return rx, _fma32(x[1], y, _fma32(x[0], y, -rx))


def _dfmul_f2_f2(x, y):
    rx = _mul(x[0], y[0])
    return rx, _fma32(x[0], y[1], _fma32(x[1], y[0], _fma32(x[0], y[0], -rx)))


def _dfsqu(x):
    rx = _mul(x[0], x[0])
    return rx, _fma32(_add(x[0], x[0]), x[1], _fma32(x[0], x[0], -rx))


def _dfdiv(n, d):
    t = (F32(1) / d[0]).astype(F32)
    qx = _mul(n[0], t)
    u = _fma32(t, n[0], -qx)
    qy = _fma32(-d[1], t, _fma32(-d[0], t, F32(1)))
    return qx, _fma32(qx, qy, _fma32(n[1], t, u))


def _getexp(x):
    """AVX-512 getexp of positive normal float32: floor(log2 x) as float."""
    return (((x.view(np.uint32) >> np.uint32(23)) & np.uint32(0xFF)).astype(np.int32) - 127).astype(F32)


def _getmant(x):
    """AVX-512 getmant, interval [0.75, 1.5), of positive normal float32."""
    b = x.view(np.uint32)
    mant = b & np.uint32(0x7FFFFF)
    big = mant >= np.uint32(0x400000)  # 1.f >= 1.5: halve
    return ((mant | np.where(big, np.uint32(126 << 23), np.uint32(127 << 23))).astype(np.uint32)).view(F32)


def _vldexp(x, q):
    """SLEEF's vldexp_vf_vf_vi2: x * 2^q as four multiplies by 2^m and one by 2^q' (float32,
    so a subnormal result rounds where SLEEF's last multiply rounds)."""
    q = q.astype(np.int32)
    m = q >> 31
    m = (((m + q) >> 6) - m) << 4
    q = q - (m << 2)
    m = m + 0x7F
    m = np.where(m > 0, m, 0)
    m = np.where(m > 0xFF, 0xFF, m)
    u = (m.astype(np.uint32) << np.uint32(23)).view(F32)
    x = _mul(_mul(_mul(_mul(x, u), u), u), u)
    u = ((q + 0x7F).astype(np.uint32) << np.uint32(23)).view(F32)
    return _mul(x, u)


def _logkf(d):
    e = _getexp(_mul(d, F32(1.0 / 0.75)))
    m = _getmant(d)
    x = _dfdiv(_dfadd2_f_f(F32(-1), m), _dfadd2_f_f(F32(1), m))
    x2 = _dfsqu(x)
    t = np.full_like(d, F32(0.240320354700088500976562))
    t = _fma32(t, x2[0], F32(0.285112679004669189453125))
    t = _fma32(t, x2[0], F32(0.400007992982864379882812))
    c = (F32(0.66666662693023681640625), F32(3.69183861259614332084311e-09))
    s = _dfmul_f2_f((F32(0.69314718246459960938), F32(-1.904654323148236017e-09)), e)
    s = _dfadd_f2_f2(s, _dfscale(x, F32(2)))
    return _dfadd_f2_f2(s, _dfmul_f2_f2(_dfmul_f2_f2(x2, x), _dfadd2_f2_f2(_dfmul_f2_f(x2, t), c)))


def _expkf(d):
    u = _mul(_add(d[0], d[1]), _R_LN2)
    q = np.rint(u).astype(np.int32)  # cvtps2dq: nearest, ties to even
    qf = q.astype(F32)
    s = _dfadd2_f2_f(d, _mul(qf, -_L2U))
    s = _dfadd2_f2_f(s, _mul(qf, -_L2L))
    s = _dfnormalize(s)
    u = np.full_like(s[0], F32(0.00136324646882712841033936))
    for c in (0.00836596917361021041870117, 0.0416710823774337768554688, 0.166665524244308471679688,
              0.499999850988388061523438):
        u = _fma32(u, s[0], F32(c))
    t = _dfadd_f2_f2(s, _dfmul_f2_f(_dfsqu(s), u))
    t = _dfadd_f_f2(F32(1), t)
    u = _add(t[0], t[1])
    u = _vldexp(u, q)
    return np.where(d[0] < F32(-104), F32(0), u).astype(F32)


def powf_u10(x, y) -> np.ndarray:
    """SLEEF ``xpowf`` for x > 0 finite normal, y finite (what the RoPE frequencies need);
    other inputs raise (their special-value selects are not transcribed)."""
    x, y = np.broadcast_arrays(np.asarray(x, F32), np.asarray(y, F32))
    bx = x.view(np.uint32)
    if not (np.all((bx >= 0x00800000) & (bx < 0x7F800000)) and np.all(np.isfinite(y))):
        raise ValueError("sleef_powf.powf_u10 covers positive normal finite x and finite y only; "
                         f"got x in [{x.min()}, {x.max()}], y in [{y.min()}, {y.max()}]")
    with np.errstate(all="ignore"):
        r = _expkf(_dfmul_f2_f(_logkf(x), y))
    r = np.where(np.isnan(r), F32(np.inf), r)
    return np.where((y == 0) | (x == 1), F32(1), r).astype(F32)


def rope_pow(base: float, exps: np.ndarray) -> np.ndarray:
    """torch's ``base ** exps`` for a contiguous float32 vector on the oracle's AVX-512 CPU:
    SLEEF on the first 32 * floor(n / 32) elements, glibc powf on the rest (`torch_loops`)."""
    exps = np.asarray(exps, F32)
    n_body = (exps.size // TORCH_AVX512_STEP) * TORCH_AVX512_STEP
    out = powf(F32(base), exps)
    if n_body:
        out[:n_body] = powf_u10(F32(base), exps[:n_body])
    return out
