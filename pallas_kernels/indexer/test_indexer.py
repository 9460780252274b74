"""Indexer kernels (interpret mode) against the jnp reference and a float64 oracle (ml_dtypes decode)."""
import functools

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



def _model_reference_kernel(ind, cfg, x, qr, keys, positions, visible):
    """Exact-mode scores three ways: the model's `Indexer.scores` (impl="xla"), the kernel reference
    on the kernel's inputs (built as `Indexer.scores_pallas` builds them) and the interpreted kernel.
    One program, compiled as the model's steps are (`COMPILER_OPTIONS`: every bf16 rounding kept):
    run eagerly, the exact emulations' operations were each dispatched and compiled alone (the
    32-head case took 27.0 s in the clean-clone CI run of 2026-12-05, 7.3 s alone so)."""
    from flax import nnx

    from dsv41_jax.layers.rope import apply_rope, cos_sin, layer_rope
    from dsv41_jax.runtime import COMPILER_OPTIONS, Runtime

    graphdef, state = nnx.split(ind)

    @functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS)
    def three(state, x, qr, keys, positions, visible):
        ind = nnx.merge(graphdef, state)
        B, T, heads = x.shape[0], x.shape[1], ind.n_heads
        cos, sin = cos_sin(positions, layer_rope(cfg, 1))
        model = ind.scores(x, qr, kv_layout.dequantize_index_keys(keys).astype(jnp.bfloat16), cos, sin, visible, "exact")
        kernel = ind.scores_pallas(x, qr, keys, cos, sin, visible, Runtime(mode="exact", impl="pallas", interpret=True))
        q = ind.wq_b(qr, "exact").reshape(B, T, heads, cfg.index_head_dim)
        qp, qs = quant.quant_fp4_mx(apply_rope(q, cos, sin, cfg.rope_head_dim), 32)
        w = ind.weights_proj(x, "exact")
        w = (w.astype(jnp.float32) * jnp.float32(cfg.index_head_dim ** -0.5 * heads ** -0.5)).astype(jnp.bfloat16)
        ref = indexer_scores_reference(qp, qs, keys, w.astype(jnp.float32), visible, bf16_rounding=True, exact=True)
        return model, ref, kernel

    return tuple(np.asarray(a) for a in three(state, x, qr, keys, positions, visible))


# 32 heads (the release's) in the default suite: the same three-way check, and its head sum folds two
# in-order runs of 16, the 8-head case's order inside it; 8 (the goldens') with -m slow (~28 s on 2 cores)
@pytest.mark.parametrize("heads", [pytest.param(8, marks=pytest.mark.slow), 32])
def test_exact_model_scores_equal_reference_and_kernel(heads):
    """Exact mode: the model's `Indexer.scores`, the kernel reference and the interpreted kernel give
    the same bits, on random inputs and on a head sum built to show its order. torch sums the
    strided head axis in order, folded in levels of 16 (`exact_ops.torch_sum_axis`); a plain
    in-order sum agrees with it up to 16 heads (the goldens have 8) and not at the release's 32."""
    from flax import nnx

    from dsv41_jax.config import ModelConfig
    from dsv41_jax.layers.indexer import Indexer

    cfg = ModelConfig.tiny(index_n_heads=heads, dtype="bf16")  # dense linears: weights set exactly below
    rng = np.random.default_rng(heads)
    with jax.enable_x64(True):
        ind = Indexer(cfg, owns_keys=False, rngs=nnx.Rngs(heads))
        B, T, G = 2, 3, 40
        x = jnp.asarray(rng.standard_normal((B, T, cfg.dim)), jnp.bfloat16)
        qr = jnp.asarray(rng.standard_normal((B, T, cfg.q_lora_rank)), jnp.bfloat16)
        keys = kv_layout.quantize_index_keys(jnp.asarray(rng.standard_normal((B, G, cfg.index_head_dim)), jnp.float32))
        positions = jnp.asarray(rng.integers(0, 2 * G, (B, T)), jnp.int32)
        visible = jnp.asarray(rng.integers(1, G + 1, (B, T)), jnp.int32)
        model, ref, kernel = _model_reference_kernel(ind, cfg, x, qr, keys, positions, visible)
        assert np.isfinite(model).sum() > B * T  # something visible to compare
        np.testing.assert_array_equal(ref, model)
        np.testing.assert_array_equal(kernel, model)

        # Every head's dot is 1 (one-hot query and key in a non-RoPE dim), so term h = w_h, set to
        # 1, 2^-8 (the bf16 midpoint above 1), 0 ... and 2^-25 from head 16 on. In order, each
        # 2^-25 is a quarter f32 ulp and vanishes: 1 + 2^-8 rounds (to even) to bf16 1. Folded at
        # 16, the last heads first add to 2^-21 and the sum rounds up to 1 + 2^-7.
        target = np.zeros(heads, np.float64)
        target[:2] = 1.0, 2.0 ** -8
        target[16:] = 2.0 ** -25
        # w = bf16(x . W * hd^-0.5 * H^-0.5): W[h, 0] = target * 2^5.5 rounded to bf16 lands back on target
        scale = cfg.index_head_dim ** -0.5 * heads ** -0.5
        W = np.zeros((heads, cfg.dim), np.float32)
        W[:, 0] = target / scale
        ind.weights_proj.weight[...] = jnp.asarray(W, jnp.bfloat16)
        Wq = np.zeros((heads * cfg.index_head_dim, cfg.q_lora_rank), np.float32)
        Wq[np.arange(heads) * cfg.index_head_dim, 0] = 1.0
        ind.wq_b.weight[...] = jnp.asarray(Wq, ind.wq_b.weight[...].dtype)
        one = lambda n: jnp.zeros((1, 1, n), jnp.bfloat16).at[..., 0].set(1)
        k = np.zeros((1, 4, cfg.index_head_dim), np.float32)
        k[0, 0, 0] = 1.0
        model, ref, kernel = _model_reference_kernel(ind, cfg, one(cfg.dim), one(cfg.q_lora_rank),
                                                     kv_layout.quantize_index_keys(jnp.asarray(k)),
                                                     jnp.zeros((1, 1), jnp.int32), jnp.full((1, 1), 4, jnp.int32))
    expected = 1.0 + 2.0 ** -7 if heads > 16 else 1.0
    assert model[0, 0, 0] == expected  # the model follows torch's order
    np.testing.assert_array_equal(ref, model)
    np.testing.assert_array_equal(kernel, model)
