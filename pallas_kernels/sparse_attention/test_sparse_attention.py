"""Sparse sink attention kernels (interpret mode) against the jnp reference and a float64 oracle."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.numerics import kv_layout
from pallas_kernels import sparse_sink_attention
from pallas_kernels.sparse_attention.reference import sparse_sink_attention_reference
from pallas_kernels.sparse_attention.testing import assert_close, make_inputs, oracle

PLATFORMS = ["tpu", "gpu"]
SHAPE = dict(B=2, S=4, H=4, D=64, Nw=11, G=13, Kw=5, Kc=7)  # multiples of nothing; shared to reuse compiles
SCALE = 64 ** -0.5
_jitted = jax.jit(sparse_sink_attention, static_argnums=(6,), static_argnames=("impl", "interpret", "platform"))


def _run(platform, q, window, compressed, widx, cidx, sink, scale):
    return _jitted(q, window, compressed, None if widx is None else jnp.asarray(widx),
                   None if cidx is None else jnp.asarray(cidx), jnp.asarray(sink), scale,
                   impl="pallas", interpret=True, platform=platform)


def _with_edge_rows(widx, cidx):
    """Row (0,0): all -1. (0,1): one window slot. (0,2): one compressed slot. (1,0): duplicates."""
    widx, cidx = widx.copy(), cidx.copy()
    widx[0, 0], cidx[0, 0] = -1, -1
    widx[0, 1], cidx[0, 1] = -1, -1
    widx[0, 1, -1] = 3
    widx[0, 2], cidx[0, 2] = -1, -1
    cidx[0, 2, 0] = 5
    widx[1, 0] = 2
    cidx[1, 0, :3] = 7
    return widx, cidx


@pytest.mark.parametrize("platform", PLATFORMS)
def test_random_and_edge_rows(platform):
    """Lengths that are multiples of nothing (Nw 11, G 13, Kw 5, Kc 7) plus the edge rows."""
    rng = np.random.default_rng(1)
    q, window, compressed, widx, cidx, sink = make_inputs(rng, **SHAPE)
    widx, cidx = _with_edge_rows(widx, cidx)
    scale = SCALE
    out = _run(platform, q, window, compressed, widx, cidx, sink, scale)
    ref = sparse_sink_attention_reference(q, window, compressed, jnp.asarray(widx), jnp.asarray(cidx),
                                          jnp.asarray(sink), scale)
    assert_close(out, oracle(q, window, compressed, widx, cidx, sink, scale), "vs float64 oracle")
    assert_close(out, ref, "vs jnp reference")
    assert np.all(np.asarray(out[0, 0], np.float32) == 0.0), "a row without a valid slot must give exactly 0"
    # one valid slot, in closed form: o = v e^s / (e^s + e^sink), independent of any softmax code
    v = np.asarray(kv_layout.dequantize_window(window), np.float64)[0, 3]
    s = np.asarray(q, np.float64)[0, 1] @ v * scale
    expect = v[None, :] / (1.0 + np.exp(sink.astype(np.float64) - s))[:, None]
    assert_close(out[0, 1], expect, "single slot")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_extreme_scales(platform):
    """Cache magnitudes 1e-3 and 300 (E8M0 / E4M3 scales far from 1), peaky softmax, sinks of +-30."""
    rng = np.random.default_rng(3)
    q, window, compressed, widx, cidx, sink = make_inputs(rng, **SHAPE, kv_scale=[1e-3, 300.0], q_scale=4.0)
    sink = np.array([30.0, -30.0, 0.0, 5.0], np.float32)
    scale = SCALE
    out = _run(platform, q, window, compressed, widx, cidx, sink, scale)
    assert_close(out, oracle(q, window, compressed, widx, cidx, sink, scale), "extreme scales")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_decode_window_only(platform):
    """Decode shape (S = 1, more heads, D = 128) and a layer without compressed KV."""
    rng = np.random.default_rng(4)
    q, window, _, widx, _, sink = make_inputs(rng, 3, 1, 16, 128, 16, 1, 16, 1, empty_frac=0.1)
    out = _run(platform, q, window, None, widx, None, sink, 128 ** -0.5)
    assert_close(out, oracle(q, window, None, widx, None, sink, 128 ** -0.5), "decode, window only")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_compressed_only(platform):
    """No window container at all (window=None): only the compressed source."""
    rng = np.random.default_rng(9)
    q, window, compressed, widx, cidx, sink = make_inputs(rng, **SHAPE)
    out = _run(platform, q, None, compressed, None, cidx, sink, SCALE)
    empty_window = np.full_like(widx, -1)
    assert_close(out, oracle(q, window, compressed, empty_window, cidx, sink, SCALE), "compressed only")


def test_auto_is_the_reference_on_cpu():
    rng = np.random.default_rng(5)
    q, window, compressed, widx, cidx, sink = make_inputs(rng, **SHAPE)
    args = (q, window, compressed, jnp.asarray(widx), jnp.asarray(cidx), jnp.asarray(sink), SCALE)
    out = sparse_sink_attention(*args)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(sparse_sink_attention_reference(*args), np.float32))


def test_gradient_is_the_reference_vjp():
    """The kernels reuse the jnp reference's VJP (custom_vjp); it must equal autodiff of the reference."""
    rng = np.random.default_rng(6)
    q, window, compressed, widx, cidx, sink = make_inputs(rng, 1, 2, 4, 64, 7, 7, 4, 4)
    q = q.astype(jnp.float32)
    widx, cidx, sink = jnp.asarray(widx), jnp.asarray(cidx), jnp.asarray(sink)
    probe = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)

    def loss(fn):
        return lambda q_, s_: jnp.sum(fn(q_, s_) * probe)

    # the VJP path does not depend on the platform; the GPU kernel is the quicker one to interpret
    kernel = loss(lambda q_, s_: sparse_sink_attention(q_, window, compressed, widx, cidx, s_, 0.125,
                                                       impl="pallas", interpret=True, platform="gpu"))
    reference = loss(lambda q_, s_: sparse_sink_attention_reference(q_, window, compressed, widx, cidx, s_, 0.125))
    gk = jax.grad(kernel, argnums=(0, 1))(q, sink)
    gr = jax.grad(reference, argnums=(0, 1))(q, sink)
    for a, b in zip(gk, gr):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)


