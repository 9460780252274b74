"""Exact mode reproduces torch's CPU float32 reductions and transcendentals (what the oracle ran).

Oracle: the golden traces. The mHC coefficients of every traced site depend on one float32 mean
over hc*dim elements; they are bit-identical only if the mean is summed in torch's order and the
1/sqrt is not XLA's rsqrt (a float64 mean or XLA's tree sum is one ulp off in ~5 % of rows).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax.golden import data as golden_data
from dsv41_jax.numerics.exact_ops import torch_sum_axis, torch_sum_last


def _sites(gc, t):
    """(layer, site name, stream input) for every traced site with a known input."""
    for l in range(gc.cfg.n_layers):
        if f"trace.layer{l}.block_input" in t and f"trace.layer{l}.hc_attn_comb" in t:
            yield l, "attn", t[f"trace.layer{l}.block_input"]
        if f"trace.layer{l}.after_attn" in t and f"trace.layer{l}.hc_ffn_comb" in t:
            yield l, "ffn", t[f"trace.layer{l}.after_attn"]


@pytest.mark.parametrize("config", ["main_fp8", "engram_fp8", "main_bf16"])
def test_mhc_coefficients_bit_exact(golden_root, config):
    gcs = {g.name: g for g in golden_data.discover(golden_root)}
    if config not in gcs:
        pytest.skip(f"{config} not in the golden folder")
    gc = gcs[config]
    case = next((c for c in gc.cases if c.get("has_intermediates")), None)
    if case is None:
        pytest.skip(f"{config} has no traced case")
    t = gc.case_tensors(case)
    with jax.enable_x64(True):
        model = gc.load_model()
        checked = 0
        graphdef = nnx.split(model.layers[0].hc_attn)[0]  # every site has this structure
        mixes = jax.jit(lambda p, h: nnx.merge(graphdef, p).mixes(h, "exact"))
        for l, site_name, stream in _sites(gc, t):
            params = nnx.split(getattr(model.layers[l], f"hc_{site_name}"))[1]
            got = mixes(params, jnp.asarray(stream)[None])
            for part, value in zip(("pre", "post", "comb"), got):
                ref = t[f"trace.layer{l}.hc_{site_name}_{part}"]
                diff = int(np.sum(np.asarray(value)[0].reshape(ref.shape) != ref))
                assert diff == 0, f"layer {l} hc_{site_name}_{part}: {diff} of {ref.size} entries differ"
            checked += 1
    assert checked >= 2


def _torch_order_reference(x: np.ndarray) -> np.ndarray:
    """Plain-python float32 statement of torch's AVX2 inner sum for short rows (< 8 lanes):
    four interleaved accumulators over groups of four, leftovers into the first, then folded."""
    f = np.float32
    out = np.zeros(x.shape[:-1], f)
    n = x.shape[-1]
    for idx in np.ndindex(*x.shape[:-1]):
        row = x[idx]
        acc = [f(0)] * 4
        groups = n // 4
        for g in range(groups):
            for k in range(4):
                acc[k] = f(acc[k] + row[4 * g + k])
        for c in row[groups * 4:]:
            acc[0] = f(acc[0] + c)
        out[idx] = f(f(f(acc[0] + acc[1]) + acc[2]) + acc[3])
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 6, 7])
def test_short_row_sum_order(n):
    x = (np.random.default_rng(n).standard_normal((3, 5, n)) * np.array([1e4, 1.0, 1e-4])[:, None, None]).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(torch_sum_last)(x)), _torch_order_reference(x))


def test_strided_sum_is_sequential_up_to_sixteen():
    x = (np.random.default_rng(0).standard_normal((2, 16, 5)) * 100).astype(np.float32)
    expect = np.zeros((2, 5), np.float32)
    for k in range(16):
        expect = (expect + x[:, k]).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: torch_sum_axis(a, 1))(x)), expect)


def test_long_sums_stay_close_to_float64():
    x = np.random.default_rng(1).standard_normal((4, 20480)).astype(np.float32)
    got = np.asarray(jax.jit(torch_sum_last)(x)).astype(np.float64)
    exact = x.astype(np.float64).sum(-1)
    assert np.all(np.abs(got - exact) <= 1e-4 * np.abs(x).sum(-1))
