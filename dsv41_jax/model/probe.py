"""Observers of the layer body: forced decisions and their agreement (golden-check, DSpark stages)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def tie_aware_equal(scores: jax.Array, own: jax.Array, ref: jax.Array) -> jax.Array:
    """Per row: do two index sets agree, up to exact ties at the selection boundary?

    own/ref: [..., K] with -1 padding. The sets may differ only in elements whose score equals
    the lowest selected score of `own` (a tie the oracle broke differently).
    """
    def member(a, b):
        return jnp.any((a[..., :, None] == b[..., None, :]) & (b[..., None, :] >= 0), axis=-1) & (a >= 0)

    own_only = (own >= 0) & ~member(own, ref)
    ref_only = (ref >= 0) & ~member(ref, own)
    s_own = jnp.take_along_axis(scores, jnp.maximum(own, 0), -1)
    s_ref = jnp.take_along_axis(scores, jnp.maximum(ref, 0), -1)
    bound = jnp.min(jnp.where(own >= 0, s_own, jnp.inf), -1, keepdims=True)
    same_count = jnp.sum(own >= 0, -1) == jnp.sum(ref >= 0, -1)
    ok_own = jnp.all(~own_only | (s_own == bound), -1)
    ok_ref = jnp.all(~ref_only | (s_ref == bound), -1)
    return same_count & ok_own & ok_ref
