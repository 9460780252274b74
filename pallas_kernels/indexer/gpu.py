"""Indexer scores on GPU: Triton-lowered Pallas.

Grid (query row, key block). A program holds the row's dequantized query heads [Hi, Di] (bf16,
exact) and weights, streams a block of BG index keys as raw bytes (`kv_layout.index_key_bytes`),
decodes them in registers (common/bits.py), and reduces sum_h w_h ReLU(q_h . k_g) with one
tl.dot. Keys are contiguous rows, so this is a streaming kernel; Triton is used for symmetry
with the attention kernel and because the FP4 nibble decode is plain pointer/ALU work.
Semantics and the optional bf16 rounding points: reference.py.
Untested on GPU hardware: CPU tests run it interpreted and lower it to Triton IR with jax.export.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dsv41_jax.numerics import kv_layout, quant
from pallas_kernels.common import bits


def _round_bf16(x):
    return x.astype(jnp.bfloat16).astype(jnp.float32)


def _kernel(q_ref, w_ref, len_ref, *refs, rows_per_batch, key_block, n_keys, bf16_rounding, has_pool):
    if has_pool:
        pool_ref, packed_ref, scales_ref, o_ref = refs
    else:
        packed_ref, scales_ref, o_ref = refs
    r, kb = pl.program_id(0), pl.program_id(1)
    batch = bits.idiv(r, rows_per_batch)
    q = q_ref[0]  # [Hp, Di] bf16
    di = q.shape[-1]
    g = kb * key_block + jax.lax.broadcasted_iota(jnp.int32, (key_block,), 0)
    in_range = g < n_keys
    rows = jnp.minimum(g, n_keys - 1)[:, None]
    cols = jax.lax.broadcasted_iota(jnp.int32, (1, di), 1)
    byte = plgpu.load(packed_ref.at[batch, rows, bits.idiv(cols, 2)], mask=in_range[:, None], other=0)
    code = jax.lax.shift_right_logical(byte.astype(jnp.int32), 4 * bits.irem(cols, 2)) & 0xF
    sbyte = plgpu.load(scales_ref.at[batch, rows, bits.idiv(cols, 32)], mask=in_range[:, None], other=127)
    k = (bits.e2m1_to_f32(code) * bits.e8m0_to_f32(sbyte.astype(jnp.int32))).astype(jnp.bfloat16)
    dots = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)  # [Hp, BG]
    if bf16_rounding:
        dots = _round_bf16(dots)
    terms = jnp.maximum(dots, 0.0) * w_ref[0][:, None]
    if bf16_rounding:
        terms = _round_bf16(terms)
    scores = jnp.sum(terms, axis=0)
    if bf16_rounding:
        scores = _round_bf16(scores)
    visible = in_range & (g < len_ref[r])
    if has_pool:
        visible = visible & (plgpu.load(pool_ref.at[r, pl.ds(kb * key_block, key_block)]) != 0)
    o_ref[0] = jnp.where(visible, scores, -jnp.inf)


def indexer_scores_gpu(q_packed, q_scale, keys, weights, compress_len, pool_mask=None, *, bf16_rounding=False,
                       interpret=False, key_block=64, num_warps=4, num_stages=2):
    """Triton kernel; shapes and semantics as `pallas_kernels.indexer_scores`."""
    B, S, Hi, half = q_packed.shape
    Di = 2 * half
    if Di & (Di - 1):
        raise ValueError(f"indexer_scores_gpu: index head dim must be a power of two for Triton, got {Di}")
    G = int(keys.packed.shape[1])
    R = B * S
    hp = max(16, 1 << (Hi - 1).bit_length())
    q = quant.dequant_fp4_mx(q_packed, q_scale, 32).astype(jnp.bfloat16).reshape(R, Hi, Di)
    q = jnp.pad(q, ((0, 0), (0, hp - Hi), (0, 0)))
    w = jnp.pad(weights.astype(jnp.float32).reshape(R, Hi), ((0, 0), (0, hp - Hi)))  # padded heads weigh 0
    lens = compress_len.astype(jnp.int32).reshape(R)
    n_blocks = -(-G // key_block)
    gp = n_blocks * key_block
    args = [q, w, lens]
    in_specs = [
        pl.BlockSpec((1, hp, Di), lambda r, j: (r, 0, 0)),
        pl.BlockSpec((1, hp), lambda r, j: (r, 0)),
        pl.BlockSpec(),
    ]
    if pool_mask is not None:
        args.append(jnp.pad(pool_mask.reshape(R, G).astype(jnp.int8), ((0, 0), (0, gp - G))))
        in_specs.append(pl.BlockSpec())
    args += list(kv_layout.index_key_bytes(keys))
    in_specs += [pl.BlockSpec(), pl.BlockSpec()]
    kernel = functools.partial(
        _kernel, rows_per_batch=S, key_block=key_block, n_keys=G, bf16_rounding=bf16_rounding,
        has_pool=pool_mask is not None,
    )
    out = pl.pallas_call(
        kernel,
        grid=(R, n_blocks),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((1, key_block), lambda r, j: (r, j)),
        out_shape=jax.ShapeDtypeStruct((R, gp), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="indexer_scores_gpu",
    )(*args)
    return out[:, :G].reshape(B, S, G)
