"""`grouped_fp4_gemm`, `fp8_block_gemm` and the routed-expert FFN built on them, with the impl switch.

No custom VJP: the weights are packed MXFP4 / FP8 storage (not differentiable here), and QAT
trains through the model's jnp path (dsv41_jax.numerics.gemm) instead.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dsv41_jax.numerics.activations import swiglu
from pallas_kernels.common.backend import resolve
from pallas_kernels.common.partition import per_device
from pallas_kernels.expert_gemm import layout
from pallas_kernels.expert_gemm.reference import fp8_block_gemm_reference, grouped_fp4_gemm_reference

__all__ = ["grouped_fp4_gemm", "fp8_block_gemm", "expert_gemm_moe"]


def _activation_shape(x) -> tuple[int, int]:
    if isinstance(x, (tuple, list)):
        q, s = x
        if q.ndim != 2 or s.shape != (q.shape[0], q.shape[1] // 32):
            raise ValueError(f"activation (e4m3, e8m0) must be [M, K] and [M, K/32], got {q.shape} and {s.shape}")
        return q.shape
    if x.ndim != 2:
        raise ValueError(f"activation must be [M, K], got shape {x.shape}")
    return x.shape


def _words_need_tpu(choice, what: str) -> None:
    if choice.kind != "tpu":
        raise ValueError(
            f"{what}: the weight is the TPU kernel's int32 word view, but this call runs the "
            f"{'XLA reference' if choice.kind == 'xla' else 'GPU kernel'}, which reads the stored bytes; pass the "
            f"stored weight (params prepared by dsv41_jax.model.kernel_weights.kernel_params only for a plan whose kernels "
            f"run on TPU or interpreted)")


def grouped_fp4_gemm(
    x_sorted, group_sizes: jax.Array, w_packed: jax.Array, w_scale: jax.Array, *,
    impl: str = "auto", interpret: bool | None = None, platform: str | None = None,
) -> jax.Array:
    """Ragged MXFP4 x FP8 GEMM: y[m] = FP8(x[m]) @ dequant(W[g(m)])^T as f32 [M, N].

    x_sorted: bf16/f32 [M, K] rows sorted by expert (quantized here to E4M3 with an E8M0 scale per
    32, as the reference's linear() does), or an already quantized (e4m3 [M, K], e8m0 [M, K/32])
    pair. group_sizes int32 [E]: rows per expert, in order; rows past their sum give 0.
    w_packed uint8 [E, N, K/2] (E2M1 pairs, even element in the low nibble), w_scale uint8 E8M0
    [E, N, K/32]; or, for the TPU kernel, both as their int32 word views [E, N, K/8] and
    [E, N, ceil(K/128)] (`layout.fp4_weight_words`, built once at load). Accumulation is f32; the
    weights are dequantized inside the kernel.
    """
    M, K = _activation_shape(x_sorted)
    if K % 32:
        raise ValueError(f"grouped_fp4_gemm: K = {K} must be a multiple of 32")
    words = layout.is_words(w_packed)
    per_row, scale_row, what = (K // 8, -(-K // 128), "int32 words") if words else (K // 2, K // 32, "uint8")
    if w_packed.ndim != 3 or w_packed.shape[2] != per_row or (words and w_packed.dtype != w_scale.dtype):
        raise ValueError(f"grouped_fp4_gemm: w_packed must be {what} [E, N, {per_row}] (K = {K}) with w_scale "
                         f"of the same kind, got {w_packed.dtype} {w_packed.shape} and {w_scale.dtype}")
    E, N, _ = w_packed.shape
    if w_scale.shape != (E, N, scale_row):
        raise ValueError(f"grouped_fp4_gemm: w_scale must be [{E}, {N}, {scale_row}], got {w_scale.shape}")
    if group_sizes.shape != (E,):
        raise ValueError(f"grouped_fp4_gemm: group_sizes must be [E = {E}], got {group_sizes.shape}")
    choice = resolve(impl, interpret, platform)
    if words:
        _words_need_tpu(choice, "grouped_fp4_gemm")
    if choice.kind == "xla":
        return grouped_fp4_gemm_reference(x_sorted, group_sizes, w_packed, w_scale)
    if choice.kind == "tpu":
        # deferred: each backend's kernel module loads for that backend only
        from pallas_kernels.expert_gemm.tpu import grouped_fp4_gemm_tpu as kernel
    else:
        # deferred: each backend's kernel module loads for that backend only
        from pallas_kernels.expert_gemm.gpu import grouped_fp4_gemm_gpu as kernel
    return kernel(x_sorted, group_sizes, w_packed, w_scale, interpret=choice.interpret)


def fp8_block_gemm(
    x, w_e4m3: jax.Array, w_scale: jax.Array, *,
    impl: str = "auto", interpret: bool | None = None, platform: str | None = None,
) -> jax.Array:
    """Dense FP8 GEMM: FP8(x) @ dequant(W)^T as f32 [M, N].

    x: bf16/f32 [M, K] (quantized here, E4M3 + E8M0 per 32) or an (e4m3, e8m0) pair; w_e4m3
    float8_e4m3fn [N, K], or for the TPU kernel its int32 word view [2, N, Kp/8] (Kp = K rounded up
    to 32; `layout.fp8_weight_view`, built once at load); w_scale uint8 E8M0 [ceil(N/32), ceil(K/32)],
    one per 32x32 tile (partial edge tiles allowed). f32 accumulation.
    """
    M, K = _activation_shape(x)
    words = layout.is_words(w_e4m3)
    if words:
        Kp = -(-K // 32) * 32
        if w_e4m3.ndim != 3 or w_e4m3.shape[0] != 2 or w_e4m3.shape[2] * 8 != Kp:
            raise ValueError(f"fp8_block_gemm: a word-view weight must be int32 [2, N, {Kp // 8}] (K = {K} padded "
                             f"to {Kp}, layout.fp8_weight_view), got {w_e4m3.shape}")
        N = w_e4m3.shape[1]
    else:
        if w_e4m3.ndim != 2 or w_e4m3.shape[1] != K or w_e4m3.dtype != jnp.float8_e4m3fn:
            raise ValueError(f"fp8_block_gemm: w_e4m3 must be float8_e4m3fn [N, K = {K}] (or its int32 word view), "
                             f"got {w_e4m3.dtype} {w_e4m3.shape}")
        N = w_e4m3.shape[0]
    if w_scale.shape != (-(-N // 32), -(-K // 32)):
        raise ValueError(f"fp8_block_gemm: w_scale must be [{-(-N // 32)}, {-(-K // 32)}], got {w_scale.shape}")
    choice = resolve(impl, interpret, platform)
    if words:
        _words_need_tpu(choice, "fp8_block_gemm")
    if choice.kind == "xla":
        return fp8_block_gemm_reference(x, w_e4m3, w_scale)
    if choice.kind == "tpu":
        # deferred: each backend's kernel module loads for that backend only
        from pallas_kernels.expert_gemm.tpu import fp8_block_gemm_tpu as kernel
    else:
        # deferred: each backend's kernel module loads for that backend only
        from pallas_kernels.expert_gemm.gpu import fp8_block_gemm_gpu as kernel
    # on a mesh, per device: rows split over the batch axes (each row's dot is the same), the weight whole
    # (a preset that splits dense weights over devices gathers them here, which the collectives show)
    return per_device(functools.partial(kernel, interpret=choice.interpret), (x, w_e4m3, w_scale),
                      (("batch",), (), ()), ("batch",), batch=M)


def expert_gemm_moe(experts, rows, expert_ids, weights, *, impl="pallas", interpret=None, platform=None):
    """Routed-expert FFN for rows (token, slot) with the grouped FP4 GEMM: [n, d] -> [n, d] in rows.dtype.

    `experts` is the model's `dsv41_jax.layers.moe.Experts` (fp4 kind); expert_ids / weights [n]
    give each row's expert and routing weight. Same math as `Experts.grouped`: sort rows by
    expert, W1 and W3, clamped SwiGLU times the weight, W2, unsort.
    """
    if experts.kind != "fp4":
        raise ValueError(f"expert_gemm_moe: needs MXFP4 experts, got kind {experts.kind!r}")
    weights_ = tuple(getattr(experts, n)[...] for n in ("w1", "w1_scale", "w3", "w3_scale", "w2", "w2_scale"))
    kw = dict(limit=experts.limit, impl=impl, interpret=interpret, platform=platform)
    # on a mesh without expert parallelism (the expert-parallel MoE calls this per device, inside its
    # shard_map): rows split over the batch axes, every expert whole on every device
    b = ("batch",)
    return per_device(lambda r, e, w, *ws: _expert_ffn(r, e, w, ws, **kw), (rows, expert_ids, weights) + weights_,
                      (b, b, b) + ((),) * 6, b, batch=rows.shape[0])


def _expert_ffn(rows, expert_ids, weights, stacks, *, limit, impl, interpret, platform):
    w1, s1, w3, s3, w2, s2 = stacks
    E = w1.shape[0]  # the stored bytes or their word views (`kernel_params`): E leads both
    order = jnp.argsort(expert_ids, stable=True)
    xs, ws = rows[order], weights[order]
    sizes = jnp.bincount(expert_ids, length=E).astype(jnp.int32)
    kw = dict(impl=impl, interpret=interpret, platform=platform)
    up1 = grouped_fp4_gemm(xs, sizes, w1, s1, **kw).astype(rows.dtype)
    up3 = grouped_fp4_gemm(xs, sizes, w3, s3, **kw).astype(rows.dtype)
    h = (ws[:, None] * swiglu(up1, up3, limit)).astype(rows.dtype)
    out = grouped_fp4_gemm(h, sizes, w2, s2, **kw).astype(rows.dtype)
    return jnp.zeros_like(out).at[order].set(out)
