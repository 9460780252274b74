"""`numerics.libm_powf` equals the C library's float32 `powf` bit for bit (glibc, FMA build: every
AVX2/AVX-512 x86-64 host), and its exactly rounded `fma` equals the C library's `fma`.

The oracle is glibc itself through ctypes (one call per element), never numpy's `np.power`, whose
float32 path on AVX-512 hosts is numpy's own SIMD code (docs/NUMERICS.md, "RoPE tables")."""
import ctypes
import ctypes.util
import sys

import numpy as np
import pytest

from dsv41_jax.numerics import libm_powf


def _glibc():
    name = ctypes.util.find_library("m")
    if not sys.platform.startswith("linux") or name is None or not hasattr(ctypes.CDLL(None), "gnu_get_libc_version"):
        pytest.skip("needs glibc's libm (Linux)")
    lib = ctypes.CDLL(name)
    lib.powf.restype, lib.powf.argtypes = ctypes.c_float, [ctypes.c_float, ctypes.c_float]
    lib.fma.restype, lib.fma.argtypes = ctypes.c_double, [ctypes.c_double] * 3
    return lib


def _cases(rng, n):
    """Random bit patterns (every class: subnormal, negative, huge), the RoPE shape (a theta to
    exponents in [0, 1)), moderate bases and exponents, and every pairing of special values."""
    bits = lambda: rng.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32).view(np.float32)
    f = np.float32
    sp = np.array([0, -0.0, 1, -1, np.inf, -np.inf, np.nan, 2, -2, 0.5, -0.5, 1e-40, -1e-40, 3, -3, 1e30, -1e30,
                   127.99, -150.0, 1.0000001], f)
    gx, gy = np.meshgrid(sp, sp)
    thetas = np.repeat(np.array([1e4, 2e4, 4e4, 1.6e5, 5e5, 1e6], f), 512)
    exps = np.tile(np.arange(0, 1024, 2, dtype=f) / f(1024), 6)
    x = np.concatenate([bits(), (rng.random(n) * 4).astype(f), (rng.random(n) * 1e6).astype(f), thetas, gx.ravel()])
    y = np.concatenate([bits(), ((rng.random(n) - 0.5) * 60).astype(f), ((rng.random(n) - 0.5) * 4).astype(f),
                        exps, gy.ravel()])
    return x, y


def _compare(lib, x, y):
    ref = np.array([lib.powf(a, b) for a, b in zip(x.tolist(), y.tolist())], np.float32)
    got = libm_powf.powf(x, y)
    bad = (got.view(np.uint32) != ref.view(np.uint32)) & ~(np.isnan(got) & np.isnan(ref))
    first = [(float(x[i]), float(y[i]), float(got[i]), float(ref[i])) for i in np.flatnonzero(bad)[:5]]
    assert not bad.any(), f"{int(bad.sum())} of {x.size} differ from glibc powf, e.g. (x, y, ours, glibc) {first}"


def test_powf_equals_glibc():
    _compare(_glibc(), *_cases(np.random.default_rng(28), 50_000))


def test_fma_is_exactly_rounded():
    lib = _glibc()
    rng = np.random.default_rng(5)
    n = 100_000
    a = rng.standard_normal(n) * 2.0 ** rng.integers(-30, 30, n)
    b = rng.standard_normal(n) * 2.0 ** rng.integers(-30, 30, n)
    c = np.concatenate([-(a * b)[: n // 2], rng.standard_normal(n - n // 2)])  # cancellation and ties
    c[::7] = np.nextafter(-(a * b), 0)[::7]
    ref = np.array([lib.fma(p, q, r) for p, q, r in zip(a.tolist(), b.tolist(), c.tolist())])
    np.testing.assert_array_equal(libm_powf.fma(a, b, c).view(np.int64), ref.view(np.int64))


@pytest.mark.slow
def test_powf_equals_glibc_on_ten_million_inputs():
    lib = _glibc()
    rng = np.random.default_rng(2814)
    total = 0
    for _ in range(4):
        x, y = _cases(rng, 850_000)
        _compare(lib, x, y)
        total += x.size
    assert total >= 10_000_000, total
