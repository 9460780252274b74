"""Plain-jnp expert GEMMs: the oracle and the XLA path.

Both GEMMs quantize the bf16 activation to E4M3 with an E8M0 scale per 32 along K (as the
reference's `linear()` does in front of every FP8/FP4 GEMM; golden README "What the reference
run includes"), or take it already quantized, then multiply the exactly dequantized operands
(both exact in bf16) with f32 accumulation.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.numerics import gemm, quant


def dequantized_activation(x) -> jax.Array:
    """bf16 [M, K] values of the FP8 activation: x is bf16/f32 [M, K] or a (e4m3, e8m0) pair."""
    if isinstance(x, (tuple, list)):
        q, s = x
        return quant.dequant_fp8_act(q, s, 32).astype(jnp.bfloat16)
    k = x.shape[-1]
    pad = -k % 32
    xp = jnp.pad(x, ((0, 0), (0, pad))) if pad else x
    q, s = quant.quant_fp8_act(xp, 32)
    return quant.dequant_fp8_act(q, s, 32)[:, :k].astype(jnp.bfloat16)


def grouped_fp4_gemm_reference(x_sorted, group_sizes, w_packed, w_scale) -> jax.Array:
    """y [M, N] f32: row m (sorted by expert) times its expert's dequantized MXFP4 weight; rows past
    sum(group_sizes) are 0."""
    xd = dequantized_activation(x_sorted)
    w = jax.vmap(quant.dequant_fp4_weight)(w_packed, w_scale).astype(jnp.bfloat16)  # [E, N, K]
    y = jax.lax.ragged_dot(xd, jnp.swapaxes(w, 1, 2), group_sizes.astype(jnp.int32),
                           preferred_element_type=jnp.float32)
    total = jnp.sum(group_sizes)
    return jnp.where(jnp.arange(xd.shape[0])[:, None] < total, y, 0.0)


def fp8_block_gemm_reference(x, w_e4m3, w_scale) -> jax.Array:
    """y [M, N] f32 = FP8(x) @ dequant(W)^T with 32x32 E8M0 weight tiles (dsv41_jax.numerics.gemm, fast mode)."""
    if isinstance(x, (tuple, list)):
        xd = dequantized_activation(x)
        wd = quant.dequant_fp8_weight(w_e4m3, w_scale).astype(jnp.bfloat16)
        return jnp.dot(xd, wd.T, preferred_element_type=jnp.float32)
    return gemm.linear(x, w_e4m3, w_scale, kind="fp8", mode="fast", out_dtype=jnp.float32)
