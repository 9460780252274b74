"""Operand views of the TPU GEMM kernels: 32-bit weight words and activation planes.

The TPU kernels decode weights from uint32 words (Mosaic is safest on 32-bit data) into 8 planes:
element k = 8j + n of a weight row lands in plane n, lane j (the same order as the cache views in
`dsv41_jax.numerics.kv_layout`). The activations are split the same way along K (`activation_planes`), so
the product is sum_n x_n . w_n^T. Weights are static, so a serving stack builds the word views
once, when it prepares the params for a plan that runs the kernels (`fp8_weight_view` and
`fp4_weight_words`, called by `dsv41_jax.model.kernel_weights.kernel_params`), and the kernels take them as they are: on TPU converting
uint8 to uint32 is a relayout copy of the whole weight, which a per-call conversion would pay on
every step. A word view holds the stored bytes (and K's zero padding, FP8 only), so it takes the
place of the bytes without growing the weights.
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


def fp8_weight_view(w: jax.Array) -> jax.Array:
    """E4M3 [N, K] -> the FP8 kernel's word view int32 [2, N, Kp/8], Kp = K rounded up to 32 (zero
    bytes, which the kernel's zero-padded activation multiplies): plane 0 is `fp8_weight_words`'
    low words, plane 1 its high words. One array, so a params tree keeps one leaf per weight."""
    if w.ndim != 2 or w.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"fp8_weight_view: needs an E4M3 weight [N, K], got {w.dtype} {tuple(w.shape)}")
    pad = -w.shape[1] % 32
    if pad:
        w = jnp.pad(w, ((0, 0), (0, pad)))
    return jnp.stack(fp8_weight_words(w))


def is_words(w) -> bool:
    """Whether a weight operand is already a word view (int32) rather than the stored bytes."""
    return w.dtype == jnp.int32


def activation_planes(x: jax.Array) -> jax.Array:
    """[M, K] -> [8, M, K/8] with out[n, m, j] = x[m, 8j + n]."""
    m, k = x.shape
    return x.reshape(m, k // 8, 8).transpose(2, 0, 1)
