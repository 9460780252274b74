"""mhc.sinkhorn_split against the golden Sinkhorn vectors; sleef_exp against a float64 emulation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.layers.mhc import sinkhorn_split
from dsv41_jax.numerics.sleef_exp import expf_u10
from tests.support.kernel_vectors import bits, kernel_vectors
from tests.support.sleef_reference import sleef_expf_reference


@pytest.fixture(scope="module")
def vec(golden_root):
    return kernel_vectors(golden_root)


def _inputs(vec):
    return (jnp.asarray(vec["sinkhorn.mixes"]), jnp.asarray(vec["sinkhorn.hc_scale"]),
            jnp.asarray(vec["sinkhorn.hc_base"]))


@pytest.mark.parametrize("iters", [20, 1, 3])
@pytest.mark.parametrize("jit", [False, True])
def test_bit_exact_against_golden(vec, iters, jit):
    fn = lambda m, s, b: sinkhorn_split(m, s, b, 4, iters, 1e-6, exp_impl="torch")  # noqa: E731
    with jax.enable_x64(True):
        pre, post, comb = (jax.jit(fn) if jit else fn)(*_inputs(vec))
    assert comb.shape == (9, 4, 4) and comb.dtype == jnp.float32
    np.testing.assert_array_equal(bits(pre), bits(vec[f"sinkhorn.iters{iters}.pre"]))
    np.testing.assert_array_equal(bits(post), bits(vec[f"sinkhorn.iters{iters}.post"]))
    np.testing.assert_array_equal(bits(comb), bits(vec[f"sinkhorn.iters{iters}.comb"]))


def test_xla_exp_variant_is_within_one_ulp(vec):
    for iters in (20, 1, 3):
        out = sinkhorn_split(*_inputs(vec), 4, iters, 1e-6, exp_impl="xla")
        for got, name in zip(out, ("pre", "post", "comb")):
            ref = vec[f"sinkhorn.iters{iters}.{name}"]
            ulps = np.abs(bits(got).astype(np.int64) - bits(ref).astype(np.int64))
            assert ulps.max() <= 1, (iters, name)


def test_leading_dims_and_doubly_stochastic():
    rng = np.random.default_rng(0)
    mixes = jnp.asarray(rng.standard_normal((2, 3, 24)), jnp.float32)
    scale = jnp.asarray([1.0, 1.0, 1.0], jnp.float32)
    base = jnp.asarray(rng.standard_normal(24), jnp.float32)
    pre, post, comb = sinkhorn_split(mixes, scale, base, 4, 20, 1e-6)
    assert pre.shape == (2, 3, 4) and post.shape == (2, 3, 4) and comb.shape == (2, 3, 4, 4)
    np.testing.assert_allclose(np.asarray(comb).sum(-2), 1.0, atol=1e-5)
    np.testing.assert_allclose(np.asarray(comb).sum(-1), 1.0, atol=1e-3)
    assert (np.asarray(post) > 0).all() and (np.asarray(post) < 2).all()


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="expected \\(2\\+hc\\)\\*hc = 24"):
        sinkhorn_split(jnp.zeros((2, 20)), jnp.ones(3), jnp.zeros(24), 4, 20, 1e-6)


# ----------------------------------------------------------------------------- SLEEF exp


@pytest.mark.parametrize("lo, hi", [(-87.0, 88.0), (-30.0, 5.0), (-1e-3, 1e-3)])
def test_expf_u10_matches_float64_emulation(lo, hi):
    x = np.random.default_rng(int(hi)).uniform(lo, hi, 200_000).astype(np.float32)
    ref = sleef_expf_reference(x)
    np.testing.assert_array_equal(bits(jax.jit(expf_u10)(x)), bits(ref))
    np.testing.assert_array_equal(bits(expf_u10(x)), bits(ref))


def test_expf_u10_special_values():
    x = np.array([0.0, -0.0, -105.0, 105.0, np.inf, -np.inf, np.nan], np.float32)
    out = np.asarray(expf_u10(x))
    np.testing.assert_array_equal(out[:6], [1.0, 1.0, 0.0, np.inf, np.inf, 0.0])
    assert np.isnan(out[6])


def test_sigmoid_scalar_tail_matches_dspark_traces(golden_root):
    """The DSpark traces hold the oracle's mHC coefficients of 5-token calls: 20 sigmoid inputs per
    call, all on torch's scalar path (glibc expf). SLEEF alone is 1 ulp off on ~6 % of them; the
    "torch" impl (SLEEF body, glibc tail) must match every one."""
    from pathlib import Path

    from safetensors import safe_open

    from dsv41_jax.layers.basic import inv_sqrt, matmul, mean_square

    folder = Path(golden_root) / "dspark_fp8"
    case = folder / "dspark_P40_S20.safetensors"
    if not case.exists():
        pytest.skip("dspark_fp8 traces not in the golden folder")
    with safe_open(str(case), "flax") as fh, safe_open(str(folder / "weights.safetensors"), "flax") as wf:
        checked = 0
        with jax.enable_x64(True):
            for k in range(3):
                x = fh.get_tensor(f"trace.dspark.stage{k}.block_input").astype(jnp.float32)  # [S,5,4,d]
                x = x.reshape(*x.shape[:2], -1)
                fn = wf.get_tensor(f"mtp.{k}.hc_attn_fn")
                rs = inv_sqrt(mean_square(x, "exact") + jnp.float32(1e-20), "exact")
                m = matmul(x, fn, "...k,mk->...m", jnp.float32, "exact") * rs
                scale, base = wf.get_tensor(f"mtp.{k}.hc_attn_scale"), wf.get_tensor(f"mtp.{k}.hc_attn_base")
                pre, post, _ = jax.jit(lambda m: sinkhorn_split(m, scale, base, 4, 20, 1e-6, exp_impl="torch"))(m)
                for part, got in (("pre", pre), ("post", post)):
                    ref = np.asarray(fh.get_tensor(f"trace.dspark.stage{k}.hc_attn_{part}"))
                    np.testing.assert_array_equal(bits(got), bits(ref), err_msg=f"stage {k} {part}")
                    checked += ref.size
    assert checked == 3 * 2 * 20 * 5 * 4


@pytest.mark.parametrize("exp_impl", ["xla", "sleef"])
def test_loop_equals_the_unrolled_rounds(exp_impl):
    """The (row, column) rounds run in a fori_loop (one body per program); they equal the unrolled chain bit for bit."""
    from dsv41_jax.numerics.exact_ops import sum_in_order, true_divide

    rng = np.random.default_rng(1)
    mixes = jnp.asarray(rng.standard_normal((3, 5, 24)) * 3, jnp.float32)
    scale, base = jnp.asarray([0.7, 1.3, 2.0], jnp.float32), jnp.asarray(rng.standard_normal(24), jnp.float32)
    eps = jnp.float32(1e-6)
    for iters in (1, 2, 20):
        _, _, comb = jax.jit(lambda m: sinkhorn_split(m, scale, base, 4, iters, 1e-6, exp_impl=exp_impl))(mixes)
        _, _, first = sinkhorn_split(mixes, scale, base, 4, 1, 1e-6, exp_impl=exp_impl)

        @jax.jit
        def unrolled(c):
            for _ in range(iters - 1):
                c = true_divide(c, sum_in_order(c, -1) + eps)
                c = true_divide(c, sum_in_order(c, -2) + eps)
            return c
        np.testing.assert_array_equal(bits(comb), bits(unrolled(first)))
