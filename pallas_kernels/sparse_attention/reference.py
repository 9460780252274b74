"""Plain-jnp sparse sink attention over the quantized caches: the oracle and the XLA path.

It dequantizes both caches with `dsv41_jax.kv_layout`, concatenates them (window rows first, then
compressed rows, as the reference's `torch.cat([kv, compress_kv])` does; reference model.py:
Attention.forward), shifts the compressed indices past the window rows, and calls the model's
`dsv41_jax.sparse_attention.sparse_attention`, so the kernels share one definition of the math.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax import kv_layout


def combined_kv_and_indices(window, compressed, window_idx, compressed_idx, dtype):
    """(kv [B, Nw+G, D] in `dtype`, idx [B, S, Kw+Kc]): the single KV and index list of the reference."""
    parts, idx = [], []
    n_win = 0
    if window is not None and window_idx is not None and window_idx.shape[-1] > 0:
        kv_w = kv_layout.dequantize_window(window).astype(dtype)
        parts.append(kv_w)
        idx.append(window_idx.astype(jnp.int32))
        n_win = kv_w.shape[1]
    if compressed is not None and compressed_idx is not None and compressed_idx.shape[-1] > 0:
        parts.append(kv_layout.dequantize_compressed(compressed).astype(dtype))
        cidx = compressed_idx.astype(jnp.int32)
        idx.append(jnp.where(cidx >= 0, cidx + n_win, -1))
    return jnp.concatenate(parts, axis=1), jnp.concatenate(idx, axis=-1)


def sparse_sink_attention_reference(q, window, compressed, window_idx, compressed_idx, sink, scale, *, mode="fast"):
    """o[B, S, H, D] in q.dtype; see `pallas_kernels.sparse_sink_attention` for the contract."""
    from dsv41_jax.sparse_attention import sparse_attention

    has_win = window is not None and window_idx is not None and window_idx.shape[-1] > 0
    has_comp = compressed is not None and compressed_idx is not None and compressed_idx.shape[-1] > 0
    if not (has_win or has_comp):
        return jnp.zeros_like(q)
    kv, idx = combined_kv_and_indices(window, compressed, window_idx, compressed_idx, q.dtype)
    return sparse_attention(q, kv, sink, idx, scale, mode=mode)
