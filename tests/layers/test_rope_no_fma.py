"""apply_rope rounds each product before the add, under jit as eagerly (torch's complex multiply).

XLA's CPU backend contracts a multiply and a following add into one FMA inside a fused loop; numpy
never does, so float32 numpy is the oracle here. Found through dspark_fp8/spec_greedy_P24_N40's
corrected drafts (steps 10 and 16 differed from the oracle under jit, not eagerly)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.layers.rope import apply_rope


@pytest.mark.parametrize("inverse", [False, True])
def test_apply_rope_under_jit_equals_two_roundings(inverse):
    rng = np.random.default_rng(7)
    S, H, D, R = 64, 8, 96, 64
    x = rng.standard_normal((1, S, H, D)).astype(np.float32)
    ang = rng.uniform(-3.2, 3.2, (1, S, R // 2)).astype(np.float32)
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    got = np.asarray(jax.jit(lambda *a: apply_rope(*a, R, inverse=inverse))(x, cos, sin))
    s = -sin if inverse else sin
    a, b = x[..., -R:][..., 0::2], x[..., -R:][..., 1::2]
    c, s = cos[:, :, None, :], s[:, :, None, :]
    want = np.stack([a * c - b * s, a * s + b * c], -1).reshape(1, S, H, R)  # numpy: two roundings each
    np.testing.assert_array_equal(got[..., :-R], x[..., :-R])
    assert np.array_equal(got[..., -R:], want), f"{int(np.sum(got[..., -R:] != want))} of {want.size} differ"
