"""float32 cos/sin with the rounding of torch's CPU ``Tensor.cos()``/``sin()`` on the oracle's machine: MKL VML.

``torch.cos``/``torch.sin`` of a float32 CPU tensor call MKL's ``vmsCos``/``vmsSin`` for every element
(gdb: ``at::native::AVX2::cos_kernel`` -> ``vmsCos``), and MKL 2024.2 inside torch 2.14.1 runs
``mkl_vml_kernel_sCos_EXHAynn``/``sSin_EXHAynn`` (read with objdump). The vision tower's 2-D RoPE
table is ``freqs.cos()``/``freqs.sin()`` of a [patches, head_dim / 2] tensor, so its values are MKL's,
which are not correctly rounded: a float64 cos rounded to float32 differs on ~8 % of the released
tower's table, and some flips survive the bf16 rounding of the rotated q/k (docs/NUMERICS.md,
"vision_wide").

Main path (|x| <= 10000), SSE, no fused multiply-adds, each step rounded:

    x = |a|                                          (float32)
    t = x * 1/pi + 1.5 * 2^23                        (sin; cos: (x + pi/2) * 1/pi + 1.5 * 2^23)
    n = t - 1.5 * 2^23                               (sin: k = round(x / pi); cos: then - 0.5)
    r = (x - n * P1) - n * P2                        (float64; P1 = 0x400921fb54440000, P2 = pi - P1)
    s = r + r * ((((A r^2 + B) r^2 + C) r^2 + D) r^2)  (float64, the binary's coefficients)
    result = float32(s), negated when k is odd (sin: and when a < 0)

The constants are the binary's (``_VAPI_COMMON_DATA_NAME + 0xc00..0xc50``, ``__internal_CoutTab +
0x380``); float32 1/pi is 0x3ea2f983 and pi/2 0x3fc90fdb. Above 10000 (and inf, NaN) MKL takes a
Payne-Hanek path (``vscos_cout_rare``'s neighbourhood) that is not transcribed: this module uses glibc's
``cosf``/``sinf`` there (`libm_sincos`), which a table of RoPE angles never reaches. Checked against
torch 2.14.1 in tests/numerics/test_mkl_sincos.py.
"""
from __future__ import annotations

import numpy as np

from dsv41_jax.numerics import libm_sincos

F32, F64 = np.float32, np.float64
MAIN_LIMIT = F32(10000.0)
_INV_PI = np.uint32(0x3EA2F983).view(F32)
_HALF_PI = np.uint32(0x3FC90FDB).view(F32)
_SHIFTER = F32(12582912.0)  # 1.5 * 2^23: adding it rounds to an integer held in the low mantissa bits
_P1 = np.uint64(0x400921FB54440000).view(F64)
_P2 = np.uint64(0x3D968C234C4C6629).view(F64)
_POLY = [np.uint64(b).view(F64) for b in (0x3EC5DBDF0E4C7DEE, 0xBF29F6FFEEA73463, 0x3F8110ED3804CA96,
                                          0xBFC55554BC836587)]


def _main_path(a: np.ndarray, want_cos: bool) -> np.ndarray:
    x = np.abs(a)
    t = ((x + _HALF_PI).astype(F32) if want_cos else x) * _INV_PI
    t = (t.astype(F32) + _SHIFTER).astype(F32)
    n = (t - _SHIFTER).astype(F32)
    if want_cos:
        n = (n - F32(0.5)).astype(F32)
    nd = n.astype(F64)
    r = (x.astype(F64) - nd * _P1) - nd * _P2
    r2 = r * r
    p = _POLY[0] * r2
    for c in _POLY[1:]:
        p = (p + c) * r2
    s = (p * r + r).astype(F32)
    negate = (t.view(np.uint32) & np.uint32(1)) == 1
    if not want_cos:
        negate ^= np.signbit(a)
    return np.where(negate, -s, s).astype(F32)


def _eval(a, want_cos: bool) -> np.ndarray:
    a = np.asarray(a, F32)
    with np.errstate(invalid="ignore", over="ignore"):
        main = _main_path(a, want_cos)
    rare = ~(np.abs(a) <= MAIN_LIMIT)
    if rare.any():
        main = np.where(rare, libm_sincos.cosf(a) if want_cos else libm_sincos.sinf(a), main)
    return main.astype(F32)


def cosf_mkl(a) -> np.ndarray:
    """torch.cos of a float32 CPU tensor on the oracle's machine (MKL VML EXHA), elementwise."""
    return _eval(a, True)


def sinf_mkl(a) -> np.ndarray:
    """torch.sin of a float32 CPU tensor on the oracle's machine (MKL VML EXHA), elementwise."""
    return _eval(a, False)
