"""sparse_attention against the golden sparse_attn vectors and independent numpy references."""
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv41_jax.numerics.sparse_attention import sparse_attention
from dsv41_jax.runtime import COMPILER_OPTIONS
from tests.support.kernel_vectors import bits, kernel_vectors
from tests.support.mkl_exp_reference import mkl_expf_reference

BF16 = ml_dtypes.bfloat16


@pytest.fixture(scope="module")
def vec(golden_root):
    return kernel_vectors(golden_root)


def _golden(vec, key):
    return (jnp.asarray(vec["sparse_attn.q"]), jnp.asarray(vec["sparse_attn.kv"]),
            jnp.asarray(vec["sparse_attn.attn_sink"]),
            jnp.asarray(vec[f"sparse_attn.{key}.topk_idxs"]), vec[f"sparse_attn.{key}.out"])


@pytest.mark.parametrize("key", ["k24", "k100"])
@pytest.mark.parametrize("jit", [False, True])
def test_exact_mode_bit_exact(vec, key, jit):
    q, kv, sink, idx, ref = _golden(vec, key)
    fn = lambda *a: sparse_attention(*a, 64**-0.5, mode="exact")  # noqa: E731
    with jax.enable_x64(True):
        out = (jax.jit(fn) if jit else fn)(q, kv, sink, idx)
    assert out.dtype == jnp.bfloat16 and out.shape == (1, 5, 4, 64)
    np.testing.assert_array_equal(bits(out), bits(ref))


def test_k100_needs_the_64_wide_blocks(vec):
    """One block of 128 (plain softmax order) does not reproduce k100: the block order matters."""
    q, kv, sink, idx, ref = _golden(vec, "k100")
    with jax.enable_x64(True):
        out = sparse_attention(q, kv, sink, idx, 64**-0.5, mode="exact", block=128)
    assert (bits(out) != bits(ref)).any()


@pytest.mark.parametrize("key", ["k24", "k100"])
def test_fast_mode_within_bf16(vec, key):
    q, kv, sink, idx, ref = _golden(vec, key)
    out = np.asarray(sparse_attention(q, kv, sink, idx, 64**-0.5), np.float32)
    ref = ref.astype(np.float32)
    np.testing.assert_allclose(out, ref, rtol=2.0**-7, atol=2.0**-7 * np.abs(ref).max())


def test_exact_mode_without_x64_is_a_clear_error(vec):
    q, kv, sink, idx, _ = _golden(vec, "k24")
    with jax.enable_x64(False), pytest.raises(RuntimeError, match="enable_x64"):
        sparse_attention(q, kv, sink, idx, 0.125, mode="exact")


# ----------------------------------------------------------------------------- numpy references


def _reference_f64(q, kv, sink, idx, scale):
    """Plain softmax with sink in float64 (no bf16 rounding of P); empty rows give 0."""
    q, kv = q.astype(np.float64), kv.astype(np.float64)
    b, s, h, d = q.shape
    out = np.zeros((b, s, h, d))
    for bi in range(b):
        for si in range(s):
            sel = idx[bi, si][idx[bi, si] >= 0]
            if sel.size == 0:
                continue
            rows = kv[bi, sel]
            scores = q[bi, si] @ rows.T * scale  # [h, k]
            m = scores.max(-1, keepdims=True)
            p = np.exp(scores - m)
            denom = p.sum(-1) + np.exp(sink.astype(np.float64) - m[:, 0])
            out[bi, si] = p @ rows / denom[:, None]
    return out


def _reference_online_f32(q, kv, sink, idx, scale, block=64):
    """Independent float32 emulation of exact mode's online softmax (per row, per block)."""
    f32 = np.float32
    q, kv = q.astype(np.float64), kv.astype(np.float64)
    b, s, h, d = q.shape
    out = np.zeros((b, s, h, d), f32)
    for bi in range(b):
        for si in range(s):
            for hi in range(h):
                m, l, acc = f32(-np.inf), f32(0), np.zeros(d, f32)
                for k0 in range(0, idx.shape[-1], block):
                    ib = idx[bi, si, k0 : k0 + block]
                    ok = ib >= 0
                    if not ok.any():
                        continue
                    rows = kv[bi, np.maximum(ib, 0)]
                    sc = np.where(ok, (rows @ q[bi, si, hi]).astype(f32) * f32(scale), -np.inf)
                    m_new = max(m, f32(sc.max()))
                    alpha = mkl_expf_reference(np.float32([m - m_new]))[0]
                    p = np.where(ok, mkl_expf_reference((sc - m_new).astype(f32)), 0).astype(f32)
                    l = f32(f32(l * alpha) + f32(p.astype(np.float64).sum()))
                    pv = (p.astype(BF16).astype(np.float64) @ rows).astype(f32)
                    acc = (acc * alpha).astype(f32) + pv
                    m = m_new
                if m == -np.inf:
                    continue
                den = f32(l + mkl_expf_reference(np.float32([f32(sink[hi]) - m]))[0])
                out[bi, si, hi] = acc / den
    return out


