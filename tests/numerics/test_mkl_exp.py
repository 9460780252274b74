"""`numerics.mkl_exp` reproduces torch 2.14.1's CPU float32 ``torch.exp`` (MKL VML, EXHA kernel, on the
oracle-class AMD EPYC host) bit for bit; the golden oracle's sparse attention takes its exps there.

Default suite: inputs where that CPU's torch.exp differs from SLEEF expf_u10, glibc expf and the
correctly rounded value (recorded from torch.exp, 2026-12-02), edge values, and 10^5 inputs
against the numpy transcription (tests/support/mkl_exp_reference.py). Slow: torch itself on 10^7 inputs
and every call length 1..130 (MKL walks 16 lanes at a time, then a remainder); skipped without
torch and on a CPU whose torch.exp disagrees with the recorded pairs (another MKL kernel: not the
oracle).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.numerics.glibc_expf import expf_glibc
from dsv41_jax.numerics.mkl_exp import exp2_table, expf_mkl
from dsv41_jax.numerics.sleef_exp import expf_u10
from tests.support.mkl_exp_reference import mkl_expf_reference

# (input bits, torch.exp bits on the oracle-class CPU), each differing from SLEEF, glibc and the
# correctly rounded float32
PAIRS = [
    (0xc2a77b24, 0x0311d051), (0xc2a3bebe, 0x046c0a3f), (0xc286c734, 0x0edb81dd), (0xc25feb9b, 0x1716f019),
    (0xc241d01e, 0x1c88e0e3), (0xc1625ecc, 0x35407a24), (0xc159c342, 0x35a4cfcb), (0xc1578880, 0x35bd7457),
    (0xc13139aa, 0x3781c690), (0xc1022aee, 0x3999982d), (0xc0f1ac39, 0x3a099a7b), (0xc039e307, 0x3d605e09),
    (0xc0179fd9, 0x3dbf9d6b), (0xbd3d99d9, 0x3f746b86), (0x41a676d4, 0x4e81c0e5), (0x41d3f364, 0x52955923),
    (0x420fbaef, 0x596514c7), (0x424cff2d, 0x64750dfd), (0x427c3ac0, 0x6cfb2d42), (0x4288e69f, 0x70d7bb79),
    (0x42911a7b, 0x73cba881), (0x429579d0, 0x75629a37), (0x42a84c76, 0x7c291c95), (0x42abe2da, 0x7d7e2b14),
]
EDGES = np.array([0.0, -0.0, np.inf, -np.inf, 87.33654, -87.33654, 88.72283, 88.7229, -103.97207, -103.9721,
                  -150.0, 1e-30, -1e-30, -5e-39, 0.5, -0.5], np.float32)


@pytest.fixture(autouse=True)
def _x64():
    with jax.enable_x64(True):
        yield


def bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def test_recorded_torch_pairs_and_the_others_differ():
    x = np.array([p[0] for p in PAIRS], np.uint32).view(np.float32)
    want = np.array([p[1] for p in PAIRS], np.uint32)
    np.testing.assert_array_equal(bits(jax.jit(expf_mkl)(jnp.asarray(x))), want)
    # the pairs could tell a wrong function apart: SLEEF, glibc and correct rounding miss every one
    for other in (expf_u10(jnp.asarray(x)), expf_glibc(jnp.asarray(x)), np.exp(x.astype(np.float64))):
        assert np.all(bits(other) != want)


def test_table_is_two_to_the_j_over_128_split():
    a, b = exp2_table()
    assert a[0] == 1.0 and b[0] == 0.0 and a.dtype == b.dtype == np.float32
    np.testing.assert_allclose(a.astype(np.float64) + b, 2.0 ** (np.arange(128) / 128), rtol=2.0 ** -46)
    assert np.all(np.abs(b) <= np.spacing(a) / 2)


def test_equals_the_numpy_transcription_and_edges():
    rng = np.random.default_rng(7)
    x = np.concatenate([rng.uniform(-20, 0, 60000), rng.uniform(-88, 88.7, 30000), rng.uniform(-110, -87, 10000),
                        EDGES]).astype(np.float32)
    got = np.asarray(jax.jit(expf_mkl)(jnp.asarray(x)))
    np.testing.assert_array_equal(bits(got), bits(mkl_expf_reference(x)))
    nan = np.asarray(expf_mkl(jnp.asarray([np.nan], jnp.float32)))
    assert np.isnan(nan).all()


@pytest.mark.slow
def test_equals_torch_exp():
    torch = pytest.importorskip("torch", reason="the torch sweep needs torch (the oracle venv has it)")
    x = np.array([p[0] for p in PAIRS], np.uint32).view(np.float32)
    if not np.array_equal(torch.exp(torch.from_numpy(x)).numpy().view(np.uint32), [p[1] for p in PAIRS]):
        pytest.skip("this CPU's torch.exp is not the oracle's (another MKL kernel)")
    rng = np.random.default_rng(11)
    f = jax.jit(expf_mkl)
    n_checked = 0
    for lo, hi in ((-20, 0), (-87.3, 87.3), (-1, 1), (-110, -87.3), (87.3, 88.8)):
        for _ in range(2):
            xs = rng.uniform(lo, hi, 1_000_000).astype(np.float32)
            want = torch.exp(torch.from_numpy(xs)).numpy()
            got = np.asarray(f(jnp.asarray(xs)))
            bad = bits(got) != bits(want)
            assert not bad.any(), (xs[bad][:5], got[bad][:5], want[bad][:5])
            n_checked += xs.size
    for n in range(1, 131):  # one call per length: no tail path
        xs = rng.uniform(-20, 0, n).astype(np.float32)
        np.testing.assert_array_equal(bits(f(jnp.asarray(xs))), bits(torch.exp(torch.from_numpy(xs)).numpy()))
    assert n_checked == 10_000_000
