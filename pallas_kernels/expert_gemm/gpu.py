"""Expert GEMMs on GPU: Triton-lowered Pallas, weights dequantized in registers inside the K loop.

Why Triton and not Mosaic GPU: both lowerings could stream these weights, but the MXFP4 and FP8
weights use 32-element scale blocks, which a Hopper wgmma can only apply by dequantizing to bf16
before the MMA; Triton does that with plain pointer loads and ALU ops, and reads each weight
byte once per output tile. (A Mosaic GPU version with TMA weight streaming and warp
specialisation is the natural next step for peak bandwidth.)

grouped_fp4_gemm_gpu: grid (work item, N block); the work list (schedule.py) gives each program a
row tile, an expert and a row range. The program walks K in BK steps: loads the activation block
(bf16, exactly the FP8 values), the packed nibbles and E8M0 scales of its expert's [BN, BK] weight
block, decodes them (common/bits.py), and accumulates one tl.dot in f32. It stores only its own
rows, so every output row is written once; "no expert" rows get zeros. fp8_block_gemm_gpu is the
dense analogue with E4M3 weights and 32x32 E8M0 tile scales.
Untested on GPU hardware: the CPU tests interpret these kernels and lower them to Triton IR.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.common import bits
from pallas_kernels.expert_gemm.reference import dequantized_activation
from pallas_kernels.expert_gemm.schedule import work_list


def _grouped_kernel(tile_ref, group_ref, lo_ref, hi_ref, real_ref, x_ref, w_ref, s_ref, o_ref, *,
                    block_m, block_n, block_k, n_k_blocks):
    item, nb = pl.program_id(0), pl.program_id(1)
    tile, group, lo, hi, real = tile_ref[item], group_ref[item], lo_ref[item], hi_ref[item], real_ref[item]
    rows = tile * block_m + jax.lax.broadcasted_iota(jnp.int32, (block_m,), 0)
    mine = (rows >= lo) & (rows < hi)
    n_idx = nb * block_n + jax.lax.broadcasted_iota(jnp.int32, (block_n, 1), 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)

    def step(kb, acc):
        k0 = kb * block_k
        x = plgpu.load(x_ref.at[rows[:, None], k0 + cols], mask=mine[:, None], other=0)
        byte = plgpu.load(w_ref.at[group, n_idx, bits.idiv(k0 + cols, 2)]).astype(jnp.int32)
        code = jax.lax.shift_right_logical(byte, 4 * bits.irem(cols, 2)) & 0xF
        sbyte = plgpu.load(s_ref.at[group, n_idx, bits.idiv(k0 + cols, 32)]).astype(jnp.int32)
        w = (bits.e2m1_to_f32(code) * bits.e8m0_to_f32(sbyte)).astype(jnp.bfloat16)
        return acc + jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, jnp.where(real == 1, n_k_blocks, 0), step, jnp.zeros((block_m, block_n), jnp.float32))
    out_cols = nb * block_n + jax.lax.broadcasted_iota(jnp.int32, (1, block_n), 1)
    plgpu.store(o_ref.at[rows[:, None], out_cols], acc, mask=mine[:, None])


def _pick_block(n: int, options) -> int:
    for b in options:
        if n % b == 0:
            return b
    raise ValueError(f"expert GEMM (GPU): dimension {n} is not a multiple of any of {options}")


def grouped_fp4_gemm_gpu(x_sorted, group_sizes, w_packed, w_scale, *, interpret=False, block_m=64, block_n=None,
                         block_k=None, num_warps=4, num_stages=3):
    """Triton kernel; shapes and semantics as `pallas_kernels.grouped_fp4_gemm`."""
    xd = dequantized_activation(x_sorted)
    M, K = xd.shape
    E, N, _ = w_packed.shape
    bn = block_n or _pick_block(N, (128, 64, 32, 16))
    bk = block_k or _pick_block(K, (64, 32))
    bm = block_m
    Mp = -(-M // bm) * bm
    xp = jnp.pad(xd, ((0, Mp - M), (0, 0)))
    wl = work_list(group_sizes, Mp, bm)
    full = pl.BlockSpec()
    kernel = functools.partial(_grouped_kernel, block_m=bm, block_n=bn, block_k=bk, n_k_blocks=K // bk)
    out = pl.pallas_call(
        kernel,
        grid=(wl.tile.shape[0], N // bn),
        in_specs=[full] * 8,
        out_specs=full,
        out_shape=jax.ShapeDtypeStruct((Mp, N), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="grouped_fp4_gemm_gpu",
    )(*wl, xp, w_packed, w_scale)
    return out[:M]


def _fp8_kernel(x_ref, w_ref, s_ref, o_ref, *, block_k, n_k_blocks, n_cols):
    x_all = x_ref  # [BM, K] block
    n_idx = pl.program_id(1) * o_ref.shape[1] + jax.lax.broadcasted_iota(jnp.int32, (o_ref.shape[1], 1), 0)
    valid_n = n_idx < n_cols
    cols = jax.lax.broadcasted_iota(jnp.int32, (1, block_k), 1)
    rows_n = jnp.minimum(n_idx, n_cols - 1)

    def step(kb, acc):
        k0 = kb * block_k
        x = x_all[:, pl.ds(k0, block_k)]
        code = plgpu.load(w_ref.at[rows_n, k0 + cols], mask=valid_n, other=0).astype(jnp.int32)
        sbyte = plgpu.load(s_ref.at[bits.idiv(rows_n, 32), bits.idiv(k0 + cols, 32)]).astype(jnp.int32)
        w = (bits.e4m3_to_f32(code) * bits.e8m0_to_f32(sbyte)).astype(jnp.bfloat16)
        return acc + jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    o_ref[...] = jax.lax.fori_loop(0, n_k_blocks, step, jnp.zeros(o_ref.shape, jnp.float32))


def fp8_block_gemm_gpu(x, w_e4m3, w_scale, *, interpret=False, block_m=64, block_n=128, block_k=32, num_warps=4,
                       num_stages=3):
    """Triton kernel; shapes and semantics as `pallas_kernels.fp8_block_gemm`."""
    xd = dequantized_activation(x)
    M, K = xd.shape
    N = w_e4m3.shape[0]
    Kp = -(-K // block_k) * block_k
    Mp = -(-M // block_m) * block_m
    Np = -(-N // block_n) * block_n
    xp = jnp.pad(xd, ((0, Mp - M), (0, Kp - K)))
    w = jax.lax.bitcast_convert_type(jnp.pad(w_e4m3, ((0, 0), (0, Kp - K))), jnp.uint8)
    s = jnp.pad(w_scale, ((0, 0), (0, Kp // 32 - w_scale.shape[1])), constant_values=127)
    kernel = functools.partial(_fp8_kernel, block_k=block_k, n_k_blocks=Kp // block_k, n_cols=N)
    out = pl.pallas_call(
        kernel,
        grid=(Mp // block_m, Np // block_n),
        in_specs=[pl.BlockSpec((block_m, Kp), lambda i, j: (i, 0)), pl.BlockSpec(), pl.BlockSpec()],
        out_specs=pl.BlockSpec((block_m, block_n), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((Mp, Np), jnp.float32),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="fp8_block_gemm_gpu",
    )(xp, w, s)
    return out[:M, :N]
