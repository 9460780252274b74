"""Expert GEMM kernels (interpret mode) against the jnp reference, a float64 oracle and the golden vectors."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dsv41_jax.numerics import quant
from pallas_kernels import fp8_block_gemm, grouped_fp4_gemm
from pallas_kernels.expert_gemm.reference import fp8_block_gemm_reference, grouped_fp4_gemm_reference

PLATFORMS = ["tpu", "gpu"]
_grouped = jax.jit(grouped_fp4_gemm, static_argnames=("impl", "interpret", "platform"))
_fp8 = jax.jit(fp8_block_gemm, static_argnames=("impl", "interpret", "platform"))


def _e8m0(s):
    return np.asarray(s, np.uint8).view(ml_dtypes.float8_e8m0fnu).astype(np.float64)


def _fp4_f64(packed, scale):
    packed = np.asarray(packed)
    codes = np.stack([packed & 0xF, packed >> 4], -1).reshape(*packed.shape[:-1], -1).astype(np.uint8)
    return codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64) * np.repeat(_e8m0(scale), 32, axis=-1)


def _act_f64(x):
    q, s = quant.quant_fp8_act(jnp.asarray(x, jnp.float32), 32)
    return np.asarray(q).astype(np.float64) * np.repeat(_e8m0(s), 32, axis=-1)


def _assert_close(out, ref, rtol=1e-5):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    assert out.shape == ref.shape
    scale = np.maximum(np.abs(ref).max(axis=-1, keepdims=True), 1e-30)  # per row: magnitudes differ by 1e36
    err = np.abs(out - ref)
    assert np.all(err <= rtol * scale), f"worst relative error {np.max(err / scale):.3g}"


def _grouped_inputs(rng, sizes, M, N, K, *, magnitudes=(1.0,)):
    E = len(sizes)
    mags = np.resize(np.asarray(magnitudes, np.float64), E)
    w = jnp.asarray(rng.standard_normal((E, N, K)) * mags[:, None, None], jnp.float32)
    wp, ws = jax.vmap(quant.quant_fp4_weight)(w)
    x = jnp.asarray(rng.standard_normal((M, K)) * np.resize(np.asarray(magnitudes), M)[:, None], jnp.bfloat16)
    return x, jnp.asarray(sizes, jnp.int32), wp, ws


def _grouped_oracle(x, sizes, wp, ws):
    xd = _act_f64(x)
    w = _fp4_f64(wp, ws)
    out = np.zeros((xd.shape[0], w.shape[1]))
    start = 0
    for g, n in enumerate(np.asarray(sizes)):
        out[start:start + n] = xd[start:start + n] @ w[g].T
        start += n
    return out


@pytest.mark.parametrize("platform", PLATFORMS)
def test_grouped_ragged(platform):
    """Empty experts, an expert spanning row tiles, and rows past sum(sizes) (must be 0)."""
    rng = np.random.default_rng(1)
    sizes = [5, 0, 23, 0, 0, 1, 4]  # 33 of 37 rows; tiles of 16 rows split experts 2 and 6
    x, gs, wp, ws = _grouped_inputs(rng, sizes, 37, 64, 128)
    out = _grouped(x, gs, wp, ws, impl="pallas", interpret=True, platform=platform)
    _assert_close(out, _grouped_oracle(x, gs, wp, ws))
    _assert_close(out, grouped_fp4_gemm_reference(x, gs, wp, ws))
    assert np.all(np.asarray(out)[33:] == 0.0)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_grouped_extreme_scales_and_one_expert(platform):
    """Weight scales from 2^-60 to 2^60 across experts; all rows in one expert; empty last expert."""
    rng = np.random.default_rng(2)
    sizes = [0, 0, 37, 0, 0, 0, 0]
    x, gs, wp, ws = _grouped_inputs(rng, sizes, 37, 64, 128, magnitudes=[1e-18, 1.0, 1e18, 3.0])
    out = _grouped(x, gs, wp, ws, impl="pallas", interpret=True, platform=platform)
    _assert_close(out, _grouped_oracle(x, gs, wp, ws))


@pytest.mark.parametrize("platform", PLATFORMS)
def test_grouped_pre_quantized_activation(platform):
    rng = np.random.default_rng(3)
    x, gs, wp, ws = _grouped_inputs(rng, [9, 0, 11], 20, 64, 128)
    q, s = quant.quant_fp8_act(x.astype(jnp.float32), 32)
    out = grouped_fp4_gemm((q, s), gs, wp, ws, impl="pallas", interpret=True, platform=platform)
    _assert_close(out, _grouped_oracle(x, gs, wp, ws))


@pytest.mark.parametrize("platform", PLATFORMS)
def test_fp8_block_gemm_partial_tiles(platform):
    """N = 80 and K = 96: the last scale row covers a partial 32-row tile."""
    rng = np.random.default_rng(4)
    w8, s8 = quant.quant_fp8_weight(jnp.asarray(rng.standard_normal((80, 96)) * 1e3, jnp.float32))
    x = jnp.asarray(rng.standard_normal((7, 96)), jnp.bfloat16)
    out = _fp8(x, w8, s8, impl="pallas", interpret=True, platform=platform)
    wd = np.asarray(w8).astype(np.float64) * np.repeat(np.repeat(_e8m0(s8), 32, 0), 32, 1)[:80, :96]
    _assert_close(out, _act_f64(x) @ wd.T)
    _assert_close(out, fp8_block_gemm_reference(x, w8, s8))


@pytest.mark.parametrize("M,N,K", [(7, 80, 96), (1, 512, 64), (20, 32, 160), (33, 64, 256)],
                         ids=["partial-tiles", "two-column-tiles", "odd-K-blocks", "M-tiles"])
def test_fp8_block_gemm_word_view(M, N, K):
    """The word view made once (`layout.fp8_weight_view`, as kernel_params does at load) gives the
    TPU kernel's result bit for bit, over partial tiles, an odd number of K blocks, several tiles."""
    from pallas_kernels.expert_gemm import layout

    rng = np.random.default_rng(M * N + K)
    w8, s8 = quant.quant_fp8_weight(jnp.asarray(rng.standard_normal((N, K)) * 1e2, jnp.float32))
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    words = layout.fp8_weight_view(w8)
    assert words.dtype == jnp.int32 and words.shape == (2, N, -(-K // 32) * 4)
    assert words.nbytes == N * -(-K // 32) * 32  # the stored bytes (and K's zero padding), nothing more
    got = _fp8(x, words, s8, impl="pallas", interpret=True, platform="tpu")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(_fp8(x, w8, s8, impl="pallas", interpret=True,
                                                                   platform="tpu")))
    wd = np.asarray(w8).astype(np.float64) * np.repeat(np.repeat(_e8m0(s8), 32, 0), 32, 1)[:N, :K]
    _assert_close(got, _act_f64(x) @ wd.T)


def test_grouped_word_view():
    """The experts' words made once (`layout.fp4_weight_words`) give the kernel's result bit for bit."""
    from pallas_kernels.expert_gemm import layout

    rng = np.random.default_rng(11)
    x, gs, wp, ws = _grouped_inputs(rng, [5, 0, 23, 1], 37, 64, 96)  # K/32 = 3 scale bytes: padded word
    words, swords = layout.fp4_weight_words(wp, ws)
    assert words.nbytes == wp.nbytes and swords.shape == (4, 64, 1)
    got = _grouped(x, gs, words, swords, impl="pallas", interpret=True, platform="tpu")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(_grouped(x, gs, wp, ws, impl="pallas", interpret=True,
                                                                       platform="tpu")))
    _assert_close(got, _grouped_oracle(x, gs, wp, ws))


def test_word_views_are_refused_where_the_bytes_are_read():
    """The XLA reference and the GPU kernel read the stored bytes: a word view there is an error, as is
    a view of the wrong shape."""
    from pallas_kernels.expert_gemm import layout

    rng = np.random.default_rng(12)
    x, gs, wp, ws = _grouped_inputs(rng, [3, 4], 7, 32, 64)
    words, swords = layout.fp4_weight_words(wp, ws)
    for impl, platform in (("xla", None), ("pallas", "gpu")):
        with pytest.raises(ValueError, match="word view"):
            grouped_fp4_gemm(x, gs, words, swords, impl=impl, interpret=True, platform=platform)
    with pytest.raises(ValueError, match="w_packed must be int32 words"):
        grouped_fp4_gemm(x, gs, words[..., :-1], swords, impl="pallas", interpret=True)
    w8, s8 = quant.quant_fp8_weight(jnp.asarray(rng.standard_normal((32, 64)), jnp.float32))
    view = layout.fp8_weight_view(w8)
    with pytest.raises(ValueError, match="word view"):
        fp8_block_gemm(x, view, s8, impl="xla")
    with pytest.raises(ValueError, match=r"int32 \[2, N, 8\]"):
        fp8_block_gemm(x, view[:, :, :4], s8, impl="pallas", interpret=True)


def _golden_vectors(golden_root):
    """The golden vectors' loader the tests share (tests/support), imported when a golden test runs."""
    from tests.support.kernel_vectors import kernel_vectors

    return kernel_vectors(golden_root)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_golden_gemm_vectors(golden_root, platform):
    """The oracle's FP4 and FP8 GEMM vectors (exact block dots summed in f32) to f32 accumulation error."""
    v = _golden_vectors(golden_root)
    a_q = jnp.asarray(v["fp4_gemm.a_q_e4m3"].view(ml_dtypes.float8_e4m3fn))
    a_s = jnp.asarray(v["fp4_gemm.a_scale_e8m0"])
    wp, ws = jnp.asarray(v["fp4_gemm.b_packed_e2m1"])[None], jnp.asarray(v["fp4_gemm.b_scale_e8m0"])[None]
    out = grouped_fp4_gemm((a_q, a_s), jnp.asarray([a_q.shape[0]], jnp.int32), wp, ws,
                           impl="pallas", interpret=True, platform=platform)
    _assert_close(out, v["fp4_gemm.out_f32"], 1e-5)
    a_q = jnp.asarray(v["fp8_gemm.a_q_e4m3"].view(ml_dtypes.float8_e4m3fn))
    a_s = jnp.asarray(v["fp8_gemm.a_scale_e8m0"])
    w = jnp.asarray(v["fp8_gemm.b_e4m3"].view(ml_dtypes.float8_e4m3fn))
    out = fp8_block_gemm((a_q, a_s), w, jnp.asarray(v["fp8_gemm.b_scale_e8m0"]), impl="pallas", interpret=True,
                         platform=platform)
    _assert_close(out, v["fp8_gemm.out_f32"], 1e-5)


def test_bad_inputs_are_reported():
    rng = np.random.default_rng(5)
    x, gs, wp, ws = _grouped_inputs(rng, [3, 4], 7, 32, 64)
    with pytest.raises(ValueError, match="group_sizes must be"):
        grouped_fp4_gemm(x, gs[:1], wp, ws)
    with pytest.raises(ValueError, match="w_scale must be"):
        grouped_fp4_gemm(x, gs, wp, ws[..., :1])
    with pytest.raises(ValueError, match="w_e4m3 must be"):
        fp8_block_gemm(x, wp[0], ws[0])


@pytest.mark.slow
@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("seed", range(4))
def test_grouped_random_sweep(platform, seed):
    rng = np.random.default_rng(100 + seed)
    E = int(rng.integers(1, 12))
    M = int(rng.integers(1, 150))
    sizes = rng.multinomial(int(rng.integers(0, M + 1)), np.ones(E) / E)
    x, gs, wp, ws = _grouped_inputs(rng, sizes.tolist(), M, 64 * int(rng.integers(1, 3)), 128)
    out = grouped_fp4_gemm(x, gs, wp, ws, impl="pallas", interpret=True, platform=platform)
    _assert_close(out, _grouped_oracle(x, gs, wp, ws))


def test_expert_gemm_moe_matches_per_row_linear():
    """The routed-expert FFN helper the model calls, against per-row dsv41_jax.numerics.gemm.linear calls."""
    from types import SimpleNamespace

    from dsv41_jax.numerics import gemm
    from dsv41_jax.numerics.activations import swiglu
    from pallas_kernels import expert_gemm_moe

    rng = np.random.default_rng(9)
    E, d, f, n = 4, 64, 32, 11

    def weight(out, inp):
        return jax.vmap(quant.quant_fp4_weight)(jnp.asarray(rng.standard_normal((E, out, inp)) / np.sqrt(inp), jnp.float32))

    (w1, s1), (w2, s2), (w3, s3) = weight(f, d), weight(d, f), weight(f, d)
    experts = SimpleNamespace(kind="fp4", limit=10.0, w1=w1, w1_scale=s1, w2=w2, w2_scale=s2, w3=w3, w3_scale=s3)
    rows = jnp.asarray(rng.standard_normal((n, d)), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, E - 1, n), jnp.int32)  # the last expert gets no rows
    wts = jnp.asarray(rng.random(n), jnp.float32)
    out = jax.jit(lambda r, i, w: expert_gemm_moe(experts, r, i, w, impl="pallas", interpret=True, platform="gpu"))(
        rows, ids, wts)

    def one_row(x, e, wt):
        lin = lambda v, w, s: gemm.linear(v, w[e], s[e], kind="fp4").astype(jnp.bfloat16)  # noqa: E731
        h = (wt * swiglu(lin(x[None], w1, s1), lin(x[None], w3, s3), 10.0)).astype(jnp.bfloat16)
        return lin(h, w2, s2)[0]

    expect = np.asarray(jax.jit(jax.vmap(one_row))(rows, ids, wts), np.float64)
    got = np.asarray(out, np.float64)
    scale = np.abs(expect).max(axis=-1, keepdims=True)
    assert np.all(np.abs(got - expect) <= 2e-2 * scale)
