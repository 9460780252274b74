"""float32 pow with the rounding of glibc's ``powf``, computed the same way on every host.

The reference's RoPE frequencies are ``base ** exps`` in float32, which torch's CPU kernel hands
to glibc ``powf`` on its scalar path (docs/NUMERICS.md, "RoPE tables"). numpy's float32
``np.power`` is not a stand-in: on an AVX-512 host numpy 2.x runs its own SIMD pow (4 of the 16
YaRN frequency powers at theta 160000 differ from glibc, measured on numpy 2.4.6 with
``AVX512_ICL``), elsewhere it calls the C library. glibc's ``powf`` is not correctly rounded
(0.82 ulp), so no correctly rounded float64 formula reproduces it either: this is a
transcription of its algorithm (glibc 2.28+ ``sysdeps/ieee754/flt-32/e_powf.c``,
``e_powf_log2_data.c``, ``e_exp2f_data.c``, the same code as Arm's optimized-routines and musl):

  * log2(x) in double: x = 2^k z with z in [0x3f330000, 2 * 0x3f330000), a 16-entry table of
    1/c and log2(c) around z, and a degree-5 polynomial in r = z/c - 1;
  * y * log2(x) in double, overflow/underflow limits;
  * 2^(y log2 x) in double: a 32-entry table of 2^(i/32) and a degree-3 polynomial;
  * one rounding to float32.

x86-64 glibc selects its FMA build (``e_powf-fma.c``) on AVX2/AVX-512 CPUs, where GCC contracts
each ``a * b + c`` into a fused multiply-add; `fma` below is an exactly rounded FMA in plain
float64 numpy, so the result does not depend on numpy's CPU dispatch (float64 multiply, add and
nextafter are IEEE operations on every path). x86-64 glibc is built without TOINT_INTRINSICS, so
the unscaled table variant applies. Checked against the C library in tests/numerics/test_libm_powf.py.
"""
from __future__ import annotations

import numpy as np

from dsv41_jax.numerics.glibc_expf import EXP2_TABLE

_SPLIT = 134217729.0  # 2^27 + 1 (Veltkamp)