def _random_case(seed, b, s, h, d, n, k, empty_frac=0.3):
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((b, s, h, d)) * 2).astype(BF16)
    kv = rng.standard_normal((b, n, d)).astype(BF16)
    sink = rng.standard_normal(h).astype(np.float32)
    idx = rng.integers(0, n, (b, s, k)).astype(np.int32)
    idx[rng.random((b, s, k)) < empty_frac] = -1
    return q, kv, sink, idx


@pytest.mark.parametrize("shape", [(1, 3, 2, 16, 40, 10), (2, 4, 3, 32, 70, 150), (1, 2, 1, 8, 5, 64)])
def test_random_shapes_against_numpy(shape):
    b, s, h, d, n, k = shape
    q, kv, sink, idx = _random_case(sum(shape), b, s, h, d, n, k)
    scale = d**-0.5
    args = (jnp.asarray(q), jnp.asarray(kv), jnp.asarray(sink), jnp.asarray(idx))
    # compiled as the model's steps are (every rounding kept): eagerly, the exact emulation's
    # operations outside the block loop were each compiled alone (test_exact_mode_bit_exact runs it so)
    attend = lambda *a, **kw: jax.jit(lambda *x: sparse_attention(*x, scale, **kw),  # noqa: E731
                                      compiler_options=COMPILER_OPTIONS)(*a)
    with jax.enable_x64(True):
        exact = attend(*args, mode="exact", block=64)
        exact32 = attend(*(jnp.asarray(a, jnp.float32) for a in args[:2]), *args[2:], mode="exact").astype(jnp.float32)
    # bit-exact against the independent float32 emulation (q in f32 so no output rounding)
    ref32 = _reference_online_f32(q, kv, sink, idx, scale)
    np.testing.assert_array_equal(bits(exact32), bits(ref32))
    np.testing.assert_array_equal(bits(exact), bits(ref32.astype(BF16)))
    # both modes close to the float64 softmax (P is rounded to bf16, the output too)
    ref64 = _reference_f64(q, kv, sink, idx, scale)
    fast = np.asarray(attend(*args), np.float32)
    for out in (np.asarray(exact, np.float32), fast):
        np.testing.assert_allclose(out, ref64, rtol=2.0**-6, atol=2.0**-7)


def test_edge_cases():
    q, kv, sink, idx = _random_case(5, 1, 4, 2, 16, 20, 130, empty_frac=0.0)
    idx[0, 0] = -1  # no valid slot -> 0
    idx[0, 1] = -1
    idx[0, 1, 100] = 7  # a single valid slot, in the third block
    idx[0, 2, :] = 3  # the same slot 130 times
    idx[0, 3, :64] = -1  # a leading block with nothing valid
    args = (jnp.asarray(q), jnp.asarray(kv), jnp.asarray(sink), jnp.asarray(idx), 0.25)
    with jax.enable_x64(True):
        exact = np.asarray(sparse_attention(*args, mode="exact"), np.float32)
    fast = np.asarray(sparse_attention(*args), np.float32)
    ref = _reference_f64(q, kv, sink, idx, 0.25)
    for out in (exact, fast):
        assert np.all(out[0, 0] == 0)
        # one slot: o = v * e^s / (e^s + e^sink), same v for every head
        np.testing.assert_allclose(out[0, 1], ref[0, 1], rtol=2.0**-7, atol=1e-6)
        np.testing.assert_allclose(out[0, 2], ref[0, 2], rtol=2.0**-6, atol=2.0**-7)
        np.testing.assert_allclose(out[0, 3], ref[0, 3], rtol=2.0**-6, atol=2.0**-7)
    # duplicates count every time: 130 copies of one slot outweigh the sink 130-fold
    s3 = (q[0, 2].astype(np.float64) @ kv[0, 3].astype(np.float64)) * 0.25
    w = 130 * np.exp(s3) / (130 * np.exp(s3) + np.exp(sink.astype(np.float64)))
    np.testing.assert_allclose(exact[0, 2], w[:, None] * kv[0, 3].astype(np.float64), rtol=2.0**-6,
                               atol=2.0**-8)


def test_bad_inputs_raise():
    q = jnp.zeros((1, 2, 3, 8), jnp.bfloat16)
    kv = jnp.zeros((1, 5, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="sink must be"):
        sparse_attention(q, kv, jnp.zeros(2), jnp.zeros((1, 2, 4), jnp.int32), 0.1)
    with pytest.raises(ValueError, match="shapes disagree"):
        sparse_attention(q, kv, jnp.zeros(3), jnp.zeros((1, 3, 4), jnp.int32), 0.1)
    with pytest.raises(TypeError, match="integer"):
        sparse_attention(q, kv, jnp.zeros(3), jnp.zeros((1, 2, 4)), 0.1)
