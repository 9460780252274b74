"""Model behaviour without the oracle: prefill == prefill + decode, causality, bad input."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.numerics import kv_layout
from dsv41_jax.model.transformer import check_inputs, init_cache, make_step
from dsv41_jax.runtime import Runtime


@pytest.fixture(scope="module")
def tiny(tiny_every_role):
    return tiny_every_role  # conftest.py: every layer role, window/pool/top-k binding early


def _run(step, params, cfg, tokens, chunks):
    """Feed tokens [B, N] in the given chunk lengths; returns (logits [B,N,V], cache, per-chunk aux)."""
    cache = init_cache(cfg, tokens.shape[0])
    outs, auxes, s = [], [], 0
    for n in chunks:
        logits, cache, aux = step(params, jnp.asarray(tokens[:, s:s + n]), cache)
        outs.append(np.asarray(logits))
        auxes.append(aux)
        s += n
    return np.concatenate(outs, 1), cache, auxes


def _rows_of(auxes, key, layer):
    return np.concatenate([np.asarray(a[key][layer]) for a in auxes], 1)


@pytest.fixture(scope="module")
def fast_step(tiny_fast_step):
    """One jitted step (fast, impl="xla") shared by the tests below and test_model_pallas.py (conftest.py),
    so each (batch, length) compiles once."""
    return tiny_fast_step


def _check_prefill_vs_decode(cfg, step, params, tokens, n, k, bitwise):
    ref, ref_cache, ref_aux = _run(step, params, cfg, tokens[:, :n], [n])
    got, cache, aux = _run(step, params, cfg, tokens[:, :n], [k] + [1] * (n - k))
    for r in cfg.roles:
        np.testing.assert_array_equal(_rows_of(aux, "experts", r.layer), np.asarray(ref_aux[0]["experts"][r.layer]))
        if r.ratio:
            np.testing.assert_array_equal(_rows_of(aux, "topk", r.layer), np.asarray(ref_aux[0]["topk"][r.layer]))
    for name in ("compressed", "index_keys", "compressor"):
        for key in ref_cache[name]:
            for a, b in zip(jax.tree.leaves(cache[name][key]), jax.tree.leaves(ref_cache[name][key])):
                np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    for a, b in zip(jax.tree.leaves(cache["window"]), jax.tree.leaves(ref_cache["window"])):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    if bitwise:
        # exact dots round once, independently of how many rows a GEMM has: bit-identical
        np.testing.assert_array_equal(got, ref)
    else:
        # fp32 accumulation may differ by reduction order between GEMM shapes; logits are
        # a dim-term fp32 dot of bf16 values after the final norm, so ~1e-5 relative
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


# (N, k): prefill N vs prefill k + (N - k) decode steps; odd and even k leave partial compressor
# groups; N > window and N > pool capacity so the ring wraps and the candidate pool binds
PAIRS = [(13, 5), (8, 5), (13, 8)]


@pytest.mark.parametrize("n, k", PAIRS)
def test_prefill_equals_prefill_then_decode_fast(tiny, fast_step, n, k):
    cfg, _, params = tiny
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 13))
    _check_prefill_vs_decode(cfg, fast_step, params, tokens, n, k, bitwise=False)


@pytest.mark.slow
@pytest.mark.parametrize("n, k", PAIRS)
def test_prefill_equals_prefill_then_decode_exact(tiny, n, k):
    cfg, graphdef, params = tiny
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 13))
    with jax.enable_x64(True):
        _check_prefill_vs_decode(cfg, make_step(graphdef, Runtime(mode="exact")), params, tokens, n, k, bitwise=True)


def test_causality(tiny, fast_step):
    cfg, _, params = tiny
    rng = np.random.default_rng(1)
    a = rng.integers(0, cfg.vocab_size, size=(2, 13))
    b = a.copy()
    t = 6
    b[:, t + 1:] = rng.integers(0, cfg.vocab_size, size=(2, 13 - t - 1))
    la, _, _ = _run(fast_step, params, cfg, a, [13])
    lb, _, _ = _run(fast_step, params, cfg, b, [13])
    np.testing.assert_array_equal(la[:, :t + 1], lb[:, :t + 1])
    assert not np.array_equal(la[:, t + 1:], lb[:, t + 1:])


def test_batch_rows_are_independent(tiny, fast_step):
    """Two different sequences in one batch give what each gives alone."""
    cfg, _, params = tiny
    toks = np.random.default_rng(2).integers(0, cfg.vocab_size, size=(2, 8))
    both, _, _ = _run(fast_step, params, cfg, toks, [5, 1, 1, 1])
    for i in range(2):
        alone, _, _ = _run(fast_step, params, cfg, np.concatenate([toks[i:i + 1], toks[i:i + 1]]), [5, 1, 1, 1])
        np.testing.assert_allclose(both[i], alone[0], rtol=1e-5, atol=1e-5)


def test_cache_entries_have_the_packed_byte_sizes(tiny):
    cfg, _, _ = tiny
    cache = init_cache(cfg, 1)
    assert kv_layout.row_bytes(cache["window"][0]) == cfg.head_dim + cfg.head_dim // 32
    for c in cache["compressed"].values():
        assert kv_layout.row_bytes(c) == cfg.head_dim // 2 + cfg.head_dim // 16


def test_bad_tokens_and_too_long_prompt(tiny):
    cfg, _, _ = tiny
    with pytest.raises(ValueError, match="token id 512 is out of range"):
        check_inputs(cfg, np.array([[1, 512]]), np.zeros(1, int))
    with pytest.raises(ValueError, match="token id -3"):
        check_inputs(cfg, np.array([[-3, 1]]), np.zeros(1, int))
    with pytest.raises(ValueError, match="max_seq_len=32"):
        check_inputs(cfg, np.zeros((1, 30), int), np.array([5]))
    check_inputs(cfg, np.zeros((1, 30), int), np.array([2]))
