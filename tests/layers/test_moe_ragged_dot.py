"""`moe.ragged_dot`: jax's ragged dot with its weight gradient over padded groups (the form XLA:TPU compiles
at the released 384 experts) gives jax's own values and gradients bit for bit."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dsv41_jax.layers import moe


def _bits(tree):
    return [np.atleast_1d(np.asarray(a)).view(np.uint8) for a in jax.tree.leaves(tree)]


@pytest.mark.parametrize("groups,rows,absent", [(8, 96, [3]), (200, 300, [0, 7, 199])])
def test_ragged_dot_and_its_gradients_equal_jax_bit_for_bit(groups, rows, absent):
    """8 groups (the tiny model's experts: no padding) and 200 (padded to 512 for the weight gradient),
    some groups empty, as experts no row routes to are."""
    assert (groups > moe.GROUP_PAD_ABOVE) == (groups == 200)
    k, n = 64, 32
    x = jax.random.normal(jax.random.key(0), (rows, k), jnp.float32).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (groups, k, n), jnp.float32).astype(jnp.bfloat16)
    experts = np.sort(np.random.RandomState(0).choice(np.setdiff1d(np.arange(groups), absent), rows))
    sizes = jnp.asarray(np.bincount(experts, minlength=groups), jnp.int32)

    def loss(dot):
        return lambda x, w: jnp.sum(jnp.sin(dot(x, w)))  # a cotangent that differs per element

    want = jax.jit(jax.value_and_grad(loss(lambda x, w: jax.lax.ragged_dot(
        x, w, sizes, preferred_element_type=jnp.float32)), argnums=(0, 1)))(x, w)
    got = jax.jit(jax.value_and_grad(loss(lambda x, w: moe.ragged_dot(x, w, sizes)), argnums=(0, 1)))(x, w)
    assert all(np.array_equal(a, b) for a, b in zip(_bits(want), _bits(got)))
    assert np.all(np.asarray(got[1][1])[absent] == 0)  # empty groups take no gradient
