"""Spreading per-block scale bytes over the lanes of the 8-plane word view (TPU kernels).

In the word view (dsv41_jax.numerics.kv_layout, "kernel views") lane j of every plane holds elements
8j..8j+7, so with blocks of 16 or 32 elements all eight planes share one scale per lane:
byte 8j // block of the row. A matmul with a one-hot matrix is the cheap lane broadcast on TPU
(bytes <= 255 are exact in bf16, and each output sums exactly one non-zero product).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.common import bits


def _one_hot(n_words: int, lanes: int, block: int, byte: int) -> jax.Array:
    """[n_words, lanes] bf16: 1 where lane j's scale byte 8j // block is byte `byte` of word w."""
    w = jax.lax.broadcasted_iota(jnp.int32, (n_words, lanes), 0)
    j = jax.lax.broadcasted_iota(jnp.int32, (n_words, lanes), 1)
    return (bits.idiv(8 * j, block) == 4 * w + byte).astype(jnp.bfloat16)


def scale_byte_per_lane(words: jax.Array, lanes: int, block: int) -> jax.Array:
    """int32 scale words [K, n_words] -> int32 scale byte of each lane [K, lanes]."""
    n_words = words.shape[-1]
    acc = None
    for byte in range(4):
        part = jnp.dot(
            bits.byte_of_word(words, byte).astype(jnp.bfloat16),
            _one_hot(n_words, lanes, block, byte),
            preferred_element_type=jnp.float32,
        )
        acc = part if acc is None else acc + part
    return acc.astype(jnp.int32)