def two_sum(a, b):
    """a + b = s + t exactly (Knuth)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _two_prod(a, b):
    """a * b = p + e exactly (Dekker; |a|, |b| < 2^995 and no underflow)."""
    p = a * b
    ca, cb = _SPLIT * a, _SPLIT * b
    ah, bh = ca - (ca - a), cb - (cb - b)
    al, bl = a - ah, b - bh
    return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


def fma(a, b, c):
    """float64 a * b + c with one rounding, elementwise.

    Boldo and Melquiond, "Emulation of FMA and correctly rounded sums: proved algorithms using
    rounding to odd", IEEE Trans. Computers 57(4), 2008, Algorithm 5: a*b = uh + ul exactly,
    c + uh = th + tl exactly, v = tl + ul rounded to odd, result = th + v rounded to nearest.
    Valid without overflow or underflow in the intermediate terms (powf's are all O(1)..2^8)."""
    a, b, c = (np.asarray(v, np.float64) for v in (a, b, c))
    uh, ul = _two_prod(a, b)
    th, tl = two_sum(c, uh)
    v, err = two_sum(tl, ul)
    # round to odd: an inexact sum whose nearest result is even moves to its odd neighbour
    # on the side of the exact value
    even = (v.view(np.int64) & 1) == 0
    v = np.where((err != 0) & even, np.nextafter(v, np.where(err > 0, np.inf, -np.inf)), v)
    return th + v


_LOG2_OFF = 0x3F330000
# (1/c, log2 c) for the 16 subintervals of [OFF, 2 OFF); powf_log2_data, POWF_SCALE = 1
_LOG2_TAB = np.array([[float.fromhex(a), float.fromhex(b)] for a, b in (
    ("0x1.661ec79f8f3bep+0", "-0x1.efec65b963019p-2"), ("0x1.571ed4aaf883dp+0", "-0x1.b0b6832d4fca4p-2"),
    ("0x1.49539f0f010bp+0", "-0x1.7418b0a1fb77bp-2"), ("0x1.3c995b0b80385p+0", "-0x1.39de91a6dcf7bp-2"),
    ("0x1.30d190c8864a5p+0", "-0x1.01d9bf3f2b631p-2"), ("0x1.25e227b0b8eap+0", "-0x1.97c1d1b3b7afp-3"),
    ("0x1.1bb4a4a1a343fp+0", "-0x1.2f9e393af3c9fp-3"), ("0x1.12358f08ae5bap+0", "-0x1.960cbbf788d5cp-4"),
    ("0x1.0953f419900a7p+0", "-0x1.a6f9db6475fcep-5"), ("0x1p+0", "0x0p+0"),
    ("0x1.e608cfd9a47acp-1", "0x1.338ca9f24f53dp-4"), ("0x1.ca4b31f026aap-1", "0x1.476a9543891bap-3"),
    ("0x1.b2036576afce6p-1", "0x1.e840b4ac4e4d2p-3"), ("0x1.9c2d163a1aa2dp-1", "0x1.40645f0c6651cp-2"),
    ("0x1.886e6037841edp-1", "0x1.88e9c2c1b9ff8p-2"), ("0x1.767dcf5534862p-1", "0x1.ce0a44eb17bccp-2"),
)])
_LOG2_POLY = [float.fromhex(h) for h in ("0x1.27616c9496e0bp-2", "-0x1.71969a075c67ap-2", "0x1.ec70a6ca7baddp-2",
                                         "-0x1.7154748bef6c8p-1", "0x1.71547652ab82bp0")]
# exp2f_data: tab[i] = bits(2^(i/32)) - (i << 47); the same table glibc's expf uses, so it is shared with it
_EXP2_TAB = EXP2_TABLE
_EXP2_POLY = [float.fromhex(h) for h in ("0x1.c6af84b912394p-5", "0x1.ebfce50fac4f3p-3", "0x1.62e42ff0c52d6p-1")]
_EXP2_SHIFT = float.fromhex("0x1.8p+52") / 32  # shift_scaled
_SIGN_BIAS = np.uint64(1 << 16)  # 1 << (EXP2F_TABLE_BITS + 11): lands on bit 63 after << 47
_OFLOW = float.fromhex("0x1.fffffffd1d571p+6")


def _log2_inline(ix: np.ndarray) -> np.ndarray:
    """log2 of the positive float32 with bits `ix` (uint32; subnormals pre-normalised) in double."""
    tmp = ix - np.uint32(_LOG2_OFF)
    i = ((tmp >> np.uint32(19)) % np.uint32(16)).astype(np.int64)
    top = tmp & np.uint32(0xFF800000)
    iz = ix - top
    k = top.view(np.int32) >> np.int32(23)  # arithmetic shift
    invc, logc = _LOG2_TAB[i, 0], _LOG2_TAB[i, 1]
    z = iz.view(np.float32).astype(np.float64)
    a0, a1, a2, a3, a4 = _LOG2_POLY
    r = fma(z, invc, -1.0)
    y0 = logc + k.astype(np.float64)
    r2 = r * r
    y = fma(a0, r, a1)
    p = fma(a2, r, a3)
    r4 = r2 * r2
    q = fma(a4, r, y0)
    q = fma(p, r2, q)
    return fma(y, r4, q)


def _exp2_inline(xd: np.ndarray, sign_bias: np.ndarray) -> np.ndarray:
    """2^xd rounded to float32, |xd| < 150, sign from `sign_bias`."""
    kd = xd + _EXP2_SHIFT
    ki = kd.view(np.uint64)
    kd = kd - _EXP2_SHIFT
    r = xd - kd
    t = _EXP2_TAB[(ki % np.uint64(32)).astype(np.int64)]
    t = t + ((ki + sign_bias) << np.uint64(47))  # uint64 wrap-around, as in C
    s = t.view(np.float64)
    c0, c1, c2 = _EXP2_POLY
    z = fma(c0, r, c1)
    r2 = r * r
    y = fma(c2, r, 1.0)
    y = fma(z, r2, y)
    return (y * s).astype(np.float32)


def _checkint(iy: np.ndarray) -> np.ndarray:
    """0: y not an integer, 1: odd integer, 2: even integer (iy: bits of a finite nonzero y)."""
    e = ((iy >> np.uint32(23)) & np.uint32(0xFF)).astype(np.int64)
    sh = np.clip(0x7F + 23 - e, 0, 31).astype(np.uint32)
    frac = (iy & ((np.uint32(1) << sh) - np.uint32(1))) != 0
    odd = (iy & (np.uint32(1) << sh)) != 0
    return np.where(e < 0x7F, 0, np.where(e > 0x7F + 23, 2, np.where(frac, 0, np.where(odd, 1, 2))))


def powf(x, y) -> np.ndarray:
    """glibc ``powf(x, y)`` elementwise on float32 (broadcast), float32 result."""
    x, y = np.broadcast_arrays(np.asarray(x, np.float32), np.asarray(y, np.float32))
    shape = x.shape
    with np.errstate(all="ignore"):  # lanes of the branches not taken
        out = _powf(np.ascontiguousarray(x).reshape(-1), np.ascontiguousarray(y).reshape(-1))
    return out.reshape(shape)


def _powf(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    f32 = np.float32
    ix, iy = x.view(np.uint32).copy(), y.view(np.uint32)
    ax, ay = ix & np.uint32(0x7FFFFFFF), iy & np.uint32(0x7FFFFFFF)
    y_zeroinfnan = (ay == 0) | (ay >= 0x7F800000)
    x_zeroinfnan = (ax == 0) | (ax >= 0x7F800000)
    yint = _checkint(iy)

    # y is 0, inf or nan
    x_is_one = ix == 0x3F800000
    any_nan = (ax > 0x7F800000) | (ay > 0x7F800000)
    small_x = ax < 0x3F800000
    y_pos = (iy & np.uint32(0x80000000)) == 0
    r_y = np.where(ay == 0, f32(1), np.where(x_is_one, f32(1), np.where(
        any_nan, x + y, np.where(ax == 0x3F800000, f32(1), np.where(small_x == y_pos, f32(0), y * y)))))

    # x is 0, inf or nan (y finite nonzero)
    x2 = x * x
    x2 = np.where(((ix & np.uint32(0x80000000)) != 0) & (yint == 1), -x2, x2)
    r_x = np.where(y_pos, x2, f32(1) / x2)

    # x, y finite nonzero
    neg = (ix & np.uint32(0x80000000)) != 0
    invalid = neg & (yint == 0)
    sign_bias = np.where(neg & (yint == 1), _SIGN_BIAS, np.uint64(0))
    sub = ax < 0x00800000
    ixn = np.where(sub, ((ax.view(f32) * f32(2.0 ** 23)).view(np.uint32) & np.uint32(0x7FFFFFFF))
                   - np.uint32(23 << 23), ax)
    ixn = np.where(x_zeroinfnan, np.uint32(0x3F800000), ixn)  # keep other lanes in range
    ylogx = y.astype(np.float64) * _log2_inline(ixn)
    ylogx = np.where(np.isfinite(ylogx), ylogx, 0.0)
    core = _exp2_inline(np.clip(ylogx, -151.0, 129.0), sign_bias)
    negative = sign_bias != 0
    core = np.where(ylogx > _OFLOW, np.where(negative, f32(-np.inf), f32(np.inf)), core)
    core = np.where(ylogx <= -150.0, np.where(negative, f32(-0.0), f32(0.0)), core)
    core = np.where(invalid, f32(np.nan), core)

    return np.where(y_zeroinfnan, r_y, np.where(x_zeroinfnan, r_x, core)).astype(f32)
