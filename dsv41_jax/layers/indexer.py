"""The indexer: picks the compressed positions each query attends to (docs/REFERENCE.md §3 "Indexer").

FP4 query heads score every visible index key with a weighted ReLU sum; the candidate-pool
source also ranks absolute blocks of positions, and Reindex layers after it search only
inside that pool. Keys belong to the KV source (made from its pre-RoPE latent).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.numerics import kv_layout, quant
from dsv41_jax.numerics.exact_ops import no_fma, torch_sum_axis
from dsv41_jax.layers.basic import QLinear, RMSNorm, matmul, weight_kind
from dsv41_jax.layers.rope import apply_rope


class Indexer(nnx.Module):
    """Query side (every index source) and, for KV sources, the key projection."""

    def __init__(self, cfg, owns_keys: bool, *, rngs: nnx.Rngs):
        self.n_heads, self.head_dim, self.rope_dim = cfg.index_n_heads, cfg.index_head_dim, cfg.rope_head_dim
        self.wq_b = QLinear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, weight_kind(cfg), rngs=rngs)
        self.weights_proj = QLinear(cfg.dim, cfg.index_n_heads, "dense", rngs=rngs, std=2 / cfg.dim ** 0.5)
        self.wk = QLinear(cfg.head_dim, cfg.index_head_dim, "dense", rngs=rngs) if owns_keys else None
        self.k_norm = RMSNorm(cfg.index_head_dim, cfg.norm_eps) if owns_keys else None

    def keys(self, latent: jax.Array, cos, sin, mode: str) -> jax.Array:
        """Index keys from the pre-RoPE latent: RMSNorm(W_k c), RoPE at the group position, MXFP4."""
        k = self.k_norm(self.wk(latent, mode), mode)
        k = apply_rope(k, cos, sin, self.rope_dim)
        return k

    def scores(self, x, qr, keys_bf16, cos, sin, visible_len, mode: str) -> jax.Array:
        """I[b,t,g] = sum_h w[b,t,h] relu(q[b,t,h] . k[b,g]) in the reference's bf16 rounding points;
        -inf where g >= visible_len[b,t]."""
        B, T, _ = x.shape
        q = self.wq_b(qr, mode).reshape(B, T, self.n_heads, self.head_dim)
        q = quant.fake_fp4_mx(apply_rope(q, cos, sin, self.rope_dim), 32)
        w = self.weights_proj(x, mode)
        w = (w.astype(jnp.float32) * jnp.float32(self.head_dim ** -0.5 * self.n_heads ** -0.5)).astype(jnp.bfloat16)
        s = matmul(q, keys_bf16, "bthd,bgd->bthg", jnp.bfloat16, mode)
        # the bf16 rounding of each head's product is a reference rounding point; the fence keeps
        # XLA from computing product and sum in one fp32 pass
        s = no_fma(jax.nn.relu(s) * w[..., None])
        s = s.astype(jnp.float32)
        # the head sum runs over a strided axis in torch: in order, folded in levels of 16
        s = (torch_sum_axis(s, 2) if mode == "exact" else jnp.sum(s, axis=2)).astype(jnp.bfloat16)
        G = keys_bf16.shape[1]
        vis = jnp.arange(G)[None, None] < visible_len[..., None]
        return jnp.where(vis, s.astype(jnp.float32), -jnp.inf)

    def scores_pallas(self, x, qr, keys: kv_layout.IndexKeys, cos, sin, visible_len, runtime, pool=None) -> jax.Array:
        """`scores` through the Pallas indexer kernel (impl="pallas"), reading the MXFP4 index-key cache.

        The queries are quantized here (the codes `quant.fake_fp4_mx` rounds to in `scores`) and
        dequantized in the kernel; the kernel rounds at the same bf16 points (dot, weighted term,
        head sum). pool: optional bool [B, T, G] candidate pool, applied in the kernel (-inf outside).
        Exact mode (interpreted) computes the dots in float64 like `matmul(..., "exact")`.
        """
        from pallas_kernels import indexer_scores  # the kernels are an optional dependency

        mode = runtime.kernel_mode()
        if mode is None:
            raise ValueError(f"scores_pallas: {runtime} does not run the indexer kernel")
        B, T, _ = x.shape
        q = self.wq_b(qr, mode).reshape(B, T, self.n_heads, self.head_dim)
        q_packed, q_scale = quant.quant_fp4_mx(apply_rope(q, cos, sin, self.rope_dim), 32)
        w = self.weights_proj(x, mode)
        w = (w.astype(jnp.float32) * jnp.float32(self.head_dim ** -0.5 * self.n_heads ** -0.5)).astype(jnp.bfloat16)
        return indexer_scores(q_packed, q_scale, keys, w.astype(jnp.float32), visible_len.astype(jnp.int32), pool,
                              bf16_rounding=True, impl="pallas", interpret=runtime.resolved_interpret(), mode=mode)


def index_key_container(cfg, cache: dict, role, quirk: bool) -> kv_layout.IndexKeys:
    """The quantized index keys an index source scores: the container-level twin of the model's
    `model.cache.index_keys_for` (same selection, before dequantization; the two commute)."""
    own = cache["index_keys"][f"layer{role.kv_source}"]
    if not quirk:
        return own
    G = own.packed.shape[1]
    out = own
    for s in cfg.index_kv_sources:
        if s == role.kv_source:
            continue
        other = kv_layout.resize_rows(cache["index_keys"][f"layer{s}"], G)
        out = kv_layout.where_batch(cache["published"] == s, other, out)
    return out


def candidate_pool(scores: jax.Array, visible_len: jax.Array, n_blocks: int, block: int):
    """Level one of the two-level top-k: keep the `n_blocks` best absolute blocks per query.

    A block scores the max of its positions; the block holding the newest visible position is
    pinned (+inf); picks that come back -inf (nothing reachable) are dropped.
    Returns (pool mask like scores, block scores [.., n_total_blocks]). The math is the kernel
    package's reference (`pallas_kernels/indexer/reference.py: candidate_blocks`), kept once.
    """
    from pallas_kernels.indexer.reference import candidate_blocks  # the kernels are an optional dependency

    return candidate_blocks(scores, visible_len, block, n_blocks)


def select_topk(scores: jax.Array, visible_len: jax.Array, k: int):
    """Top-k positions (ties to the lower index), sorted ascending; unreachable slots are -1."""
    _, idx = jax.lax.top_k(scores, k)
    idx = jnp.sort(idx, axis=-1)
    return jnp.where(idx < visible_len[..., None], idx, -1).astype(jnp.int32)
