"""Operand views of the TPU GEMM kernels: 32-bit weight words and activation planes.

The TPU kernels decode weights from uint32 words (Mosaic is safest on 32-bit data) into 8 planes:
element k = 8j + n of a weight row lands in plane n, lane j (the same order as the cache views in
`dsv41_jax.numerics.kv_layout`). The activations are split the same way along K (`activation_planes`), so
the product is sum_n x_n . w_n^T. Weights are static, so a serving stack should build the word
view once at load time and pass it in (the kernels accept words directly); on TPU converting
uint8 to uint32 is a relayout copy.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _pack(b: jax.Array) -> jax.Array:
    b = b.astype(jnp.uint32).reshape(*b.shape[:-1], b.shape[-1] // 4, 4)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _pad_last(x: jax.Array, multiple: int) -> jax.Array:
    pad = -x.shape[-1] % multiple
    return x if pad == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


def as_i32(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, jnp.int32)


def fp4_weight_words(packed: jax.Array, scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """MXFP4 [..., N, K/2] bytes + E8M0 [..., N, K/32] -> int32 words [..., N, K/8] and [..., N, ceil(K/128)].

    Word j of a row holds packed bytes 4j..4j+3, so its nibble n is element 8j + n.
    """
    return as_i32(_pack(packed)), as_i32(_pack(_pad_last(scale, 4)))


def fp8_weight_words(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """E4M3 [N, K] (K a multiple of 8) -> (low, high) int32 words [N, K/8]: bytes 8j..8j+3 / 8j+4..8j+7."""
    b = jax.lax.bitcast_convert_type(w, jnp.uint8)
    b = b.reshape(*b.shape[:-1], b.shape[-1] // 8, 8)
    low = _pack(b[..., :4].reshape(*b.shape[:-2], -1))
    high = _pack(b[..., 4:].reshape(*b.shape[:-2], -1))
    return as_i32(low), as_i32(high)


def activation_planes(x: jax.Array) -> jax.Array:
    """[M, K] -> [8, M, K/8] with out[n, m, j] = x[m, 8j + n]."""
    m, k = x.shape
    return x.reshape(m, k // 8, 8).transpose(2, 0, 1)
