"""The plane order of the TPU kernels' head dimension, and how queries and outputs move in and out.

The TPU kernels decode 32-bit words of cached rows into 8 "planes" (dsv41_jax.numerics.kv_layout, "kernel
views"): element 8j + n of a row lands in plane n, lane j. Attention is invariant under a common
permutation of the head dimension of q, K and V, so the kernels work in that order throughout and
only the query (in) and the output (out) are permuted, here in XLA.
"""
from __future__ import annotations

import jax


def to_planes(x: jax.Array) -> jax.Array:
    """[..., H, D] -> [..., 8, H, D/8] with out[..., n, h, j] = x[..., h, 8j + n]."""
    *lead, h, d = x.shape
    x = x.reshape(*lead, h, d // 8, 8)
    nd = x.ndim
    return x.transpose(*range(nd - 3), nd - 1, nd - 3, nd - 2)


def from_planes(x: jax.Array) -> jax.Array:
    """Inverse of `to_planes`: [..., 8, H, D/8] -> [..., H, D]."""
    *lead, _, h, d8 = x.shape
    nd = x.ndim
    x = x.transpose(*range(nd - 3), nd - 2, nd - 1, nd - 3)
    return x.reshape(*lead, h, d8 * 8)
