"""Fast-mode decode scoring straight from the packed index keys (docs/REFERENCE.md §3 "Indexer", §5).

    I[b,t,g] = sum_h w[b,t,h] * ReLU(q[b,t,h] . k[b,g]),   -inf where g >= visible_len[b,t]

A decode query scores every visible cached position, so whatever is done per position is what
makes a step grow with the context. `Indexer.scores` follows the reference's bf16 rounding
points (dot rounded to bf16, each weighted term rounded to bf16 behind a fence, the head sum
in fp32), and the dense path dequantizes every key with nibble arithmetic first: about 575
elementwise operations per scored position on top of the 2 x 32 x 128 of the dot products.
Here, for the fast (production) mode only:

- FP4 codes decode through a table: one gather of a 256-entry table of E2M1 pairs per packed
  byte, indexed by the byte itself (no index arithmetic), and one of a 256-entry E8M0 table per
  block scale. The power-of-two block scale is then one multiply per key element (exact). Keys
  come out as float32, bit for bit `kv_layout.dequantize_index_keys` (tests).
- The head weights are folded into the query: u[h] = w[h] * q[h] is exact in float32 (the
  MXFP4 query has 2 significant bits, the bf16 weight 8), and w * ReLU(s) = clamp(w * s) to
  [0, inf) for w >= 0 and to (-inf, 0] for w < 0. So after the dot, per position and head,
  there is one clamp and one add of the head sum.
- The dot accumulates in float32 without bf16 rounding of the per-head products; the head
  sum is rounded to bf16 once (the reference's last rounding point, which decides ties).

Per scored position that leaves 128 (block scale) + 32 (clamp) + 32 (head sum) + 2 (rounding)
+ 2 (visibility) elementwise operations besides the 8,192 of the dot (docs/SERVING.md, "Cost").
The scores differ from `Indexer.scores` only by fp32 rounding order and by the reference's
intermediate bf16 roundings, which this path does not make (tests bound the difference and
check the top-k agreement). Exact mode never uses this: the body's `select` keeps
`Indexer.scores` there, so exact-mode numerics are untouched.

The query side (`wq_b`, RoPE, MXFP4 fake quantization, `weights_proj` and its scale) restates
`Indexer.scores`; `tests/serving/test_serving.py::test_fast_index_scores_track_the_reference_scoring`
compares the two, so a change on one side shows up there.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.numerics import kv_layout, quant
from dsv41_jax.layers.rope import apply_rope

# byte b of a packed row holds element 2i in its low nibble and 2i+1 in its high nibble
E2M1_PAIRS = np.stack([quant.E2M1_VALUES[np.arange(256) & 15], quant.E2M1_VALUES[np.arange(256) >> 4]], -1)
# E8M0 byte b -> 2^(b-127); 0 -> 2^-127 (a float32 subnormal), 255 -> NaN (quant.e8m0_to_float)
E8M0_VALUES = np.ldexp(1.0, np.arange(256) - 127)
E8M0_VALUES[255] = np.nan
E8M0_VALUES = E8M0_VALUES.astype(np.float32)


def _lookup(table: np.ndarray, idx: jax.Array) -> jax.Array:
    """table[idx] for uint8 idx [...]: [..., *table.shape[1:]]. The uint8 indices go to the gather
    as they are (jnp indexing would first widen every index to int32, one op per byte)."""
    t = jnp.asarray(table)
    dn = jax.lax.GatherDimensionNumbers(offset_dims=tuple(range(idx.ndim, idx.ndim + t.ndim - 1)),
                                        collapsed_slice_dims=(0,), start_index_map=(0,))
    return jax.lax.gather(t, idx[..., None], dn, slice_sizes=(1, *t.shape[1:]), mode="promise_in_bounds")


def index_keys_f32(k: kv_layout.IndexKeys) -> jax.Array:
    """`kv_layout.dequantize_index_keys(k)` bit for bit: table lookups plus one multiply per element."""
    vals = _lookup(E2M1_PAIRS, k.packed)  # [..., Di/2, 2]
    nblk = k.scales.shape[-1]
    vals = vals.reshape(*k.packed.shape[:-1], nblk, -1)
    scale = _lookup(E8M0_VALUES, k.scales)  # [..., Di/32]
    return (vals * scale[..., None]).reshape(*k.packed.shape[:-1], -1)


def query_and_weights(indexer, x: jax.Array, qr: jax.Array, cos, sin) -> tuple[jax.Array, jax.Array]:
    """(q [B,T,H,D] bf16 MXFP4 values, w [B,T,H] bf16): `Indexer.scores`' query and head weights."""
    B, T, _ = x.shape
    q = indexer.wq_b(qr, "fast").reshape(B, T, indexer.n_heads, indexer.head_dim)
    q = quant.fake_fp4_mx(apply_rope(q, cos, sin, indexer.rope_dim), 32)
    w = indexer.weights_proj(x, "fast")
    w = (w.astype(jnp.float32) * jnp.float32(indexer.head_dim ** -0.5 * indexer.n_heads ** -0.5)).astype(jnp.bfloat16)
    return q, w


def scores_packed(indexer, x: jax.Array, qr: jax.Array, keys: kv_layout.IndexKeys, cos, sin,
                  visible_len: jax.Array) -> jax.Array:
    """Fast-mode index scores [B,T,G] f32 from packed keys [B,G,Di/2] + scales [B,G,Di/32]
    (see the module doc); -inf where g >= visible_len[b,t]."""
    q, w = query_and_weights(indexer, x, qr, cos, sin)
    wf = w.astype(jnp.float32)
    u = q.astype(jnp.float32) * wf[..., None]  # exact
    k = index_keys_f32(keys)  # [B,G,D]
    a = jnp.einsum("bthd,bgd->bthg", u, k, preferred_element_type=jnp.float32,
                   precision=jax.lax.Precision.HIGHEST)
    pos = (wf >= 0)[..., None]
    lo = jnp.broadcast_to(jnp.where(pos, jnp.float32(0), -jnp.inf), a.shape)
    hi = jnp.broadcast_to(jnp.where(pos, jnp.inf, jnp.float32(0)), a.shape)
    s = jnp.sum(jax.lax.clamp(lo, a, hi), axis=2)  # sum_h w_h ReLU(q_h . k)
    s = s.astype(jnp.bfloat16).astype(jnp.float32)
    G = k.shape[1]
    vis = jnp.arange(G)[None, None] < visible_len[..., None]
    return jnp.where(vis, s, -jnp.inf)
