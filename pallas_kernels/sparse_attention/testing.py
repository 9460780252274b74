"""Test inputs and an independent float64 numpy oracle for sparse sink attention."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import jax.numpy as jnp

from dsv41_jax.numerics import kv_layout


def make_inputs(rng, B, S, H, D, Nw, G, Kw, Kc, *, kv_scale=1.0, q_scale=1.0, empty_frac=0.25):
    """Random bf16 queries, quantized caches, index lists with -1 slots, and sink logits."""
    q = jnp.asarray(rng.standard_normal((B, S, H, D)) * q_scale, jnp.bfloat16)
    kv_scale = np.broadcast_to(np.asarray(kv_scale, np.float64), (B,))[:, None, None]
    window = kv_layout.quantize_window(jnp.asarray(rng.standard_normal((B, Nw, D)) * kv_scale, jnp.float32))
    compressed = kv_layout.quantize_compressed(jnp.asarray(rng.standard_normal((B, G, D)) * kv_scale, jnp.float32))
    widx = np.where(rng.random((B, S, Kw)) < empty_frac, -1, rng.integers(0, Nw, (B, S, Kw)))
    cidx = np.where(rng.random((B, S, Kc)) < empty_frac, -1, rng.integers(0, G, (B, S, Kc)))
    sink = rng.standard_normal(H).astype(np.float32)
    return q, window, compressed, widx.astype(np.int32), cidx.astype(np.int32), sink


def oracle(q, window, compressed, widx, cidx, sink, scale):
    """float64 numpy: exact scores, P rounded to bf16 for P.V only, sink in the denominator."""
    kv_w = np.asarray(kv_layout.dequantize_window(window), np.float64)
    kv_c = None if compressed is None else np.asarray(kv_layout.dequantize_compressed(compressed), np.float64)
    q = np.asarray(q, np.float64)
    sink = np.asarray(sink, np.float64)
    B, S, H, D = q.shape
    out = np.zeros((B, S, H, D))
    for b in range(B):
        for s in range(S):
            rows = [kv_w[b, i] for i in np.asarray(widx[b, s]) if i >= 0]
            if kv_c is not None and cidx is not None:
                rows += [kv_c[b, i] for i in np.asarray(cidx[b, s]) if i >= 0]
            if not rows:
                continue
            k = np.stack(rows)
            scores = q[b, s] @ k.T * scale
            m = scores.max(axis=1, keepdims=True)
            p = np.exp(scores - m)
            p16 = p.astype(ml_dtypes.bfloat16).astype(np.float64)
            out[b, s] = (p16 @ k) / (p.sum(axis=1, keepdims=True) + np.exp(sink[:, None] - m))
    return out


def assert_close(out, ref, what=""):
    """bf16 outputs: a few bf16 ulps of the row scale."""
    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert np.all(np.isfinite(out)), f"{what}: non-finite output"
    tol = 2e-2 * np.maximum(np.abs(ref).max(axis=-1, keepdims=True), 1e-30)
    err = np.abs(out - ref)
    assert np.all(err <= tol), f"{what}: max error {err.max():.3g} (worst ratio {np.max(err / tol):.3g})"
