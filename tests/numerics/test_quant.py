"""dsv41_jax.numerics.quant against the golden kernel vectors, ml_dtypes and numpy float64 references."""
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv41_jax.numerics import quant as Q
from tests.support.kernel_vectors import bits, kernel_vectors

# Rows of fp4_e4m3.* whose E4M3 scale saturates at 448 (golden README: informative only).
SATURATING_LABELS = ("huge (1e30 scale)", "large (300 scale; E4M3-16 scale saturation edge)")


@pytest.fixture(scope="module")
def vec(golden_root):
    return kernel_vectors(golden_root)


@pytest.fixture(scope="module")
def rows(vec):
    return jnp.asarray(vec["rows.input_bf16"])


def _labels(golden_root):
    import json

    meta = json.loads((golden_root / "quant_vectors.json").read_text())
    return meta["vectors"]["fp4_e4m3"]["row_labels"]


# ----------------------------------------------------------------------------- golden vectors


def test_e2m1_code_values_match_golden(vec):
    np.testing.assert_array_equal(bits(Q.E2M1_VALUES), bits(vec["e2m1.code_values"]))


def test_fp8_act_matches_golden(vec, rows):
    q, s = Q.quant_fp8_act(rows)
    np.testing.assert_array_equal(bits(q), vec["act_quant.q_e4m3"])
    np.testing.assert_array_equal(np.asarray(s), vec["act_quant.scale_e8m0"])
    np.testing.assert_array_equal(bits(Q.dequant_fp8_act(q, s)), bits(vec["act_quant.dequant_f32"]))
    fake = Q.fake_fp8_act(rows)
    assert fake.dtype == jnp.bfloat16
    np.testing.assert_array_equal(bits(fake), bits(vec["act_quant.inplace_bf16"]))


def test_fp4_mx_matches_golden(vec, rows):
    p, s = Q.quant_fp4_mx(rows)
    np.testing.assert_array_equal(np.asarray(p), vec["fp4_e8m0.packed"])
    np.testing.assert_array_equal(np.asarray(s), vec["fp4_e8m0.scale_e8m0"])
    np.testing.assert_array_equal(bits(Q.dequant_fp4_mx(p, s)), bits(vec["fp4_e8m0.dequant_f32"]))
    np.testing.assert_array_equal(bits(Q.fake_fp4_mx(rows)), bits(vec["fp4_e8m0.inplace_bf16"]))


def test_fp4_kv_matches_golden(vec, rows, golden_root):
    keep = np.array([label not in SATURATING_LABELS for label in _labels(golden_root)])
    assert keep.sum() == len(keep) - 2
    p, s = Q.quant_fp4_kv(rows)
    np.testing.assert_array_equal(np.asarray(p)[keep], vec["fp4_e4m3.packed"][keep])
    np.testing.assert_array_equal(bits(s)[keep], vec["fp4_e4m3.scale_e4m3"][keep])
    deq = Q.dequant_fp4_kv(p, s)
    np.testing.assert_array_equal(bits(deq)[keep], bits(vec["fp4_e4m3.dequant_f32"])[keep])
    fake = Q.fake_fp4_kv(rows)
    np.testing.assert_array_equal(bits(fake)[keep], bits(vec["fp4_e4m3.inplace_bf16"])[keep])


def test_fp4_kv_saturating_rows_informative(vec, rows, golden_root):
    """Out-of-domain rows: we saturate the scale at 448 like torch's cast; they happen to match."""
    sat = np.array([label in SATURATING_LABELS for label in _labels(golden_root)])
    p, s = Q.quant_fp4_kv(rows)
    np.testing.assert_array_equal(bits(s)[sat], vec["fp4_e4m3.scale_e4m3"][sat])
    np.testing.assert_array_equal(np.asarray(p)[sat], vec["fp4_e4m3.packed"][sat])


def test_fp4_kv_value_division_is_what_golden_needs(vec, rows):
    """x * (1/scale) rounds twice and flips at least one code of the vectors; x / scale does not."""
    p_mul, _ = Q.quant_fp4_kv(rows, divide_values=False)
    assert (np.asarray(p_mul) != vec["fp4_e4m3.packed"]).any()


