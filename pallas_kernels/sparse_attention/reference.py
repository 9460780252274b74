"""Plain-jnp sparse sink attention over the quantized caches: the oracle and the XLA path.

It dequantizes both caches with `dsv41_jax.numerics.kv_layout`, concatenates them (window rows first, then
compressed rows, as the reference's `torch.cat([kv, compress_kv])` does; reference model.py:
Attention.forward), shifts the compressed indices past the window rows, and calls the model's
`dsv41_jax.numerics.sparse_attention` (in numerics, the one package kernels import), so the kernels share one definition of the math.
When the index lists are shorter than the caches (decode at long context), it gathers the
selected quantized rows first and dequantizes only those; dequantization is exact, so both
orders give the same numbers, but a 1M-entry cache is never expanded to bf16.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.numerics import kv_layout
from dsv41_jax.numerics.sparse_attention import sparse_attention


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


def _gather_rows(container, idx):
    """Rows container[b, idx[b, s, k]] of every array of a layout container: [B, S*K, ...]."""
    B, S, K = idx.shape
    flat = jnp.maximum(idx, 0).reshape(B, S * K)
    return type(container)(*(jax.vmap(lambda a, i: jnp.take(a, i, axis=0))(arr, flat) for arr in container))


def _gathered_first(window, compressed, window_idx, compressed_idx):
    """The same inputs, with each cache replaced by just the rows the index lists pick (S*K rows
    per batch entry) and the indices renumbered to point at them."""
    def renumber(idx):
        B, S, K = idx.shape
        local = jnp.arange(S * K, dtype=jnp.int32).reshape(1, S, K)
        return jnp.where(idx >= 0, local, -1)

    if window is not None and window_idx is not None and window_idx.shape[-1] > 0:
        window, window_idx = _gather_rows(window, window_idx), renumber(window_idx)
    if compressed is not None and compressed_idx is not None and compressed_idx.shape[-1] > 0:
        compressed, compressed_idx = _gather_rows(compressed, compressed_idx), renumber(compressed_idx)
    return window, compressed, window_idx, compressed_idx


def _rows(container, idx):
    return 0 if container is None or idx is None else int(container[0].shape[1])


def _slots(idx):
    return 0 if idx is None else int(idx.shape[1] * idx.shape[2])


def sparse_sink_attention_reference(q, window, compressed, window_idx, compressed_idx, sink, scale, *, mode="fast"):
    """o[B, S, H, D] in q.dtype; see `pallas_kernels.sparse_sink_attention` for the contract."""
    has_win = window is not None and window_idx is not None and window_idx.shape[-1] > 0
    has_comp = compressed is not None and compressed_idx is not None and compressed_idx.shape[-1] > 0
    if not (has_win or has_comp):
        return jnp.zeros_like(q)
    if _slots(window_idx) + _slots(compressed_idx) < _rows(window, window_idx) + _rows(compressed, compressed_idx):
        window, compressed, window_idx, compressed_idx = _gathered_first(window, compressed, window_idx, compressed_idx)
    kv, idx = combined_kv_and_indices(window, compressed, window_idx, compressed_idx, q.dtype)
    return sparse_attention(q, kv, sink, idx, scale, mode=mode)
