"""Plain-jnp indexer: scores, the candidate pool and the top-k (docs/REFERENCE.md §3 "Indexer").

    I[b,s,g] = sum_h w[b,s,h] * ReLU(q[b,s,h] . k[b,g]),  -inf where g >= compress_len[b,s]
               or outside the pool.

q and k are MXFP4 (E2M1 + E8M0 per 32), dequantized exactly. With `bf16_rounding` the score
follows the reference's bf16 storage points (reference model.py: Indexer.forward): the dot is
rounded to bf16, each weighted term w_h * ReLU(.) is rounded to bf16, and the head sum (f32) is
rounded to bf16; pass weights already rounded as the model computes them. Without it everything
stays f32. The pool and the top-k run in XLA for every impl.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.numerics import kv_layout, quant
from dsv41_jax.numerics.exact_ops import torch_sum_axis


def _round_bf16(x: jax.Array) -> jax.Array:
    return x.astype(jnp.bfloat16).astype(jnp.float32)


def visibility_mask(compress_len: jax.Array, pool_mask: jax.Array | None, n_keys: int) -> jax.Array:
    """bool [B, S, G]: entry g is visible iff g < compress_len (and inside the pool, if given)."""
    visible = jnp.arange(n_keys, dtype=jnp.int32)[None, None, :] < compress_len[..., None]
    return visible if pool_mask is None else visible & pool_mask


def indexer_scores_reference(q_packed, q_scale, keys, weights, compress_len, pool_mask=None, *, bf16_rounding=False,
                             exact=False):
    """scores [B, S, G] f32; see `pallas_kernels.indexer_scores` for the contract.

    exact: dots in float64, rounded once to f32 (then to bf16 with bf16_rounding)."""
    # MXFP4 values are exact in bf16; products are exact and accumulate in f32 (float64 if exact)
    q = quant.dequant_fp4_mx(q_packed, q_scale, 32).astype(jnp.bfloat16)  # [B, S, Hi, Di]
    k = kv_layout.dequantize_index_keys(keys).astype(jnp.bfloat16)  # [B, G, Di]
    if exact:
        dots = jnp.einsum("bshd,bgd->bshg", q.astype(jnp.float64), k.astype(jnp.float64),
                          precision=jax.lax.Precision.HIGHEST).astype(jnp.float32)
    else:
        dots = jnp.einsum("bshd,bgd->bshg", q, k, preferred_element_type=jnp.float32)
    if bf16_rounding:
        dots = _round_bf16(dots)
    terms = jax.nn.relu(dots) * weights.astype(jnp.float32)[..., None]
    if bf16_rounding:
        terms = _round_bf16(terms)
    if exact:  # torch's order for the oracle's strided head sum: in order, folded in levels of 16
        scores = torch_sum_axis(terms, 2)
    else:
        scores = jnp.sum(terms, axis=2)
    if bf16_rounding:
        scores = _round_bf16(scores)
    return jnp.where(visibility_mask(compress_len, pool_mask, k.shape[1]), scores, -jnp.inf)


def candidate_blocks(scores: jax.Array, compress_len: jax.Array, block_size: int, n_blocks: int):
    """(pool bool [B, S, G], block scores [B, S, n_total_blocks]): the positions of the `n_blocks` best
    blocks of `block_size` positions, and every block's score.

    Blocks lie on an absolute grid; a block scores the max of its positions (-inf pads the last);
    the block holding the newest visible position (compress_len - 1) is pinned to +inf; picks that
    come back -inf are dropped (reference model.py: select_candidate_blocks). The model's indexer
    (`layers.indexer.candidate_pool`) runs this function.
    """
    if block_size < 1 or n_blocks < 1:
        raise ValueError(f"candidate_pool: block_size and n_blocks must be >= 1, got {block_size}, {n_blocks}")
    G = scores.shape[-1]
    nb = -(-G // block_size)
    padded = jnp.pad(scores, [(0, 0)] * (scores.ndim - 1) + [(0, nb * block_size - G)], constant_values=-jnp.inf)
    block_scores = jnp.max(padded.reshape(*scores.shape[:-1], nb, block_size), axis=-1)
    newest = jnp.floor_divide(compress_len - 1, block_size)
    block_scores = jnp.where(jnp.arange(nb) == newest[..., None], jnp.inf, block_scores)
    values, picks = jax.lax.top_k(block_scores, min(n_blocks, nb))
    keep = jnp.zeros(block_scores.shape, bool)
    keep = jnp.put_along_axis(keep, picks, values > -jnp.inf, axis=-1, inplace=False)
    return jnp.repeat(keep, block_size, axis=-1)[..., :G], block_scores


def candidate_pool(scores: jax.Array, compress_len: jax.Array, block_size: int, n_blocks: int) -> jax.Array:
    """bool [B, S, G]: the positions of the `n_blocks` best blocks of `block_size` positions
    (`candidate_blocks` without the block scores)."""
    return candidate_blocks(scores, compress_len, block_size, n_blocks)[0]


def topk_indices(scores: jax.Array, topk: int) -> jax.Array:
    """int32 [B, S, min(topk, G)]: the best positions, ascending; -1 for picks whose score is -inf.

    Ties go to the lower index (XLA's top_k is stable), as the golden oracle breaks them
    (golden README, oracle choice 3). The -1 entries sit at the end of each row.
    """
    k = min(int(topk), scores.shape[-1])
    values, picks = jax.lax.top_k(scores, k)
    big = jnp.iinfo(jnp.int32).max
    picks = jnp.where(values > -jnp.inf, picks, big)
    picks = jnp.sort(picks, axis=-1)
    return jnp.where(picks == big, -1, picks).astype(jnp.int32)
