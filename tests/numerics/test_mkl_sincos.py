"""`numerics.mkl_sincos` reproduces torch 2.14.1's CPU float32 ``Tensor.cos()``/``sin()`` (MKL VML, EXHA
kernels, on the oracle's AVX-512 host) bit for bit; the vision tower's 2-D RoPE table takes them.

Default suite: inputs where that CPU's torch differs from glibc and from the correctly rounded value
(recorded from torch, 2026-12-04), and the table of the released tower on a 12 x 18 grid, where the
old correctly rounded table flipped q/k values (docs/NUMERICS.md, "vision_wide"). Slow: torch itself
on 2 x 10^6 inputs (skipped without torch, and on a CPU whose torch disagrees with the recorded pairs).
"""
import numpy as np
import pytest

from dsv41_jax.numerics import libm_sincos
from dsv41_jax.numerics.mkl_sincos import MAIN_LIMIT, cosf_mkl, sinf_mkl

# (input bits, torch bits on the oracle's CPU), each differing from glibc and the correctly rounded float32
COS_PAIRS = [
    (0x41b76511, 0xbf186353), (0x419898c1, 0x3f798ba8), (0x42d9baa3, 0xbeec3d4a), (0x424d094f, 0x3f0bb107),
    (0x41fe26f8, 0x3f7034bf), (0xc24dc1d8, 0x3ec5f4cf), (0x4278165c, 0x3f308220), (0x419fccbc, 0x3edc9270),
    (0x42a54430, 0x3f148ac9), (0x4205dc55, 0xbeebb97b), (0x45ec4c43, 0xbf75f92e), (0x45aaf47c, 0xbeffc2c3),
    (0x46023f2a, 0xbed3268a), (0x458ab751, 0xbf7ce582), (0x44164d02, 0xbecce857), (0xc51dbe0b, 0xbec39bd3),
]
SIN_PAIRS = [
    (0x418cbfaa, 0xbf736aeb), (0x42299a0e, 0xbf7ffbff), (0x41d529d0, 0x3f7f9156), (0x42e3d68a, 0x3f3b77b0),
    (0x42e62921, 0x3f6a8ede), (0xc288559f, 0x3f4fe85f), (0x42ba2a8b, 0xbf6b2da3), (0x421c3076, 0x3f79af43),
    (0x413b9759, 0xbf3ef4d9), (0x3fd528c2, 0x3f7edb87), (0xbfa9a2a0, 0xbf7852a2), (0x4602fc26, 0x3f7458c4),
    (0x44683e64, 0xbf4e3750), (0x45f1e217, 0xbf15622f), (0xc5f4996b, 0x3f7eb301), (0xc39a30cc, 0xbef7c64e),
]


def bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("fn, glibc, f64, pairs", [(cosf_mkl, libm_sincos.cosf, np.cos, COS_PAIRS),
                                                   (sinf_mkl, libm_sincos.sinf, np.sin, SIN_PAIRS)],
                         ids=["cos", "sin"])
def test_recorded_torch_pairs_and_the_others_differ(fn, glibc, f64, pairs):
    x = np.array([p[0] for p in pairs], np.uint32).view(np.float32)
    want = np.array([p[1] for p in pairs], np.uint32)
    np.testing.assert_array_equal(bits(fn(x)), want)
    for other in (glibc(x), f64(x.astype(np.float64)).astype(np.float32)):  # the pairs tell them apart
        assert np.all(bits(other) != want)


def test_signs_zeros_and_the_rare_range():
    assert bits(sinf_mkl(np.float32(-0.0))) == bits(np.float32(-0.0)) and cosf_mkl(np.float32(0.0)) == 1.0
    x = np.float32([1.25, 40.5, 3000.0])
    np.testing.assert_array_equal(bits(sinf_mkl(-x)), bits(-sinf_mkl(x)))  # sin is odd, cos even, bit for bit
    np.testing.assert_array_equal(bits(cosf_mkl(-x)), bits(cosf_mkl(x)))
    big = np.float32([MAIN_LIMIT * 2, -1e30])  # outside MKL's main path: glibc's values, documented
    np.testing.assert_array_equal(bits(cosf_mkl(big)), bits(libm_sincos.cosf(big)))
    assert np.isnan(cosf_mkl(np.float32([np.nan, np.inf]))).all()


def test_the_released_towers_table_on_a_12_by_18_grid():
    from dsv41_jax.config import ModelConfig
    from dsv41_jax.vision.tower import rope_2d
    cfg = ModelConfig.v41_flash()
    head_dim = cfg.vision_dim // cfg.vision_n_heads
    cos, sin = (np.asarray(t) for t in rope_2d(12, 18, head_dim, cfg.vision_rope_theta))
    assert cos.shape == (216, head_dim // 2)
    # patch (1, 0): angle 1.0 in the first column; torch's cos(1.0f) is 0x3f0a5141, one ulp above the
    # correctly rounded 0x3f0a5140 (the table's first flip, found with the traced vision_wide run)
    assert bits(cos[18, 0]) == 0x3F0A5141 and bits(np.cos(np.float64(1.0)).astype(np.float32)) == 0x3F0A5140


@pytest.mark.slow
def test_equals_torch():
    torch = pytest.importorskip("torch", reason="the torch sweep needs torch (the oracle venv has it)")
    x = np.array([p[0] for p in COS_PAIRS], np.uint32).view(np.float32)
    if not np.array_equal(bits(torch.from_numpy(x).cos().numpy()), [p[1] for p in COS_PAIRS]):
        pytest.skip("this CPU's torch.cos is not the oracle's (another MKL kernel)")
    rng = np.random.default_rng(5)
    for lo, hi in ((-125, 125), (-2, 2), (-10000, 10000)):
        a = rng.uniform(lo, hi, 500_000).astype(np.float32)
        t = torch.from_numpy(a)
        np.testing.assert_array_equal(bits(cosf_mkl(a)), bits(t.cos().numpy()))
        np.testing.assert_array_equal(bits(sinf_mkl(a)), bits(t.sin().numpy()))
