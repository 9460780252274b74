"""numpy emulation of SLEEF's FMA expf_u10 (torch's CPU float exp), FMAs evaluated in float64."""
import numpy as np


def _fma64(a, b, c):
    return (np.asarray(a, np.float64) * np.asarray(b, np.float64) + c).astype(np.float32)


def sleef_expf_reference(d) -> np.ndarray:
    """SLEEF xexpf: Cody-Waite reduction, degree-6 Horner with FMA, scale by 2^q."""
    d = np.asarray(d, np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        q = np.rint(d * np.float32(1.4426950408889634)).astype(np.float32)
        q = np.where(np.isfinite(q), q, 0).astype(np.float32)
        s = _fma64(q, np.float32(-0.693145751953125), d)
        s = _fma64(q, np.float32(-1.428606765330187045e-06), s)
        u = np.full_like(d, np.float32(0.000198527617612853646278381))
        for c in (0.00139304355252534151077271, 0.00833336077630519866943359,
                  0.0416664853692054748535156, 0.166666671633720397949219, 0.5):
            u = _fma64(u, s, np.float32(c))
        u = np.float32(1.0) + _fma64((s * s).astype(np.float32), u, s)
        u = np.ldexp(u.astype(np.float64), q.astype(np.int32)).astype(np.float32)
    u = np.where(d < -104, np.float32(0), u)
    return np.where(d > 104, np.float32(np.inf), u).astype(np.float32)
