"""Single-pass mHC at one sublayer site: mixes from the stream, collapse (pre) and expand (post).

Each site computes pre/post/comb from the residual stream; its `pre` is used by the *next*
site (docs/REFERENCE.md §3 "Single-pass"), so a site collapses with the pre it was handed.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.numerics.exact_ops import no_fma, sum_in_order
from dsv41_jax.layers.basic import inv_sqrt, matmul, mean_square
from dsv41_jax.layers.mhc import sinkhorn_split


class HyperSite(nnx.Module):
    """Phi [(2+hc)*hc, hc*d], base [(2+hc)*hc], scale [3], all fp32."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        hc, d = cfg.hc_mult, cfg.dim
        mix = (2 + hc) * hc
        self.hc, self.iters, self.hc_eps, self.norm_eps = hc, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps
        self.fn = nnx.Param(jax.random.normal(rngs.params(), (mix, hc * d), jnp.float32) / (hc * d) ** 0.5)
        base = jax.random.normal(rngs.params(), (mix,), jnp.float32) * 0.5
        base = base.at[2 * hc:].add(2.0 * jnp.eye(hc, dtype=jnp.float32).reshape(-1))
        self.base = nnx.Param(base)
        self.scale = nnx.Param(jax.random.uniform(rngs.params(), (3,), jnp.float32, 0.5, 1.5))

    def mixes(self, h: jax.Array, mode: str):
        """(pre [B,T,hc], post [B,T,hc], comb [B,T,hc,hc]) from the stream h [B,T,hc,d]."""
        x = h.reshape(*h.shape[:-2], -1).astype(jnp.float32)
        # exact mode sums in torch's CPU order: with a float64 or XLA tree mean ~5 % of the
        # oracle's coefficients were one ulp off, enough to flip bf16 roundings downstream
        rs = inv_sqrt(mean_square(x, mode) + jnp.float32(self.norm_eps), mode)
        m = matmul(x, self.fn[...], "...k,mk->...m", jnp.float32, mode) * rs
        # exact: torch.sigmoid's SLEEF body + glibc tail of the oracle's [T, hc] call (docs/NUMERICS.md)
        return sinkhorn_split(m, self.scale[...], self.base[...], self.hc, self.iters, self.hc_eps,
                              exp_impl="torch" if mode == "exact" else "sleef")


def collapse(h: jax.Array, pre: jax.Array) -> jax.Array:
    """sum_j pre_j X_j in fp32, returned in the stream dtype."""
    return sum_in_order(no_fma(pre[..., None] * h.astype(jnp.float32)), axis=-2)[..., 0, :].astype(h.dtype)


def expand(y: jax.Array, h: jax.Array, post: jax.Array, comb: jax.Array) -> jax.Array:
    """X'_k = post_k y + sum_j comb[j,k] X_j (comb's first index is the source copy)."""
    mixed = sum_in_order(no_fma(comb[..., None] * h.astype(jnp.float32)[..., :, None, :]), axis=-3)[..., 0, :, :]
    return (no_fma(post[..., None] * y.astype(jnp.float32)[..., None, :]) + mixed).astype(y.dtype)
