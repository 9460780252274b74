"""Expert GEMMs on TPU (Mosaic): MXFP4 / FP8 weights dequantized in VMEM, fused into the matmul.

grouped_fp4_gemm_tpu: grid (N tiles, work items). A PrefetchScalarGridSpec carries the work list
(schedule.py) in SMEM; each item's index maps pick its row tile of the activation and its expert's
weight tile, so only non-empty experts' weights are ever read. Items of one row tile are
consecutive, so the output tile stays in VMEM and accumulates across them (first visit zeroes
it; each item adds only its own rows). The whole K dimension is one block: the weight tile is
[tn, K/8] words, decoded into 8 bf16 planes (common/bits.py) with E8M0 scales spread over lanes
(common/lanes.py), and multiplied with the activation planes with f32 accumulation.

fp8_block_gemm_tpu: grid (M tiles, N tiles), same decode for E4M3 weights with 32x32 tile scales.
Untested on TPU hardware: the CPU tests interpret them and lower them with jax.export.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.common import bits, lanes
from pallas_kernels.expert_gemm import layout
from pallas_kernels.expert_gemm.reference import dequantized_activation
from pallas_kernels.expert_gemm.schedule import work_list


def _dot_planes(x_planes, w_planes):
    acc = None
    for xn, wn in zip(x_planes, w_planes):
        part = jax.lax.dot_general(xn, wn, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        acc = part if acc is None else acc + part
    return acc


def _grouped_kernel(tile_ref, group_ref, lo_ref, hi_ref, real_ref, x_ref, w_ref, s_ref, o_ref, *, tile_rows):
    w = pl.program_id(1)
    prev = jnp.maximum(w - 1, 0)
    first_visit = (w == 0) | (tile_ref[w] != tile_ref[prev])

    @pl.when(first_visit)
    def _zero():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)

    lo, hi = lo_ref[w], hi_ref[w]

    @pl.when((real_ref[w] == 1) & (hi > lo))
    def _accumulate():
        words = w_ref[0]  # [tn, K/8]
        scale = bits.e8m0_to_f32(lanes.scale_byte_per_lane(s_ref[0], words.shape[-1], 32))
        w_planes = [(bits.e2m1_to_f32(bits.nibble_of_word(words, n)) * scale).astype(jnp.bfloat16) for n in range(8)]
        x = x_ref[...]
        acc = _dot_planes([x[n] for n in range(8)], w_planes)
        rows = tile_ref[w] * tile_rows + jax.lax.broadcasted_iota(jnp.int32, acc.shape, 0)
        o_ref[...] += jnp.where((rows >= lo) & (rows < hi), acc, 0.0)


def grouped_fp4_gemm_tpu(x_sorted, group_sizes, w_packed, w_scale, *, interpret=False, tile_rows=128, tile_cols=128):
    """Mosaic TPU kernel; shapes and semantics as `pallas_kernels.grouped_fp4_gemm`.

    w_packed / w_scale may also be given pre-converted as int32 words (`layout.fp4_weight_words`,
    built once at load: then the call reads only the experts' bytes, with no relayout before it).
    """
    xd = dequantized_activation(x_sorted)
    M, K = xd.shape
    if layout.is_words(w_packed):
        words, swords = w_packed, w_scale
    else:
        words, swords = layout.fp4_weight_words(w_packed, w_scale)
    E, N, _ = words.shape
    tm = min(tile_rows, -(-M // 16) * 16)
    tn = tile_cols if N % tile_cols == 0 else N
    Mp = -(-M // tm) * tm
    xp = layout.activation_planes(jnp.pad(xd, ((0, Mp - M), (0, 0))))
    wl = work_list(group_sizes, Mp, tm)
    n_items = wl.tile.shape[0]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(N // tn, n_items),
        in_specs=[
            pl.BlockSpec((8, tm, K // 8), lambda n, w, t, g, lo, hi, r: (0, t[w], 0)),
            pl.BlockSpec((1, tn, K // 8), lambda n, w, t, g, lo, hi, r: (g[w], n, 0)),
            pl.BlockSpec((1, tn, swords.shape[-1]), lambda n, w, t, g, lo, hi, r: (g[w], n, 0)),
        ],
        out_specs=pl.BlockSpec((tm, tn), lambda n, w, t, g, lo, hi, r: (t[w], n)),
    )
    # per work item (an upper bound on the items that run): a [tm, K] activation tile, one expert's
    # [tn, K] FP4 weight tile with its scales, per column tile; the whole [Mp, N] output once
    cost = pl.CostEstimate(flops=2 * n_items * tm * N * K, transcendentals=0,
                           bytes_accessed=n_items * (N // tn) * (tm * K * 2) + n_items * N * (K // 2 + K // 32)
                           + Mp * N * 4)
    out = pl.pallas_call(
        functools.partial(_grouped_kernel, tile_rows=tm),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct((Mp, N), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
        interpret=interpret,
        cost_estimate=cost,
        name="grouped_fp4_gemm_tpu",
    )(*wl, xp, words, swords)
    return out[:M]


def _fp8_kernel(x_ref, lo_ref, hi_ref, s_ref, o_ref):
    low, high = lo_ref[...], hi_ref[...]  # [tn, K/8]
    tn, lanes_k = low.shape
    s = s_ref[...]  # [tn/32 or ceil, ceil(K/32)] int32 scale bytes
    # spread the 32x32 tile scales: rows i -> i // 32, lanes j -> 8j // 32 (one-hot matmuls, exact)
    rows = (bits.idiv(jax.lax.broadcasted_iota(jnp.int32, (tn, s.shape[0]), 0), 32)
            == jax.lax.broadcasted_iota(jnp.int32, (tn, s.shape[0]), 1)).astype(jnp.bfloat16)
    cols = (bits.idiv(8 * jax.lax.broadcasted_iota(jnp.int32, (s.shape[1], lanes_k), 1), 32)
            == jax.lax.broadcasted_iota(jnp.int32, (s.shape[1], lanes_k), 0)).astype(jnp.bfloat16)
    spread = jnp.dot(jnp.dot(rows, s.astype(jnp.bfloat16), preferred_element_type=jnp.float32).astype(jnp.bfloat16),
                     cols, preferred_element_type=jnp.float32)
    scale = bits.e8m0_to_f32(spread.astype(jnp.int32))
    w_planes = [(bits.e4m3_to_f32(bits.byte_of_word(low if n < 4 else high, n % 4)) * scale).astype(jnp.bfloat16)
                for n in range(8)]
    x = x_ref[...]
    o_ref[...] = _dot_planes([x[n] for n in range(8)], w_planes)


def fp8_block_gemm_tpu(x, w, w_scale, *, interpret=False, tile_rows=128, tile_cols=256):
    """Mosaic TPU kernel; shapes and semantics as `pallas_kernels.fp8_block_gemm`.

    w: the stored E4M3 [N, K], or its word view int32 [2, N, Kp/8] (`layout.fp8_weight_view`,
    built once at load: then the call reads only the weight's bytes, with no relayout before it).
    """
    xd = dequantized_activation(x)
    M, K = xd.shape
    Kp = -(-K // 32) * 32
    if Kp != K:
        xd = jnp.pad(xd, ((0, 0), (0, Kp - K)))
    words = w if layout.is_words(w) else layout.fp8_weight_view(w)
    N = words.shape[1]
    # [ceil(N/32) rounded up to 64, Kp/32]: the padding rows are never read (the kernel spreads row i of a
    # tile from scale row i // 32). XLA:TPU for v5p (libtpu 0.0.42) aborts on the bare u8 -> s32 convert
    # of some shapes ([32, 128], [160, 128], [160, 256]: "Cannot find a valid window"); padded, it fuses.
    s = jnp.pad(w_scale, ((0, -w_scale.shape[0] % 64), (0, 0))).astype(jnp.int32)
    tm = min(tile_rows, -(-M // 16) * 16)
    Mp = -(-M // tm) * tm
    tn = tile_cols if N % tile_cols == 0 else N
    st = tn // 32 if tn != N else s.shape[0]
    xp = layout.activation_planes(jnp.pad(xd, ((0, Mp - M), (0, 0))))
    # activations read once per column tile, the weight (1 byte a value) and its scales once per row tile
    cost = pl.CostEstimate(flops=2 * Mp * N * Kp, transcendentals=0,
                           bytes_accessed=(N // tn) * Mp * Kp * 2 + (Mp // tm) * (N * Kp + s.size * 4) + Mp * N * 4)
    # the view passed twice: its low-word plane and its high-word plane, each block [tn, Kp/8]
    out = pl.pallas_call(
        _fp8_kernel,
        grid=(Mp // tm, N // tn),
        in_specs=[
            pl.BlockSpec((8, tm, Kp // 8), lambda i, j: (0, i, 0)),
            pl.BlockSpec((pl.squeezed, tn, Kp // 8), lambda i, j: (0, j, 0)),
            pl.BlockSpec((pl.squeezed, tn, Kp // 8), lambda i, j: (1, j, 0)),
            pl.BlockSpec((st, s.shape[1]), lambda i, j: (j, 0)),
        ],
        out_specs=pl.BlockSpec((tm, tn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((Mp, N), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret,
        cost_estimate=cost,
        name="fp8_block_gemm_tpu",
    )(xp, words, words, s)
    return out[:M]
