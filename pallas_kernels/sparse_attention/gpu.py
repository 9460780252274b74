"""Sparse sink attention on GPU: Triton-lowered Pallas with pointer gathers of the cached bytes.

Why Triton and not Mosaic GPU: every query row reads its own 640 scattered cache rows. Mosaic GPU
moves data with TMA, which on Hopper copies rectangular tiles only (row gathers are a Blackwell
TMA feature), so it would need one TMA per row; Triton gathers rows with ordinary vectorised
pointer loads, which is the shape of this problem.

Layout: grid (query row, head block, slot split). A program loads its [HB, D] query block, walks
its share of the slot list in blocks of BK slots (window slots first, then compressed), gathers
the raw bytes of those rows (`kv_layout.window_bytes` / `compressed_bytes`), decodes them to bf16
in registers (pallas_kernels/common/bits.py), and runs an online softmax: P is rounded to bf16 for
P.V only, the denominator keeps f32 P, as the oracle does (golden README, oracle choice 1). With
one split the sink term and the division happen in the kernel; with several (small batches, so
the GPU has enough programs) each split writes (acc, max, sum) and `_combine` merges them in XLA.

Untested on GPU hardware in this repository: the CPU tests run this kernel in interpret mode and
lower it to Triton IR with jax.export (platforms=["cuda"]); PTX compilation and speed are unchecked.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from dsv41_jax.numerics import kv_layout
from pallas_kernels.common import bits

_NEG_INF = float("-inf")


def _pad_last(x: jax.Array, multiple: int, value) -> jax.Array:
    pad = -x.shape[-1] % multiple
    return x if pad == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)], constant_values=value)


def _kernel(*refs, rows_per_batch, n_win_blocks, n_comp_blocks, blocks_per_split, block_k, scale, finalize):
    it = iter(refs)
    q_ref, sink_ref = next(it), next(it)
    win = (next(it), next(it), next(it)) if n_win_blocks else None  # idx, values, scales
    comp = (next(it), next(it), next(it)) if n_comp_blocks else None  # idx, packed, scales
    outs = list(it)

    r, split = pl.program_id(0), pl.program_id(2)
    batch = bits.idiv(r, rows_per_batch)
    q = q_ref[0]  # [HB, D]
    hb, d = q.shape
    cols = jax.lax.broadcasted_iota(jnp.int32, (1, d), 1)
    first = split * blocks_per_split
    last = first + blocks_per_split

    def attend(carry, k, valid):
        m, l, acc = carry
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        s = jnp.where(valid[None, :], s * jnp.float32(scale), _NEG_INF)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_use = jnp.where(m_new == _NEG_INF, 0.0, m_new)
        p = jnp.exp(s - m_use[:, None])
        alpha = jnp.exp(m - m_use)
        l = alpha * l + jnp.sum(p, axis=1)
        acc = alpha[:, None] * acc + jnp.dot(p.astype(jnp.bfloat16), k, preferred_element_type=jnp.float32)
        return m_new, l, acc

    def gathered(idx_ref, blk):
        idx = idx_ref[r, pl.ds(blk * block_k, block_k)]
        valid = idx >= 0
        return jnp.maximum(idx, 0)[:, None], valid, valid[:, None]

    def window_block(blk, carry):
        idx_ref, values_ref, scales_ref = win
        rows, valid, mask = gathered(idx_ref, blk)
        code = plgpu.load(values_ref.at[batch, rows, cols], mask=mask, other=0).astype(jnp.int32)
        sbyte = plgpu.load(scales_ref.at[batch, rows, bits.idiv(cols, 32)], mask=mask, other=127).astype(jnp.int32)
        k = (bits.e4m3_to_f32(code) * bits.e8m0_to_f32(sbyte)).astype(jnp.bfloat16)
        return attend(carry, k, valid)

    def compressed_block(blk, carry):
        idx_ref, packed_ref, scales_ref = comp
        rows, valid, mask = gathered(idx_ref, blk)
        byte = plgpu.load(packed_ref.at[batch, rows, bits.idiv(cols, 2)], mask=mask, other=0).astype(jnp.int32)
        code = jax.lax.shift_right_logical(byte, 4 * bits.irem(cols, 2)) & 0xF
        sbyte = plgpu.load(scales_ref.at[batch, rows, bits.idiv(cols, 16)], mask=mask, other=0).astype(jnp.int32)
        k = (bits.e2m1_to_f32(code) * bits.e4m3_to_f32(sbyte)).astype(jnp.bfloat16)
        return attend(carry, k, valid)

    carry = (jnp.full((hb,), _NEG_INF, jnp.float32), jnp.zeros((hb,), jnp.float32), jnp.zeros((hb, d), jnp.float32))
    if n_win_blocks:
        carry = jax.lax.fori_loop(jnp.minimum(first, n_win_blocks), jnp.minimum(last, n_win_blocks), window_block, carry)
    if n_comp_blocks:
        lo = jnp.maximum(first - n_win_blocks, 0)
        hi = jnp.maximum(jnp.minimum(last - n_win_blocks, n_comp_blocks), lo)
        carry = jax.lax.fori_loop(lo, hi, compressed_block, carry)
    m, l, acc = carry

    if finalize:
        (o_ref,) = outs
        m_use = jnp.where(m == _NEG_INF, 0.0, m)
        denom = l + jnp.exp(sink_ref[...] - m_use)
        out = jnp.where((m > _NEG_INF)[:, None], acc / denom[:, None], 0.0)
        o_ref[0] = out.astype(o_ref.dtype)
    else:
        acc_ref, m_ref, l_ref = outs
        acc_ref[0, 0] = acc
        m_ref[0, 0] = m
        l_ref[0, 0] = l


def _combine(acc, m, l, sink, dtype):
    """Merge split partials: acc [R, n, H, D], m/l [R, n, H] -> o [R, H, D]."""
    m_all = jnp.max(m, axis=1)
    m_use = jnp.where(m_all == _NEG_INF, 0.0, m_all)
    w = jnp.exp(m - m_use[:, None])
    denom = jnp.sum(w * l, axis=1) + jnp.exp(sink[None, :] - m_use)
    out = jnp.sum(w[..., None] * acc, axis=1) / denom[..., None]
    return jnp.where((m_all > _NEG_INF)[..., None], out, 0.0).astype(dtype)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def sparse_sink_attention_gpu(
    q, window, compressed, window_idx, compressed_idx, sink, scale, *,
    interpret: bool = False, head_block: int = 32, block_k: int = 32, splits: int | None = None,
    num_warps: int = 8, num_stages: int = 2,
) -> jax.Array:
    """Triton kernel; shapes and semantics as `pallas_kernels.sparse_sink_attention`.

    head_block / block_k: heads and slots per program step (powers of two, >= 16 for tl.dot).
    splits: slot-list splits per row (None: enough programs for ~2 waves on a 132-SM GPU).
    """
    B, S, H, D = q.shape
    if D & (D - 1):
        raise ValueError(f"sparse_sink_attention_gpu: head dim must be a power of two for Triton, got {D}")
    R = B * S
    hb = max(16, min(_next_pow2(H), head_block))
    hp = -(-H // hb) * hb
    qp = jnp.pad(q.reshape(R, H, D), ((0, 0), (0, hp - H), (0, 0)))
    sinkp = jnp.pad(sink.astype(jnp.float32), (0, hp - H))

    args = [qp, sinkp]
    in_specs = [pl.BlockSpec((1, hb, D), lambda r, h, s: (r, h, 0)), pl.BlockSpec((hb,), lambda r, h, s: (h,))]
    full = pl.BlockSpec()
    n_win_blocks = n_comp_blocks = 0
    if window is not None and window_idx is not None and window_idx.shape[-1] and window[0].shape[1]:
        widx = _pad_last(window_idx.reshape(R, -1).astype(jnp.int32), block_k, -1)
        n_win_blocks = widx.shape[-1] // block_k
        args += [widx, *kv_layout.window_bytes(window)]
        in_specs += [full] * 3
    if compressed is not None and compressed_idx is not None and compressed_idx.shape[-1] and compressed.packed.shape[1]:
        cidx = _pad_last(compressed_idx.reshape(R, -1).astype(jnp.int32), block_k, -1)
        n_comp_blocks = cidx.shape[-1] // block_k
        args += [cidx, *kv_layout.compressed_bytes(compressed)]
        in_specs += [full] * 3
    total_blocks = n_win_blocks + n_comp_blocks
    if total_blocks == 0:
        return jnp.zeros_like(q)

    programs = R * (hp // hb)
    if splits is None:
        splits = max(1, min(total_blocks, -(-264 // programs)))
    splits = max(1, min(int(splits), total_blocks))
    per_split = -(-total_blocks // splits)
    splits = -(-total_blocks // per_split)
    finalize = splits == 1

    if finalize:
        out_shape = jax.ShapeDtypeStruct((R, hp, D), q.dtype)
        out_specs = pl.BlockSpec((1, hb, D), lambda r, h, s: (r, h, 0))
    else:
        out_shape = (
            jax.ShapeDtypeStruct((R, splits, hp, D), jnp.float32),
            jax.ShapeDtypeStruct((R, splits, hp), jnp.float32),
            jax.ShapeDtypeStruct((R, splits, hp), jnp.float32),
        )
        out_specs = (
            pl.BlockSpec((1, 1, hb, D), lambda r, h, s: (r, s, h, 0)),
            pl.BlockSpec((1, 1, hb), lambda r, h, s: (r, s, h)),
            pl.BlockSpec((1, 1, hb), lambda r, h, s: (r, s, h)),
        )
    kernel = functools.partial(
        _kernel, rows_per_batch=S, n_win_blocks=n_win_blocks, n_comp_blocks=n_comp_blocks,
        blocks_per_split=per_split, block_k=block_k, scale=float(scale), finalize=finalize,
    )
    res = pl.pallas_call(
        kernel,
        grid=(R, hp // hb, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="sparse_sink_attention_gpu",
    )(*args)
    out = res if finalize else _combine(*res, sinkp, q.dtype)
    return out[:, :H].reshape(B, S, H, D)
