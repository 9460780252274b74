"""Sparse attention with a per-head sink over gathered KV slots: the XLA reference (docs/REFERENCE.md §3).

    o_h = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{a_h}),  s_j = scale * q_h . kv[idx_j],  K = V

Index -1 marks an empty slot; a query row with no valid slot outputs 0. Duplicate indices count
twice (the reference does not de-duplicate).

``mode="exact"`` mirrors the golden oracle's ``sparse_attn`` (golden README, oracle choices 1
and 2): exact (float64) dot products rounded once to float32, an online softmax over 64-wide blocks
of index slots in order, P rounded to bf16 for P.V only (the denominator keeps float32 P), the sink
added to the denominator at the end, torch's CPU exp (``torch.exp`` is MKL's ``vmsExp``: `mkl_exp`),
no FMA contraction. It needs
``jax.enable_x64(True)``. Details the golden vectors cannot tell apart, chosen here: the score is
f32(dot) * f32(scale) (scale is 2^-3 in the vectors), a block's P sum is taken in float64 and
rounded once, and the final normalisation is a true division.

``mode="fast"`` is one plain softmax over all slots in float32 (XLA exp, float32 accumulation),
with the same bf16 rounding of P for P.V; it agrees with exact mode to bf16 rounding.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.numerics.exact_ops import no_fma, true_divide
from dsv41_jax.numerics.mkl_exp import expf_mkl

MODES = ("fast", "exact")


def _check(q, kv, sink, idx, mode, block):
    if mode not in MODES:
        raise ValueError(f"sparse_attention: mode must be one of {MODES}, got {mode!r}")
    if q.ndim != 4 or kv.ndim != 3 or idx.ndim != 3:
        raise ValueError(
            "sparse_attention: expected q [B,S,H,D], kv [B,N,D], idx [B,S,K]; got "
            f"{tuple(q.shape)}, {tuple(kv.shape)}, {tuple(idx.shape)}"
        )
    b, s, h, d = q.shape
    if kv.shape[0] != b or kv.shape[2] != d or idx.shape[:2] != (b, s):
        raise ValueError(
            f"sparse_attention: shapes disagree: q {tuple(q.shape)}, kv {tuple(kv.shape)} "
            f"(need [{b}, N, {d}]), idx {tuple(idx.shape)} (need [{b}, {s}, K])"
        )
    if tuple(sink.shape) != (h,):
        raise ValueError(f"sparse_attention: sink must be [{h}] (one per head), got {tuple(sink.shape)}")
    if not jnp.issubdtype(idx.dtype, jnp.integer):
        raise TypeError(f"sparse_attention: idx must be an integer array, got {idx.dtype}")
    if block < 1:
        raise ValueError(f"sparse_attention: block must be >= 1, got {block}")


def _gather(kv: jax.Array, idx: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Rows kv[b, idx[b, s, k]] as [B, S, K, D], and the validity mask [B, S, K]."""
    valid = idx >= 0
    safe = jnp.where(valid, idx, 0).astype(jnp.int32)
    rows = jax.vmap(lambda kv_b, idx_b: jnp.take(kv_b, idx_b, axis=0))(kv, safe)
    return rows, valid