def test_fp4_kv_scale_variants_agree_on_every_bf16_amax():
    """amax/6 and amax*f32(1/6) give the same E4M3 scale for every finite bf16 amax (docs/REFERENCE.md §6)."""
    amax = np.arange(0, 0x7F80, dtype=np.uint16).view(ml_dtypes.bfloat16)
    x = jnp.asarray(amax)[:, None] * jnp.ones((1, 16), jnp.bfloat16)
    _, s_div = Q.quant_fp4_kv(x, scale_by="divide")
    _, s_rec = Q.quant_fp4_kv(x, scale_by="reciprocal")
    np.testing.assert_array_equal(bits(s_div), bits(s_rec))


# ----------------------------------------------------------------------------- independent oracles


def _ceil_pow2_byte_f64(v: np.ndarray) -> np.ndarray:
    """127 + ceil(log2 v) for normal float32 v, from frexp (exact, no logarithms)."""
    mant, exp = np.frexp(v.astype(np.float64))
    return (127 + np.where(mant == 0.5, exp - 1, exp)).astype(np.uint8)


def _random_f32(rng, n, lo=-30, hi=30):
    mag = rng.standard_normal(n) * 2.0 ** rng.integers(lo, hi, n)
    return mag.astype(np.float32)


def test_float_to_e8m0_ceil_matches_frexp():
    rng = np.random.default_rng(0)
    v = np.abs(_random_f32(rng, 20000, -120, 120))
    v = np.concatenate([v, 2.0 ** np.arange(-126, 128, dtype=np.float64)]).astype(np.float32)
    v = v[v >= np.finfo(np.float32).tiny]
    np.testing.assert_array_equal(np.asarray(Q.float_to_e8m0_ceil(v)), _ceil_pow2_byte_f64(v))
    # subnormals round up to 2^-126 and zero maps to 2^-127, as the oracle's bit rule does
    edge = np.array([0.0, 1e-45, 1e-40, np.inf], np.float32)
    np.testing.assert_array_equal(np.asarray(Q.float_to_e8m0_ceil(edge)), [0, 1, 1, 255])


def test_float_to_e8m0_ceil_differs_from_nearest_cast():
    """ml_dtypes' e8m0 cast rounds to nearest; ours is a ceiling (the scale must not clip)."""
    v = np.float32(1.2)
    assert np.asarray(Q.float_to_e8m0_ceil(v)) == 128
    assert np.array(v).astype(ml_dtypes.float8_e8m0fnu).view(np.uint8) == 127


def test_e8m0_to_float_matches_ml_dtypes():
    b = np.arange(256, dtype=np.uint8)
    expect = b.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    np.testing.assert_array_equal(bits(Q.e8m0_to_float(b)), bits(expect))


def test_fp8_act_matches_ml_dtypes_reference():
    rng = np.random.default_rng(1)
    x = _random_f32(rng, 37 * 96, -20, 12).reshape(37, 96)
    x[3] = 0.0
    q, s = Q.quant_fp8_act(jnp.asarray(x))
    xb = x.reshape(37, 3, 32)
    amax = np.maximum(np.abs(xb).max(-1), np.float32(1e-4))
    s_ref = _ceil_pow2_byte_f64(amax * np.float32(1 / 448))
    scale = np.exp2(s_ref.astype(np.float64) - 127)[..., None]
    q_ref = (xb.astype(np.float64) / scale).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(s), s_ref)
    np.testing.assert_array_equal(bits(q), bits(q_ref.reshape(37, 96)))