def test_bad_inputs_are_reported():
    rng = np.random.default_rng(7)
    q, window, compressed, widx, cidx, sink = make_inputs(rng, **SHAPE)
    with pytest.raises(ValueError, match="sink must be"):
        sparse_sink_attention(q, window, compressed, jnp.asarray(widx), jnp.asarray(cidx), jnp.zeros(3), 0.1)
    with pytest.raises(ValueError, match="impl must be"):
        sparse_sink_attention(q, window, compressed, jnp.asarray(widx), jnp.asarray(cidx), jnp.asarray(sink), 0.1,
                              impl="cuda")
    with pytest.raises(TypeError, match="WindowKV"):
        sparse_sink_attention(q, tuple(window), compressed, jnp.asarray(widx), jnp.asarray(cidx), jnp.asarray(sink), 0.1)


@pytest.mark.slow
@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("seed", range(6))
def test_random_shape_sweep(platform, seed):
    rng = np.random.default_rng(100 + seed)
    B, S = int(rng.integers(1, 4)), int(rng.integers(1, 5))
    H, D = int(rng.choice([4, 8, 16])), int(rng.choice([64, 128]))
    Nw, G = int(rng.integers(1, 40)), int(rng.integers(1, 60))
    Kw, Kc = int(rng.integers(1, 20)), int(rng.integers(1, 40))
    q, window, compressed, widx, cidx, sink = make_inputs(rng, B, S, H, D, Nw, G, Kw, Kc,
                                                          empty_frac=float(rng.random()))
    scale = D ** -0.5
    if seed % 3 == 2:  # rows that see only compressed entries
        widx[:] = -1
    out = _run(platform, q, window, compressed, widx, cidx, sink, scale)
    assert_close(out, oracle(q, window, compressed, widx, cidx, sink, scale), f"seed {seed}")


