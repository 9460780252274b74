"""The kernels' bit-level decoders and the kernel views of the cache, against ml_dtypes and quant."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv41_jax.numerics import kv_layout
from pallas_kernels.common import bits
from pallas_kernels.common.backend import resolve


def _same(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
    ok = ~np.isnan(a)
    np.testing.assert_array_equal(a[ok], b[ok])
    np.testing.assert_array_equal(np.signbit(a[ok]), np.signbit(b[ok]))


def test_e4m3_all_codes():
    codes = np.arange(256, dtype=np.uint8)
    _same(jax.jit(bits.e4m3_to_f32)(jnp.asarray(codes, jnp.int32)), codes.view(ml_dtypes.float8_e4m3fn))


def test_e8m0_all_codes():
    codes = np.arange(256, dtype=np.uint8)
    _same(jax.jit(bits.e8m0_to_f32)(jnp.asarray(codes, jnp.int32)), codes.view(ml_dtypes.float8_e8m0fnu))


def test_e2m1_all_codes():
    codes = np.arange(16, dtype=np.uint8)
    _same(jax.jit(bits.e2m1_to_f32)(jnp.asarray(codes, jnp.int32)), codes.view(ml_dtypes.float4_e2m1fn))


def _words_to_bytes(words, n_bytes):
    w = np.asarray(words).astype(np.uint32)
    return np.stack([(w >> (8 * t)) & 0xFF for t in range(4)], -1).reshape(*w.shape[:-1], -1)[..., :n_bytes]


def test_word_views_put_element_8j_plus_n_in_plane_n():
    rng = np.random.default_rng(0)
    D = 64
    window = kv_layout.quantize_window(jnp.asarray(rng.standard_normal((2, 3, D)), jnp.float32))
    ww = kv_layout.window_words(window)
    raw = np.asarray(window.values).view(np.uint8)
    low, high = _words_to_bytes(ww.low, D // 2), _words_to_bytes(ww.high, D // 2)
    for n in range(8):
        plane = (low if n < 4 else high).reshape(2, 3, D // 8, 4)[..., n % 4]
        np.testing.assert_array_equal(plane, raw[..., n::8])
    np.testing.assert_array_equal(_words_to_bytes(ww.scales, D // 32), np.asarray(window.scales))

    comp = kv_layout.quantize_compressed(jnp.asarray(rng.standard_normal((2, 3, D)), jnp.float32))
    cw = kv_layout.compressed_words(comp)
    packed = np.asarray(comp.packed)
    codes = np.stack([packed & 0xF, packed >> 4], -1).reshape(2, 3, D)
    words = np.asarray(cw.packed).astype(np.uint32)
    for n in range(8):
        np.testing.assert_array_equal((words >> (4 * n)) & 0xF, codes[..., n::8])
    np.testing.assert_array_equal(_words_to_bytes(cw.scales, D // 16), np.asarray(comp.scales).view(np.uint8))


def test_resolve():
    assert resolve("xla", None).kind == "xla"
    assert resolve("auto", None).kind == "xla"  # this test machine is a CPU
    assert resolve("pallas", None) == ("tpu", True)
    assert resolve("pallas", False, "gpu") == ("gpu", False)
    with pytest.raises(ValueError, match="impl must be"):
        resolve("triton", None)
    with pytest.raises(ValueError, match="platform must be"):
        resolve("pallas", None, "cuda")