def test_e4m3_rounding_at_midpoints_matches_ml_dtypes():
    """Every E4M3 midpoint and its float32 neighbours: no double rounding in XLA's cast."""
    grid = np.arange(0, 127, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    mid = ((grid[1:] + grid[:-1]) / 2).astype(np.float32)
    pts = np.concatenate([mid, np.nextafter(mid, 0), np.nextafter(mid, 1000)])
    pts = np.concatenate([pts, -pts]).reshape(-1, 1) * np.ones((1, 32), np.float32)
    pts[:, 0] = 448.0  # fix every block's scale at 2^0
    q, s = Q.quant_fp8_act(jnp.asarray(pts))
    assert (np.asarray(s) == 127).all()
    np.testing.assert_array_equal(bits(q), bits(pts.astype(ml_dtypes.float8_e4m3fn)))


def test_e2m1_encode_matches_ml_dtypes_for_finite_inputs():
    rng = np.random.default_rng(2)
    grid = Q.E2M1_VALUES[:8].astype(np.float64)
    mid = ((grid[1:] + grid[:-1]) / 2).astype(np.float32)
    near = np.concatenate([mid, np.nextafter(mid, 0), np.nextafter(mid, 10), [0.0, 6.0, 7.0, 1e30]])
    x = np.concatenate([near, -near, _random_f32(rng, 5000, -4, 4), np.float32([-0.0, 1e-40])])
    x = x.astype(np.float32)
    expect = x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    np.testing.assert_array_equal(np.asarray(Q.e2m1_encode(x)), expect)


def test_e2m1_special_values():
    x = np.array([np.inf, -np.inf, np.nan, -0.0, -0.1], np.float32)
    # inf saturates like ml_dtypes; NaN saturates too (ml_dtypes gives -0 instead); sign is kept
    np.testing.assert_array_equal(np.asarray(Q.e2m1_encode(x)), [7, 15, 7, 8, 8])


def test_e2m1_grid_round_trip_and_ties_to_even():
    codes = np.arange(16, dtype=np.uint8)
    np.testing.assert_array_equal(np.asarray(Q.e2m1_encode(Q.e2m1_decode(codes))), codes)
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    np.testing.assert_array_equal(
        np.asarray(Q.e2m1_decode(Q.e2m1_encode(ties))), [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    )


@pytest.mark.parametrize("shape", [(2,), (3, 8), (2, 5, 64), (1, 1, 1, 6)])
def test_pack_unpack_round_trip(shape):
    rng = np.random.default_rng(sum(shape))
    codes = rng.integers(0, 16, shape).astype(np.uint8)
    packed = np.asarray(Q.pack_fp4(codes))
    assert packed.shape == shape[:-1] + (shape[-1] // 2,)
    np.testing.assert_array_equal(packed, codes[..., 0::2] | (codes[..., 1::2] << 4))
    np.testing.assert_array_equal(np.asarray(Q.unpack_fp4(packed)), codes)


def test_fp4_mx_matches_numpy_reference():
    rng = np.random.default_rng(3)
    x = _random_f32(rng, 4 * 3 * 64, -10, 10).reshape(4, 3, 64)
    p, s = Q.quant_fp4_mx(jnp.asarray(x, jnp.bfloat16))
    xb = x.astype(ml_dtypes.bfloat16).astype(np.float32).reshape(4, 3, 2, 32)
    amax = np.maximum(np.abs(xb).max(-1), np.float32(6 * 2.0**-126))
    s_ref = _ceil_pow2_byte_f64(amax * np.float32(1 / 6))
    scaled = xb.astype(np.float64) / np.exp2(s_ref.astype(np.float64) - 127)[..., None]
    codes = scaled.astype(np.float32).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    np.testing.assert_array_equal(np.asarray(s), s_ref)
    np.testing.assert_array_equal(np.asarray(Q.unpack_fp4(p)), codes.reshape(4, 3, 64))


def test_fp4_kv_matches_numpy_reference():
    rng = np.random.default_rng(4)
    x = _random_f32(rng, 5 * 64, -6, 6).reshape(5, 64)
    p, s = Q.quant_fp4_kv(jnp.asarray(x))
    xb = x.reshape(5, 4, 16)
    amax = np.maximum(np.abs(xb).max(-1), np.float32(6 * 2.0**-9))
    s_ref = np.clip(amax / np.float32(6), 0, 448).astype(ml_dtypes.float8_e4m3fn)
    codes = (xb / s_ref.astype(np.float32)[..., None]).astype(ml_dtypes.float4_e2m1fn)
    np.testing.assert_array_equal(bits(s), bits(s_ref))
    np.testing.assert_array_equal(np.asarray(Q.unpack_fp4(p)), codes.view(np.uint8).reshape(5, 64))


# ----------------------------------------------------------------------------- weights


def test_fp8_weight_partial_blocks_match_numpy_reference():
    rng = np.random.default_rng(5)
    n, k = 70, 45
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[:32, :32] = 0.0  # an all-zero tile
    q, s = Q.quant_fp8_weight(jnp.asarray(w))
    assert q.shape == (n, k) and s.shape == (3, 2) and q.dtype == jnp.float8_e4m3fn
    for i in range(3):
        for j in range(2):
            tile = w[32 * i : 32 * i + 32, 32 * j : 32 * j + 32]
            amax = np.abs(tile).max()
            b = 0 if amax == 0 else 127 + math.ceil(math.log2(float(np.float32(amax) / np.float32(448))))
            assert int(s[i, j]) == b, (i, j)
            ref = (tile.astype(np.float64) / 2.0 ** (b - 127)).astype(np.float32)
            np.testing.assert_array_equal(
                bits(q[32 * i : 32 * i + 32, 32 * j : 32 * j + 32]),
                bits(ref.astype(ml_dtypes.float8_e4m3fn)),
            )
    deq = np.asarray(Q.dequant_fp8_weight(q, s))
    np.testing.assert_allclose(deq, w, rtol=2.0**-4, atol=2.0**-9 * 2.0 ** (s.max() - 127.0))


def test_fp4_weight_round_trip():
    rng = np.random.default_rng(6)
    w = (rng.standard_normal((8, 96)) * 0.1).astype(np.float32)
    packed, s = Q.quant_fp4_weight(jnp.asarray(w))
    assert packed.shape == (8, 48) and s.shape == (8, 3)
    deq = np.asarray(Q.dequant_fp4_weight(packed, s))
    # every dequantised value is a grid value times its block scale, within half a grid step
    step = np.repeat(np.exp2(np.asarray(s, np.float64) - 127), 32, axis=1)
    assert (np.abs(deq - w) <= step + 1e-12).all()
    # grid values times a power of two re-quantise losslessly (the scale may halve, values stay)
    p2, s2 = Q.quant_fp4_weight(jnp.asarray(deq))
    np.testing.assert_array_equal(np.asarray(Q.dequant_fp4_weight(p2, s2)), deq)


def test_weight_shape_errors_are_clear():
    with pytest.raises(ValueError, match="multiple of the block size 32"):
        Q.quant_fp4_weight(jnp.zeros((4, 40)))
    with pytest.raises(ValueError, match="scale shape"):
        Q.dequant_fp8_weight(jnp.zeros((40, 40), jnp.float8_e4m3fn), jnp.zeros((1, 1), jnp.uint8))
    with pytest.raises(ValueError, match="block size 16"):
        Q.quant_fp4_kv(jnp.zeros((3, 24)))


# ----------------------------------------------------------------------------- bytes, jit, STE


def _nbytes(fn, shape):
    out = jax.eval_shape(fn, jax.ShapeDtypeStruct(shape, jnp.bfloat16))
    return sum(math.prod(o.shape) * o.dtype.itemsize for o in out)


def test_cache_row_bytes_match_spec():
    """docs/REFERENCE.md §4 cache rows: FP4 KV 288 B, index key 68 B, FP8 window 528 B."""
    assert _nbytes(Q.quant_fp4_kv, (512,)) == 288
    assert _nbytes(Q.quant_fp4_mx, (128,)) == 68
    assert _nbytes(Q.quant_fp8_act, (512,)) == 528


def test_jit_matches_eager(rows):
    for fn in (Q.quant_fp8_act, Q.quant_fp4_mx, Q.quant_fp4_kv):
        for a, b in zip(jax.jit(fn)(rows), fn(rows)):
            np.testing.assert_array_equal(bits(a), bits(b))


@pytest.mark.parametrize(
    "fake, block", [(Q.fake_fp8_act, 32), (Q.fake_fp4_mx, 32), (Q.fake_fp4_kv, 16)]
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fake_quant_gradient_is_straight_through(fake, block, dtype):
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.standard_normal((3, 2 * block)), dtype)
    c = jnp.asarray(rng.standard_normal((3, 2 * block)), dtype)
    grad = jax.grad(lambda v: jnp.sum(fake(v, block) * c).astype(jnp.float32))(x)
    assert grad.dtype == dtype
    np.testing.assert_array_equal(bits(grad), bits(c))
    assert fake(x, block).dtype == dtype
