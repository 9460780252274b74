"""Attention of one layer: low-rank queries, FP8 window KV, sparse sink attention, grouped output.

The cross-layer parts (which compressed entries, whose cache) are decided by the model's
layer loop; this module owns only what every layer has: its query path, its window KV,
its sink and its output projection (docs/REFERENCE.md §3 "Attention").
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.numerics import kv_layout, quant
from dsv41_jax.layers.basic import QLinear, RMSNorm, matmul, weight_kind
from dsv41_jax.layers.compressor import Compressor
from dsv41_jax.layers.indexer import Indexer
from dsv41_jax.layers.rope import apply_rope


class Attention(nnx.Module):
    """One layer's attention; owns a compressor / indexer when its role says so."""

    def __init__(self, cfg, role, *, rngs: nnx.Rngs):
        kind = weight_kind(cfg)
        self.n_heads, self.head_dim, self.rope_dim = cfg.n_heads, cfg.head_dim, cfg.rope_head_dim
        self.o_groups, self.o_lora_rank = cfg.o_groups, cfg.o_lora_rank
        self.attn_sink = nnx.Param(jax.random.normal(rngs.params(), (cfg.n_heads,), jnp.float32))
        self.wq_a = QLinear(cfg.dim, cfg.q_lora_rank, kind, rngs=rngs)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
        self.wq_b = QLinear(cfg.q_lora_rank, cfg.n_heads * cfg.head_dim, kind, rngs=rngs)
        self.wkv = QLinear(cfg.dim, cfg.head_dim, kind, rngs=rngs)
        self.kv_norm = RMSNorm(cfg.head_dim, cfg.norm_eps)
        group_in = cfg.n_heads * cfg.head_dim // cfg.o_groups
        self.wo_a = QLinear(group_in, cfg.o_groups * cfg.o_lora_rank, "dense", rngs=rngs)
        self.wo_b = QLinear(cfg.o_groups * cfg.o_lora_rank, cfg.dim, kind, rngs=rngs, std=0.2 / (cfg.o_groups * cfg.o_lora_rank) ** 0.5)
        self.compressor = Compressor(cfg, role.ratio, rngs=rngs) if role.is_kv_source else None
        self.indexer = Indexer(cfg, role.is_kv_source, rngs=rngs) if role.is_index_source else None

    def queries(self, x, cos, sin, mode):
        """(qr, q): the normed low-rank latent (also the indexer's input) and RoPE'd heads [B,T,H,D]."""
        B, T, _ = x.shape
        qr = self.q_norm(self.wq_a(x, mode), mode)
        q = self.wq_b(qr, mode).reshape(B, T, self.n_heads, self.head_dim)
        return qr, apply_rope(q, cos, sin, self.rope_dim)

    def window_kv(self, x, cos, sin, mode):
        """This chunk's window K (= V): RMSNorm(W_kv x), RoPE, FP8 over all dims. bf16 values."""
        kv = self.kv_norm(self.wkv(x, mode), mode)
        return apply_rope(kv, cos, sin, self.rope_dim)

    def attend_pallas(self, q, window, window_idx, compressed, compressed_idx, scale, runtime):
        """Sparse sink attention through the Pallas kernel (impl="pallas"), reading the quantized caches.

        window: kv_layout.WindowKV [B, W + T, D] (or its word view), the ring followed by this chunk's
        entries, or in decode the ring as written (what window_idx points into; a `kv_layout.LayerRing`
        when the layer's ring is one of a stack, read where it lies); compressed: kv_layout.CompressedKV [B, G, D] or None, with
        compressed_idx [B, T, K] (-1 = empty). Same math as the xla path's `sparse_attention` over
        the dequantized rows (window slots first): bit-exact in exact mode (interpreted, float64),
        f32-rounding close in fast mode. Gradients reach q and the sink through the kernel's
        custom_vjp (the jnp reference's VJP). Training passes the rows before quantization instead of
        containers (window [B, N, D], compressed [B, G, D] or None): `sparse_sink_attention_values`,
        whose VJP also reaches the rows.
        """
        from pallas_kernels import sparse_sink_attention, sparse_sink_attention_values  # optional dependency

        mode = runtime.kernel_mode()
        if mode is None:
            raise ValueError(f"attend_pallas: {runtime} does not run the attention kernel")
        if not isinstance(window, (kv_layout.WindowKV, kv_layout.WindowWords, kv_layout.LayerRing)):
            # training: rows before quantization (the kernel quantizes them as the fake quantization
            # does) and gradients for them too (the values-in custom_vjp)
            if mode != "fast":
                raise ValueError(f"attend_pallas: rows before quantization (training) run fast numerics, got {mode!r}")
            return sparse_sink_attention_values(q, window, compressed, window_idx, compressed_idx, self.attn_sink[...],
                                                scale, impl="pallas", interpret=runtime.resolved_interpret())
        return sparse_sink_attention(q, window, compressed, window_idx, compressed_idx, self.attn_sink[...], scale,
                                     impl="pallas", interpret=runtime.resolved_interpret(), mode=mode)

    def output(self, o, cos, sin, mode):
        """Undo the query rotation on the output, then the grouped o-LoRA and wo_b."""
        B, T = o.shape[:2]
        o = apply_rope(o, cos, sin, self.rope_dim, inverse=True)
        o = o.reshape(B, T, self.o_groups, -1)
        wo_a = self.wo_a.weight[...].reshape(self.o_groups, self.o_lora_rank, -1)
        o = matmul(o, wo_a, "btgd,grd->btgr", o.dtype, mode)
        return self.wo_b(o.reshape(B, T, -1), mode)
