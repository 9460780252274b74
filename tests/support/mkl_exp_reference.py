"""numpy emulation of MKL's float32 exp (EXHA kernel, torch.exp on the oracle's CPU): numpy float32
arithmetic (one IEEE rounding per operation, never fused), the 2^(j/128) table from Python's
`fractions`-free decimal powers; outside |x| <= 87.3365 a float64 exp rounded once (numpy keeps
subnormals)."""
import decimal

import numpy as np

f32 = np.float32
_ctx = decimal.Context(prec=60)
_EXACT = [_ctx.power(decimal.Decimal(2), decimal.Decimal(j) / 128) for j in range(128)]
A = np.array([float(v) for v in _EXACT]).astype(f32)
B = np.array([float(v - decimal.Decimal(float(a))) for v, a in zip(_EXACT, A)]).astype(f32)
C0, C1, C2, C3, C4 = np.uint32([0x4338AA3B, 0x4B400000, 0xCB400000, 0x3BB18000, 0x35DE8083]).view(f32)


def mkl_expf_reference(x) -> np.ndarray:
    x = np.asarray(x, f32)
    with np.errstate(all="ignore"):
        t = f32(x * C0) + C1
        ti = np.asarray(t, f32).view(np.uint32)
        j = ti & 127
        n = t + C2
        r = (x - n * C3) + n * C4
        p = (r * r) * f32(0.5) + r
        y = (p * A[j] + B[j]) + A[j]
        scale = (((ti << np.uint32(16)) + np.uint32(0x3F800000)) & np.uint32(0x7F800000)).view(f32)
        main = (y * scale).astype(f32)
        rare = np.exp(x.astype(np.float64)).astype(f32)
    return np.where(np.abs(x) > np.uint32(0x42AEAC4F).view(f32), rare, main).astype(f32)