def test_reference_gathers_first_at_long_context():
    """Decode at long context takes the gather-then-dequantize path; it must equal dequantize-then-gather."""
    from dsv41_jax.numerics.sparse_attention import sparse_attention
    from pallas_kernels.sparse_attention.reference import combined_kv_and_indices

    rng = np.random.default_rng(8)
    q, window, compressed, widx, cidx, sink = make_inputs(rng, 2, 1, 4, 64, 16, 300, 16, 9)
    args = (q, window, compressed, jnp.asarray(widx), jnp.asarray(cidx))
    kv, idx = combined_kv_and_indices(*args[1:], q.dtype)
    whole = sparse_attention(q, kv, jnp.asarray(sink), idx, SCALE)
    got = sparse_sink_attention_reference(*args, jnp.asarray(sink), SCALE)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(whole, np.float32))


def test_exact_mode_is_bit_identical_to_the_reference():
    """mode="exact" (interpreted TPU kernel, float64): bit for bit the reference's exact mode (the golden
    oracle's sparse_attn), over edge rows and rows longer than one 64-slot online-softmax block (100
    slots: two blocks, the second padded). One case holds both: each exact shape costs two programs'
    compile (about 9 s on 2 cores), so the edge rows go into the long rows' shape."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(12)
        q, window, compressed, widx, cidx, sink = make_inputs(rng, B=2, S=3, H=4, D=64, Nw=40, G=90, Kw=30, Kc=70)
        widx, cidx = _with_edge_rows(widx, cidx)
        args = (q, window, compressed, jnp.asarray(widx), jnp.asarray(cidx), jnp.asarray(sink))
        got = jax.jit(lambda *a: sparse_sink_attention(*a, SCALE, impl="pallas", interpret=True, mode="exact"))(*args)
        ref = jax.jit(lambda *a: sparse_sink_attention_reference(*a, SCALE, mode="exact"))(*args)
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32))


def test_exact_mode_needs_the_interpreted_tpu_kernel():
    rng = np.random.default_rng(13)
    q, window, compressed, widx, cidx, sink = make_inputs(rng, **SHAPE)
    args = (q, window, compressed, jnp.asarray(widx), jnp.asarray(cidx), jnp.asarray(sink), SCALE)
    for kw in (dict(platform="gpu", interpret=True), dict(platform="tpu", interpret=False)):
        with pytest.raises(ValueError, match="exact"):
            sparse_sink_attention(*args, impl="pallas", mode="exact", **kw)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_a_layer_of_stacked_rings_is_read_as_that_ring(platform):
    """A window given as one layer of rings stacked on a leading axis (`kv_layout.LayerRing`, a traced
    layer: what a scanned run of layers reads, the TPU kernel in place) gives the bits of that ring
    given alone, in bytes and as the word view; the reference (impl "xla") too."""
    rng = np.random.default_rng(5)
    rings = [make_inputs(rng, **SHAPE)[1] for _ in range(3)]
    q, _, compressed, widx, cidx, sink = make_inputs(rng, **SHAPE)
    for form in (lambda w: w, kv_layout.words_of):
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *(form(r) for r in rings))
        layered = jax.jit(lambda st, i: sparse_sink_attention(
            q, kv_layout.LayerRing(st, i), compressed, jnp.asarray(widx), jnp.asarray(cidx), jnp.asarray(sink), SCALE,
            impl="pallas", interpret=True, platform=platform))(stacked, jnp.int32(1))
        alone = _run(platform, q, form(rings[1]), compressed, widx, cidx, sink, SCALE)
        np.testing.assert_array_equal(np.asarray(layered, np.float32), np.asarray(alone, np.float32))
    ref = sparse_sink_attention(q, kv_layout.LayerRing(stacked, jnp.int32(2)), compressed, jnp.asarray(widx),
                                jnp.asarray(cidx), jnp.asarray(sink), SCALE, impl="xla")
    np.testing.assert_array_equal(np.asarray(ref, np.float32), np.asarray(sparse_sink_attention(
        q, kv_layout.words_of(rings[2]), compressed, jnp.asarray(widx), jnp.asarray(cidx), jnp.asarray(sink), SCALE,
        impl="xla"), np.float32))
