"""Indexer kernels (interpret mode) against the jnp reference and a float64 oracle (ml_dtypes decode)."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv41_jax.numerics import kv_layout, quant
from pallas_kernels import candidate_pool, indexer_scores, topk_indices
from pallas_kernels.indexer.reference import indexer_scores_reference

PLATFORMS = ["tpu", "gpu"]
SHAPE = dict(B=2, S=5, Hi=4, Di=64, G=37)  # G and S multiples of no tile
_jitted = jax.jit(indexer_scores, static_argnames=("bf16_rounding", "impl", "interpret", "platform"))


def _inputs(rng, B, S, Hi, Di, G, *, magnitude=1.0):
    magnitude = np.broadcast_to(np.asarray(magnitude, np.float64), (B,))
    qp, qs = quant.quant_fp4_mx(jnp.asarray(rng.standard_normal((B, S, Hi, Di)) * magnitude[:, None, None, None], jnp.float32), 32)
    keys = kv_layout.quantize_index_keys(jnp.asarray(rng.standard_normal((B, G, Di)) * magnitude[:, None, None], jnp.float32))
    w = jnp.asarray(rng.standard_normal((B, S, Hi)), jnp.bfloat16).astype(jnp.float32)
    clen = rng.integers(0, G + 1, (B, S)).astype(np.int32)
    if B > 1 and S > 1:
        clen[0, 0], clen[0, 1], clen[1, 0] = 0, G, 1  # nothing visible, everything, one entry
    pool = rng.random((B, S, G)) < 0.6
    return qp, qs, keys, w, jnp.asarray(clen), jnp.asarray(pool)


def _mxfp4_f64(packed, scale):
    packed = np.asarray(packed)
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1).astype(np.uint8)
    values = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    s = np.asarray(scale).view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
    return values * np.repeat(s, 32, axis=-1)


def _oracle(qp, qs, keys, w, clen, pool):
    q = _mxfp4_f64(qp, qs)
    k = _mxfp4_f64(keys.packed, keys.scales)
    dots = np.einsum("bshd,bgd->bshg", q, k)
    scores = np.sum(np.maximum(dots, 0.0) * np.asarray(w, np.float64)[..., None], axis=2)
    visible = np.arange(k.shape[1])[None, None, :] < np.asarray(clen)[..., None]
    if pool is not None:
        visible &= np.asarray(pool)
    return np.where(visible, scores, -np.inf)


def _assert_scores(out, ref, rtol):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert out.shape == ref.shape
    np.testing.assert_array_equal(np.isneginf(out), np.isneginf(ref))
    finite = np.isfinite(ref)
    scale = np.maximum(np.abs(np.where(finite, ref, 0)).max(axis=-1, keepdims=True), 1e-30)
    err = np.where(finite, np.abs(out - np.where(finite, ref, 0)), 0)
    assert np.all(err <= rtol * scale), f"max relative error {np.max(err / scale):.3g}"


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("use_pool", [False, True])
def test_scores_f32(platform, use_pool):
    qp, qs, keys, w, clen, pool = _inputs(np.random.default_rng(1), **SHAPE)
    pool = pool if use_pool else None
    out = _jitted(qp, qs, keys, w, clen, pool, impl="pallas", interpret=True, platform=platform)
    _assert_scores(out, _oracle(qp, qs, keys, w, clen, pool), 1e-6)
    _assert_scores(out, indexer_scores_reference(qp, qs, keys, w, clen, pool), 1e-6)
    assert np.all(np.isneginf(np.asarray(out)[0, 0])), "compress_len 0 must leave every entry at -inf"


@pytest.mark.parametrize("platform", PLATFORMS)
def test_scores_bf16_rounding_matches_reference(platform):
    qp, qs, keys, w, clen, pool = _inputs(np.random.default_rng(2), **SHAPE)
    out = _jitted(qp, qs, keys, w, clen, pool, bf16_rounding=True, impl="pallas", interpret=True, platform=platform)
    ref = indexer_scores_reference(qp, qs, keys, w, clen, pool, bf16_rounding=True)
    _assert_scores(out, ref, 2 ** -7)  # at most one bf16 ulp from a different f32 summation order
    assert np.mean(np.asarray(out) == np.asarray(ref)) > 0.95
    values = np.asarray(out)[np.isfinite(np.asarray(out))]
    np.testing.assert_array_equal(values, values.astype(ml_dtypes.bfloat16).astype(np.float32))


@pytest.mark.parametrize("platform", PLATFORMS)
def test_extreme_scales(platform):
    """Per-batch magnitudes 1e-6 and 1e6: E8M0 scales far from 1 on both sides."""
    qp, qs, keys, w, clen, pool = _inputs(np.random.default_rng(3), **SHAPE, magnitude=[1e-6, 1e6])
    out = _jitted(qp, qs, keys, w, clen, None, impl="pallas", interpret=True, platform=platform)
    _assert_scores(out, _oracle(qp, qs, keys, w, clen, None), 1e-5)


def test_auto_is_the_reference_on_cpu():
    qp, qs, keys, w, clen, pool = _inputs(np.random.default_rng(4), **SHAPE)
    np.testing.assert_array_equal(np.asarray(indexer_scores(qp, qs, keys, w, clen, pool)),
                                  np.asarray(indexer_scores_reference(qp, qs, keys, w, clen, pool)))


def _pool_oracle(scores, clen, block, n_blocks):
    B, S, G = scores.shape
    nb = -(-G // block)
    out = np.zeros((B, S, G), bool)
    for b in range(B):
        for s in range(S):
            bs = np.full(nb, -np.inf)
            for i in range(nb):
                bs[i] = scores[b, s, i * block:(i + 1) * block].max()
            if clen[b, s] >= 1:
                bs[(clen[b, s] - 1) // block] = np.inf
            order = sorted(range(nb), key=lambda i: (-bs[i], i))[:n_blocks]
            for i in order:
                if bs[i] > -np.inf:
                    out[b, s, i * block:(i + 1) * block] = True
    return out


def test_candidate_pool():
    rng = np.random.default_rng(5)
    B, S, G, block = 2, 4, 29, 4  # G not a multiple of the block
    clen = np.array([[0, 1, 13, 29], [5, 29, 2, 8]], np.int32)
    scores = np.round(rng.standard_normal((B, S, G)), 1).astype(np.float32)  # rounding makes ties
    scores = np.where(np.arange(G)[None, None] < clen[..., None], scores, -np.inf)
    for n_blocks in (1, 3, 100):  # 100 > number of blocks: leftover -inf picks are dropped
        got = candidate_pool(jnp.asarray(scores), jnp.asarray(clen), block, n_blocks)
        np.testing.assert_array_equal(np.asarray(got), _pool_oracle(scores, clen, block, n_blocks), f"n_blocks {n_blocks}")


def test_topk_indices():
    scores = np.array([[[3.0, -np.inf, 1.0, 3.0, 2.0, -np.inf],
                        [-np.inf] * 6,
                        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]]], np.float32)
    got = np.asarray(topk_indices(jnp.asarray(scores), 3))
    np.testing.assert_array_equal(got, [[[0, 3, 4], [-1, -1, -1], [0, 1, 2]]])  # ties to the lower index
    got = np.asarray(topk_indices(jnp.asarray(scores), 10))  # k = min(topk, G) = 6; -inf picks are -1, last
    np.testing.assert_array_equal(got, [[[0, 2, 3, 4, -1, -1], [-1] * 6, [0, 1, 2, 3, 4, 5]]])


def test_bad_inputs_are_reported():
    qp, qs, keys, w, clen, pool = _inputs(np.random.default_rng(6), **SHAPE)
    with pytest.raises(ValueError, match="weights must be"):
        indexer_scores(qp, qs, keys, w[..., :2], clen, pool)
    with pytest.raises(ValueError, match="pool_mask must be"):
        indexer_scores(qp, qs, keys, w, clen, pool[..., :3])
    with pytest.raises(ValueError, match="block_size and n_blocks"):
        candidate_pool(jnp.zeros((1, 1, 4)), jnp.ones((1, 1), jnp.int32), 0, 1)


@pytest.mark.slow
@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("seed", range(4))
def test_random_shape_sweep(platform, seed):
    rng = np.random.default_rng(100 + seed)
    shape = dict(B=int(rng.integers(1, 3)), S=int(rng.integers(1, 20)), Hi=int(rng.choice([4, 8, 32])),
                 Di=int(rng.choice([64, 128])), G=int(rng.integers(1, 700)))
    qp, qs, keys, w, clen, pool = _inputs(rng, **shape)
    out = indexer_scores(qp, qs, keys, w, clen, pool, impl="pallas", interpret=True, platform=platform)
    _assert_scores(out, _oracle(qp, qs, keys, w, clen, pool), 1e-5)


def test_exact_mode_is_bit_identical_to_the_reference():
    """mode="exact" (interpreted TPU kernel): float64 dots rounded once, then the bf16 rounding points;
    bit for bit the reference's exact mode, with and without a pool, at extreme scales too."""
    with jax.enable_x64(True):
        for seed, magnitude in ((7, 1.0), (8, [1e-6, 1e6])):
            qp, qs, keys, w, clen, pool = _inputs(np.random.default_rng(seed), **SHAPE, magnitude=magnitude)
            for pm in (None, pool):
                got = indexer_scores(qp, qs, keys, w, clen, pm, impl="pallas", interpret=True, mode="exact")
                ref = indexer_scores_reference(qp, qs, keys, w, clen, pm, bf16_rounding=True, exact=True)
                np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


def test_exact_mode_needs_the_interpreted_tpu_kernel():
    qp, qs, keys, w, clen, pool = _inputs(np.random.default_rng(9), **SHAPE)
    with pytest.raises(ValueError, match="exact"):
        indexer_scores(qp, qs, keys, w, clen, pool, impl="pallas", interpret=True, platform="gpu", mode="exact")