def _fast(q, rows, valid, sink, scale, keep_nonfinite=False):
    f32 = jnp.float32
    scores = jnp.einsum(
        "bshd,bskd->bshk", q.astype(f32), rows.astype(f32), precision=jax.lax.Precision.HIGHEST
    ) * f32(scale)
    mask = valid[:, :, None, :]
    scores = jnp.where(mask, scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.where(mask, jnp.exp(scores - m_safe), 0.0)
    denom = jnp.sum(p, axis=-1) + jnp.exp(sink.astype(f32)[None, None, :] - m_safe[..., 0])
    pv = jnp.einsum(
        "bshk,bskd->bshd",
        p.astype(jnp.bfloat16).astype(f32),
        rows.astype(f32),
        precision=jax.lax.Precision.HIGHEST,
    )
    out = pv / denom[..., None]
    attended = jnp.any(mask, axis=-1, keepdims=True) if keep_nonfinite else jnp.isfinite(m)
    return jnp.where(attended, out, 0.0)


def _exact(q, rows, valid, sink, scale, block, keep_nonfinite=False):
    if jax.dtypes.canonicalize_dtype(jnp.float64) != jnp.float64:
        raise RuntimeError(
            "sparse_attention(mode='exact') computes dots in float64, but 64-bit types are "
            "disabled; wrap the call in `with jax.enable_x64(True):` (or use mode='fast')"
        )
    f32, f64 = jnp.float32, jnp.float64
    b, s, h, d = q.shape
    k = rows.shape[2]
    n_blocks = -(-k // block)
    pad = n_blocks * block - k
    rows = jnp.pad(rows, ((0, 0), (0, 0), (0, pad), (0, 0)))
    valid = jnp.pad(valid, ((0, 0), (0, 0), (0, pad)))
    # [n_blocks, B, S, block, D] and [n_blocks, B, S, block] so scan walks the blocks in order
    rows_blocks = jnp.moveaxis(rows.reshape(b, s, n_blocks, block, d), 2, 0)
    valid_blocks = jnp.moveaxis(valid.reshape(b, s, n_blocks, block), 2, 0)
    q64 = q.astype(f64)
    scale = f32(scale)

    def step(carry, blk):
        m, l, acc = carry  # [B,S,H], [B,S,H], [B,S,H,D]
        rows_b, valid_b = blk
        rows64 = rows_b.astype(f64)
        scores = no_fma(jnp.einsum("bshd,bskd->bshk", q64, rows64).astype(f32) * scale)
        mask = valid_b[:, :, None, :]
        scores = jnp.where(mask, scores, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
        m_use = jnp.where(jnp.isfinite(m_new), m_new, f32(0.0))
        alpha = expf_mkl(m - m_use)  # 0 while nothing was valid yet
        p = jnp.where(mask, expf_mkl(scores - m_use[..., None]), f32(0.0))
        p_sum = jnp.sum(p.astype(f64), axis=-1).astype(f32)
        pv = jnp.einsum("bshk,bskd->bshd", p.astype(jnp.bfloat16).astype(f64), rows64).astype(f32)
        l = no_fma(l * alpha) + p_sum
        acc = no_fma(acc * alpha[..., None]) + pv
        return (m_new, l, acc), None

    init = (
        jnp.full((b, s, h), -jnp.inf, f32),
        jnp.zeros((b, s, h), f32),
        jnp.zeros((b, s, h, d), f32),
    )
    (m, l, acc), _ = jax.lax.scan(step, init, (rows_blocks, valid_blocks))
    any_valid = jnp.isfinite(m)
    m_use = jnp.where(any_valid, m, f32(0.0))
    denom = l + expf_mkl(sink.astype(f32)[None, None, :] - m_use)
    out = true_divide(acc, denom[..., None])
    attended = jnp.any(valid, axis=-1)[:, :, None] if keep_nonfinite else any_valid
    return jnp.where(attended[..., None], out, f32(0.0))


def sparse_attention(
    q: jax.Array,
    kv: jax.Array,
    sink: jax.Array,
    idx: jax.Array,
    scale: float,
    *,
    mode: str = "fast",
    block: int = 64,
    keep_nonfinite: bool = False,
) -> jax.Array:
    """Attention of q [B,S,H,D] over kv [B,N,D] rows picked by idx [B,S,K] (-1 = empty).

    sink [H] (float32 logits, added to the denominator only); returns [B,S,H,D] in q.dtype.
    `block` is the online-softmax block width of exact mode (64 in the reference kernel).
    A row with no valid index is fully masked and gives zeros. By default (the reference's rule)
    so does any row whose running max is not finite, which also hides NaN/inf scores;
    keep_nonfinite=True (`Runtime.check_finite`) zeroes only the masked rows and lets NaN/inf
    through, so the logits show them. Static: the default graph is unchanged.
    Indices must lie in [-1, N); larger ones are clamped by the gather, not reported.
    """
    q, kv, sink, idx = (jnp.asarray(a) for a in (q, kv, sink, idx))
    _check(q, kv, sink, idx, mode, block)
    rows, valid = _gather(kv, idx)
    if mode == "fast":
        out = _fast(q, rows, valid, sink, scale, keep_nonfinite)
    else:
        out = _exact(q, rows, valid, sink, scale, block, keep_nonfinite)
    return out.astype(q.dtype)
