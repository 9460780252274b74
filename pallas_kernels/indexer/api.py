"""`indexer_scores` with the impl switch, plus the XLA candidate pool and top-k.

The scores take packed MXFP4 queries and index keys, so they carry no gradient (the indexer's
training loss, docs/REFERENCE.md §7, differentiates the model's own jnp scoring path instead).
"""
from __future__ import annotations

import functools

import jax

from dsv41_jax.numerics import kv_layout
from pallas_kernels.common.backend import resolve
from pallas_kernels.common.partition import per_device
from pallas_kernels.indexer.reference import candidate_pool, indexer_scores_reference, topk_indices

__all__ = ["indexer_scores", "candidate_pool", "topk_indices"]


def _validate(q_packed, q_scale, keys, weights, compress_len, pool_mask) -> None:
    if q_packed.ndim != 4:
        raise ValueError(f"indexer_scores: q_packed must be [B, S, Hi, Di/2], got shape {q_packed.shape}")
    B, S, Hi, half = q_packed.shape
    Di = 2 * half
    if Di % 32:
        raise ValueError(f"indexer_scores: index head dim {Di} must be a multiple of 32 (one E8M0 scale per 32)")
    if q_scale.shape != (B, S, Hi, Di // 32):
        raise ValueError(f"indexer_scores: q_scale must be [{B}, {S}, {Hi}, {Di // 32}], got {q_scale.shape}")
    if not isinstance(keys, (kv_layout.IndexKeys, kv_layout.IndexKeyWords)):
        raise TypeError(f"indexer_scores: keys must be a kv_layout.IndexKeys or IndexKeyWords, got {type(keys).__name__}")
    if keys.packed.ndim != 3 or keys.packed.shape[0] != B or kv_layout.dim_of(keys) != Di:
        raise ValueError(f"indexer_scores: keys must be [B={B}, G, Di={Di}] rows, got "
                         f"{keys.packed.shape[:2] + (kv_layout.dim_of(keys),)}")
    if weights.shape != (B, S, Hi):
        raise ValueError(f"indexer_scores: weights must be [{B}, {S}, {Hi}], got {weights.shape}")
    if compress_len.shape != (B, S):
        raise ValueError(f"indexer_scores: compress_len must be [{B}, {S}], got {compress_len.shape}")
    G = keys.packed.shape[1]
    if pool_mask is not None and pool_mask.shape != (B, S, G):
        raise ValueError(f"indexer_scores: pool_mask must be [{B}, {S}, {G}] or None, got {pool_mask.shape}")


def indexer_scores(
    q_packed: jax.Array,
    q_scale: jax.Array,
    keys: kv_layout.IndexKeys,
    weights: jax.Array,
    compress_len: jax.Array,
    pool_mask: jax.Array | None = None,
    *,
    bf16_rounding: bool = False,
    impl: str = "auto",
    interpret: bool | None = None,
    platform: str | None = None,
    mode: str = "fast",
) -> jax.Array:
    """I[b, s, g] = sum_h weights[b,s,h] * ReLU(q[b,s,h] . k[b,g]) as f32 [B, S, G] (docs/REFERENCE.md §3).

    q_packed uint8 [B, S, Hi, Di/2] + q_scale uint8 E8M0 [B, S, Hi, Di/32] (MXFP4 queries, as
    `quant.quant_fp4_mx` makes them); keys: IndexKeys [B, G, Di] (or the TPU kernel's word view
    `kv_layout.IndexKeyWords`, read as it is); weights f32 [B, S, Hi];
    compress_len int32 [B, S]: entry g is visible iff g < compress_len; pool_mask bool [B, S, G]
    or None. Invisible or out-of-pool entries are -inf. bf16_rounding: round at the reference's
    bf16 storage points (see reference.py). impl / interpret / platform: as in
    `sparse_sink_attention`. mode: "fast" (f32 dots) or "exact" (float64 dots rounded once through
    f32, the model's exact mode; implies bf16_rounding; with a kernel it needs the TPU kernel in
    interpret mode, as float64 cannot be compiled for TPU or Triton).
    """
    if mode not in ("fast", "exact"):
        raise ValueError(f"indexer_scores: mode must be 'fast' or 'exact', got {mode!r}")
    _validate(q_packed, q_scale, keys, weights, compress_len, pool_mask)
    choice = resolve(impl, interpret, platform)
    exact = mode == "exact"
    bf16_rounding = bf16_rounding or exact
    if choice.kind == "xla":
        return indexer_scores_reference(q_packed, q_scale, keys, weights, compress_len, pool_mask,
                                        bf16_rounding=bf16_rounding, exact=exact)
    if exact and (choice.kind != "tpu" or not choice.interpret):
        raise ValueError("indexer_scores(mode='exact') with a kernel needs platform='tpu' (the default on CPU) and "
                         f"interpret=True, got platform={choice.kind!r}, interpret={choice.interpret}")
    if choice.kind == "tpu":
        # deferred: each backend's kernel module loads for that backend only
        from pallas_kernels.indexer.tpu import indexer_scores_tpu as kernel
    else:
        # deferred: each backend's kernel module loads for that backend only
        from pallas_kernels.indexer.gpu import indexer_scores_gpu as kernel
    extra = {"exact": True} if exact else {}
    call = functools.partial(kernel, bf16_rounding=bf16_rounding, interpret=choice.interpret, **extra)
    # on a mesh, per device: rows split over the batch axes; the heads stay whole (their sum is
    # rounded in the kernel's order, which a split over devices would change)
    b = ("batch",)
    return per_device(call, (q_packed, q_scale, keys, weights, compress_len, pool_mask), (b,) * 6, b,
                      batch=q_packed.shape[0])
