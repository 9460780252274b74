"""dsv41_jax.numerics.gemm.linear against the golden FP8/FP4 GEMM vectors and float64 numpy references."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv41_jax.numerics import quant as Q
from dsv41_jax.numerics.gemm import linear
from tests.support.kernel_vectors import bits, kernel_vectors


@pytest.fixture(scope="module")
def vec(golden_root):
    return kernel_vectors(golden_root)


def _golden_case(vec, kind):
    p = f"{kind}_gemm."
    a = jnp.asarray(vec[p + "a_bf16"])
    if kind == "fp8":
        w = jnp.asarray(vec[p + "b_e4m3"].view(ml_dtypes.float8_e4m3fn))
    else:
        w = jnp.asarray(vec[p + "b_packed_e2m1"])
    return p, a, w, jnp.asarray(vec[p + "b_scale_e8m0"])


@pytest.mark.parametrize("kind", ["fp8", "fp4"])
def test_activation_quant_matches_golden(vec, kind):
    p, a, _, _ = _golden_case(vec, kind)
    q, s = Q.quant_fp8_act(a)
    np.testing.assert_array_equal(bits(q), vec[p + "a_q_e4m3"])
    np.testing.assert_array_equal(np.asarray(s), vec[p + "a_scale_e8m0"])


@pytest.mark.parametrize("kind", ["fp8", "fp4"])
@pytest.mark.parametrize("jit", [False, True])
def test_exact_mode_is_bit_exact(vec, kind, jit):
    p, a, w, s = _golden_case(vec, kind)
    fn = lambda x: linear(x, w, s, kind=kind, mode="exact")  # noqa: E731
    fn = jax.jit(fn) if jit else fn
    with jax.enable_x64(True):
        out_bf16 = fn(a)
        out_f32 = fn(a.astype(jnp.float32))
    assert out_bf16.dtype == jnp.bfloat16 and out_f32.dtype == jnp.float32
    np.testing.assert_array_equal(bits(out_bf16), bits(vec[p + "out_bf16"]))
    np.testing.assert_array_equal(bits(out_f32), bits(vec[p + "out_f32"]))


@pytest.mark.parametrize("kind", ["fp8", "fp4"])
def test_fast_mode_is_close(vec, kind):
    p, a, w, s = _golden_case(vec, kind)
    ref = vec[p + "out_f32"]
    out = np.asarray(linear(a.astype(jnp.float32), w, s, kind=kind))
    np.testing.assert_allclose(out, ref, rtol=0, atol=4e-6 * np.abs(ref).max())
    out_bf16 = np.asarray(linear(a, w, s, kind=kind)).astype(np.float32)
    np.testing.assert_allclose(out_bf16, ref, rtol=2.0**-8, atol=1e-6 * np.abs(ref).max())


def test_exact_mode_without_x64_is_a_clear_error(vec):
    _, a, w, s = _golden_case(vec, "fp8")
    with jax.enable_x64(False), pytest.raises(RuntimeError, match="enable_x64"):
        linear(a, w, s, kind="fp8", mode="exact")


# ----------------------------------------------------------------------------- numpy references


def _random_e4m3(rng, shape):
    raw = rng.integers(0, 256, shape).astype(np.uint8)
    raw[(raw & 0x7F) == 0x7F] = 0x3C  # no NaN
    return raw.view(ml_dtypes.float8_e4m3fn)


def _numpy_block_gemm(a_q, a_s, w_vals, w_row_scale):
    """Oracle structure: exact f64 dot per 32-block, x scales, float32 sum in block order."""
    m, kp = a_q.shape
    kb = kp // 32
    a = a_q.astype(np.float64).reshape(m, kb, 32)
    w = w_vals.astype(np.float64).reshape(-1, kb, 32)
    acc = np.zeros((m, w.shape[0]), np.float32)
    for j in range(kb):
        dot = (a[:, j] @ w[:, j].T).astype(np.float32)
        acc = acc + dot * a_s[:, j : j + 1].astype(np.float32) * w_row_scale[None, :, j]
    return acc


def _e8m0(b):
    return np.exp2(np.asarray(b, np.float64) - 127).astype(np.float32)


@pytest.mark.parametrize("m, n, k", [(5, 80, 96), (3, 45, 70), (1, 33, 31), (4, 7, 200)])
def test_fp8_random_shapes_match_numpy(m, n, k):
    rng = np.random.default_rng(m * 1000 + n * 10 + k)
    x = (rng.standard_normal((m, k)) * 3).astype(ml_dtypes.bfloat16)
    w = _random_e4m3(rng, (n, k))
    nb, kb = -(-n // 32), -(-k // 32)
    s = rng.integers(115, 135, (nb, kb)).astype(np.uint8)
    xp = np.pad(x.astype(np.float32), ((0, 0), (0, kb * 32 - k)))
    a_q, a_s = (np.asarray(t) for t in Q.quant_fp8_act(jnp.asarray(xp)))
    w_vals = np.pad(w.astype(np.float32), ((0, 0), (0, kb * 32 - k)))
    w_row_scale = np.repeat(_e8m0(s), 32, axis=0)[:n]
    ref = _numpy_block_gemm(a_q, _e8m0(a_s), w_vals, w_row_scale)
    with jax.enable_x64(True):
        out = linear(jnp.asarray(x), jnp.asarray(w), jnp.asarray(s), kind="fp8", mode="exact",
                     out_dtype=jnp.float32)
    np.testing.assert_array_equal(bits(out), bits(ref))
    fast = np.asarray(linear(jnp.asarray(x), jnp.asarray(w), jnp.asarray(s), kind="fp8",
                             out_dtype=jnp.float32))
    mag = np.abs(a_q.astype(np.float64) * np.repeat(_e8m0(a_s), 32, 1)) @ np.abs(
        w_vals.astype(np.float64) * np.repeat(w_row_scale, 32, 1)).T
    assert (np.abs(fast - ref) <= 2.0**-21 * mag + 1e-30).all()


@pytest.mark.parametrize("lead, n, k", [((6,), 48, 128), ((2, 3), 16, 64)])
def test_fp4_random_shapes_match_numpy(lead, n, k):
    rng = np.random.default_rng(n + k)
    x = (rng.standard_normal(lead + (k,))).astype(np.float32)
    codes = rng.integers(0, 16, (n, k)).astype(np.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    s = rng.integers(120, 132, (n, k // 32)).astype(np.uint8)
    x2 = x.reshape(-1, k)
    a_q, a_s = (np.asarray(t) for t in Q.quant_fp8_act(jnp.asarray(x2)))
    w_vals = Q.E2M1_VALUES[codes]
    ref = _numpy_block_gemm(a_q, _e8m0(a_s), w_vals, _e8m0(s)).reshape(lead + (n,))
    with jax.enable_x64(True):
        out = linear(jnp.asarray(x), jnp.asarray(packed), jnp.asarray(s), kind="fp4", mode="exact")
    assert out.shape == lead + (n,) and out.dtype == jnp.float32
    np.testing.assert_array_equal(bits(out), bits(ref))
    fast = np.asarray(linear(jnp.asarray(x), jnp.asarray(packed), jnp.asarray(s), kind="fp4"))
    np.testing.assert_allclose(fast, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_dense_exact_rounds_once_from_float64():
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 3, 64)).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal((40, 64)).astype(ml_dtypes.bfloat16)
    ref = (x.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32)
    with jax.enable_x64(True):
        out = linear(jnp.asarray(x), jnp.asarray(w), kind="dense", mode="exact")
        out32 = linear(jnp.asarray(x), jnp.asarray(w), kind="dense", mode="exact", out_dtype=jnp.float32)
    assert out.dtype == jnp.bfloat16 and out.shape == (2, 3, 40)
    np.testing.assert_array_equal(bits(out), bits(ref.astype(ml_dtypes.bfloat16)))
    np.testing.assert_array_equal(bits(out32), bits(ref))
    fast = np.asarray(linear(jnp.asarray(x), jnp.asarray(w), kind="dense", out_dtype=jnp.float32))
    np.testing.assert_allclose(fast, ref, rtol=1e-5, atol=1e-5)


def test_bad_inputs_raise_clear_errors():
    x = jnp.zeros((2, 64), jnp.bfloat16)
    w8 = jnp.zeros((40, 64), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="kind must be one of"):
        linear(x, w8, kind="int8")
    with pytest.raises(ValueError, match=r"scale of shape \(2, 2\)"):
        linear(x, w8, jnp.zeros((1, 2), jnp.uint8), kind="fp8")
    with pytest.raises(ValueError, match="expects K = 32"):
        linear(x, jnp.zeros((8, 16), jnp.uint8), jnp.zeros((8, 1), jnp.uint8), kind="fp4")
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        linear(x, jnp.zeros((40, 64), jnp.bfloat16), jnp.zeros((2, 2), jnp.uint8), kind="fp8")
