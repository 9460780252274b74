"""Indexer scores on TPU (Mosaic): FP4 query heads x FP4 index keys, ReLU, weighted head sum, mask.

Grid (batch, query tile, key tile). Keys stream through VMEM as 32-bit words
(`kv_layout.index_key_words`) and are decoded in VMEM (common/bits.py) into 8 planes of Di/8
lanes (element 8j + n in plane n, lane j); the queries are dequantized and permuted into the same
plane order in XLA, so scores = sum_n q_n . k_n^T. Every grid step is independent ("parallel").
Semantics and the optional bf16 rounding points: reference.py.
exact=True (interpret mode only, float64 enabled; implies the bf16 rounding points) computes the
dots in float64 and rounds them once through f32 to bf16, as the model's exact mode and the golden
oracle do; Mosaic has no float64, so that variant cannot be compiled for a TPU.
Untested on TPU hardware: CPU tests run it interpreted and lower it with jax.export.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dsv41_jax.numerics import kv_layout, quant
from dsv41_jax.numerics.exact_ops import torch_sum_axis
from pallas_kernels.common import bits, lanes


def _round_bf16(x):
    return x.astype(jnp.bfloat16).astype(jnp.float32)


def _kernel(q_ref, w_ref, len_ref, *refs, heads, key_tile, bf16_rounding, has_pool, exact=False):
    if has_pool:
        pool_ref, k_ref, ks_ref, o_ref = refs
    else:
        k_ref, ks_ref, o_ref = refs
    g0 = pl.program_id(2) * key_tile
    words = k_ref[0]  # [tg, Di/8]
    scale = bits.e8m0_to_f32(lanes.scale_byte_per_lane(ks_ref[0], words.shape[-1], 32))
    q = q_ref[0]  # [8, ts*Hi, Di/8]
    dots = None
    acc_t = jnp.float64 if exact else jnp.float32
    for n in range(8):
        k_n = (bits.e2m1_to_f32(bits.nibble_of_word(words, n)) * scale).astype(jnp.bfloat16)
        part = jax.lax.dot_general(q[n].astype(acc_t), k_n.astype(acc_t), (((1,), (1,)), ((), ())),
                                   preferred_element_type=acc_t)
        dots = part if dots is None else dots + part
    dots = dots.astype(jnp.float32)  # exact: float64 -> f32 -> bf16, the model's round_from_f64
    if bf16_rounding:
        dots = _round_bf16(dots)
    ts = dots.shape[0] // heads
    terms = jnp.maximum(dots, 0.0).reshape(ts, heads, key_tile) * w_ref[0]  # w: [ts, Hi, 1]
    if bf16_rounding:
        terms = _round_bf16(terms)
    if exact:
        # torch's order for the oracle's head sum (a strided-axis sum: in order, folded in
        # levels of 16), the model's `Indexer.scores` and the reference's
        scores = torch_sum_axis(terms, 1)
    else:
        scores = jnp.sum(terms, axis=1)
    if bf16_rounding:
        scores = _round_bf16(scores)
    g = g0 + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
    visible = g < len_ref[0]  # [ts, 1] broadcast
    if has_pool:
        visible = visible & (pool_ref[0] != 0)
    o_ref[0] = jnp.where(visible, scores, -jnp.inf)


def _tile(n: int, preferred: int, multiple: int) -> int:
    """A tile for a dim of size n: `preferred` (a multiple of `multiple`) or all of n when smaller."""
    return n if n <= preferred else preferred


def indexer_scores_tpu(q_packed, q_scale, keys, weights, compress_len, pool_mask=None, *, bf16_rounding=False,
                       interpret=False, query_tile=8, key_tile=512, exact=False):
    """Mosaic TPU kernel; shapes and semantics as `pallas_kernels.indexer_scores`.

    exact: float64 dots (see the module docstring); needs interpret=True, bf16_rounding=True and
    `jax.enable_x64(True)`.
    """
    if exact and not (interpret and bf16_rounding):
        raise ValueError("indexer_scores_tpu(exact=True) needs interpret=True (Mosaic has no float64) and "
                         "bf16_rounding=True (exact mode is the oracle's rounding points)")
    if exact and jax.dtypes.canonicalize_dtype(jnp.float64) != jnp.float64:
        raise RuntimeError("indexer_scores_tpu(exact=True) needs float64: wrap the call in `with jax.enable_x64(True):`")
    B, S, Hi, half = q_packed.shape
    Di = 2 * half
    G = int(keys.packed.shape[1])
    ts = _tile(S, query_tile, 8)
    tg = _tile(G, key_tile, 128)
    Sp, Gp = -(-S // ts) * ts, -(-G // tg) * tg

    q = quant.dequant_fp4_mx(q_packed, q_scale, 32).astype(jnp.bfloat16)  # exact
    q = q.reshape(B, S, Hi, Di // 8, 8).transpose(0, 4, 1, 2, 3)  # [B, 8, S, Hi, Di/8]
    q = jnp.pad(q, ((0, 0), (0, 0), (0, Sp - S), (0, 0), (0, 0))).reshape(B, 8, Sp * Hi, Di // 8)
    w = jnp.pad(weights.astype(jnp.float32), ((0, 0), (0, Sp - S), (0, 0)))[..., None]  # [B, Sp, Hi, 1]
    lens = jnp.pad(compress_len.astype(jnp.int32), ((0, 0), (0, Sp - S)))[..., None]  # [B, Sp, 1]
    words = kv_layout.index_key_words(keys)
    as_i32 = lambda a: jax.lax.bitcast_convert_type(a, jnp.int32)  # noqa: E731
    # padded only when the key tile does not divide G (a cache's capacity buckets are powers of two:
    # then the keys enter as stored, with no copy)
    pad = (lambda a: a) if Gp == G else (lambda a: jnp.pad(a, ((0, 0), (0, Gp - G), (0, 0))))  # noqa: E731
    kp, ks = pad(as_i32(words.packed)), pad(as_i32(words.scales))

    args = [q, w, lens]
    in_specs = [
        pl.BlockSpec((1, 8, ts * Hi, Di // 8), lambda b, i, j: (b, 0, i, 0)),
        pl.BlockSpec((1, ts, Hi, 1), lambda b, i, j: (b, i, 0, 0)),
        pl.BlockSpec((1, ts, 1), lambda b, i, j: (b, i, 0)),
    ]
    if pool_mask is not None:
        pool = jnp.pad(pool_mask.astype(jnp.int32), ((0, 0), (0, Sp - S), (0, Gp - G)))
        args.append(pool)
        in_specs.append(pl.BlockSpec((1, ts, tg), lambda b, i, j: (b, i, j)))
    args += [kp, ks]
    in_specs += [
        pl.BlockSpec((1, tg, kp.shape[-1]), lambda b, i, j: (b, j, 0)),
        pl.BlockSpec((1, tg, ks.shape[-1]), lambda b, i, j: (b, j, 0)),
    ]
    kernel = functools.partial(
        _kernel, heads=Hi, key_tile=tg, bf16_rounding=bf16_rounding, has_pool=pool_mask is not None,
        exact=bool(exact),
    )
    # every (query, key) pair: Hi head dots of Di, then the Hi-term weighted sum; the queries are read
    # once per key tile, the FP4 keys once per query tile
    cost = pl.CostEstimate(flops=B * Sp * Gp * (2 * Hi * Di + 2 * Hi), transcendentals=0,
                           bytes_accessed=(Gp // tg) * q.size * 2 + (Sp // ts) * (kp.size + ks.size) * 4
                           + B * Sp * Gp * 4 * (2 if pool_mask is not None else 1))
    out = pl.pallas_call(
        kernel,
        grid=(B, Sp // ts, Gp // tg),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((1, ts, tg), lambda b, i, j: (b, i, j)),
        out_shape=jax.ShapeDtypeStruct((B, Sp, Gp), jnp.float32),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=interpret,
        cost_estimate=cost,
        name="indexer_scores_tpu",
    )(*args)
    return out[:, :S, :G]
