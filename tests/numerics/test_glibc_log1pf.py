"""`numerics.glibc_log1pf` equals the C library's `log1pf` (glibc <= 2.40, the fdlibm algorithm)
bit for bit; against torch's scalar softplus/log1p path see tests/numerics/test_torch_elementwise.py (slow)."""
import ctypes
import ctypes.util
import sys

import jax
import numpy as np
import pytest

from dsv41_jax.numerics.glibc_log1pf import log1pf_glibc

EDGES = np.array([0, -0.0, -1, -1.0000001, -0.99999994, np.inf, -np.inf, np.nan, 1e-30, -1e-30, 2.0 ** -20,
                  2.0 ** -29, 2.0 ** -30, 2.0 ** -54, 2.0 ** -55, 0.41421, 0.41422, 0.41423, -0.2929, -0.29289,
                  -0.29291, 9.007199e15, 9.0072e15, 1.8650653e8, 3e38, 5e8], np.float32)


def _glibc_log1pf():
    name = ctypes.util.find_library("m")
    if not sys.platform.startswith("linux") or name is None or not hasattr(ctypes.CDLL(None), "gnu_get_libc_version"):
        pytest.skip("needs glibc's libm (Linux)")
    libc = ctypes.CDLL(None)
    libc.gnu_get_libc_version.restype = ctypes.c_char_p
    major, minor = (int(v) for v in libc.gnu_get_libc_version().decode().split(".")[:2])
    if (major, minor) >= (2, 41):
        pytest.skip("glibc >= 2.41 replaced log1pf with CORE-MATH's correctly rounded one")
    lib = ctypes.CDLL(name)
    lib.log1pf.restype, lib.log1pf.argtypes = ctypes.c_float, [ctypes.c_float]
    return lib


def _compare(lib, x):
    ref = np.array([lib.log1pf(v) for v in x.tolist()], np.float32)
    with jax.enable_x64(True):
        got = np.asarray(jax.jit(log1pf_glibc)(x))
    bad = (got.view(np.uint32) != ref.view(np.uint32)) & ~(np.isnan(got) & np.isnan(ref))
    assert not bad.any(), f"{int(bad.sum())} of {x.size} differ, e.g. x = {x[bad][:5]}"


def _cases(rng, n):
    """Every bit pattern class (random words), magnitudes 1e-13..1e13, and (-1, 1) densely."""
    return np.concatenate([EDGES, rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32),
                           np.exp(rng.uniform(-30, 30, n)).astype(np.float32), rng.uniform(-1, 1, n).astype(np.float32)])


def test_log1pf_equals_glibc():
    _compare(_glibc_log1pf(), _cases(np.random.default_rng(1), 40_000))


@pytest.mark.slow
def test_log1pf_equals_glibc_on_ten_million_inputs():
    lib = _glibc_log1pf()
    rng = np.random.default_rng(41)
    total = 0
    for _ in range(5):
        x = _cases(rng, 700_000)
        _compare(lib, x)
        total += x.size
    assert total >= 10_000_000
