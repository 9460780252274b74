"""Engram: an n-gram memory written into every residual copy through a learned gate (docs/REFERENCE.md §3).

The hash ids are computed on the host in int64 (`dsv41_jax.engram.hashing`) and arrive here as
row ids; this module owns the FP8 table, the key/value projection and the per-copy gate.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.numerics import quant
from dsv41_jax.numerics.exact_ops import no_fma, torch_sum_last
from dsv41_jax.numerics.activations import sigmoid, sqrt
from dsv41_jax.layers.basic import QLinear, inv_sqrt, mean_square, weight_kind


class Engram(nnx.Module):
    """Table lookup -> W_e -> [K_1..K_hc, V]; copy j gets sigma(signed-sqrt(<X_j w, K_j>)) * V."""

    def __init__(self, cfg, rows: int, *, rngs: nnx.Rngs):
        self.hc, self.dim, self.eps = cfg.hc_mult, cfg.dim, cfg.norm_eps
        self.head_dim = cfg.engram_head_dim
        n_cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        table = jax.random.normal(rngs.params(), (rows, cfg.engram_head_dim), jnp.float32)
        q, s = quant.quant_fp8_act(table, 32)  # per-row scale per 32, as the checkpoint stores it
        self.embed = nnx.Param(q)
        self.embed_scale = nnx.Param(s)
        self.wkv = QLinear(n_cols * cfg.engram_head_dim, cfg.dim * (cfg.hc_mult + 1), weight_kind(cfg), rngs=rngs)
        self.q_weight = nnx.Param(jnp.ones((cfg.hc_mult, cfg.dim), jnp.bfloat16))
        self.k_weight = nnx.Param(jnp.ones((cfg.hc_mult, cfg.dim), jnp.bfloat16))

    def lookup(self, ids: jax.Array) -> jax.Array:
        """Rows [B, T, n_cols] -> dequantized bf16 [B, T, n_cols * head_dim]."""
        vals = quant.dequant_fp8_act(self.embed[...][ids], self.embed_scale[...][ids], 32)
        return vals.astype(jnp.bfloat16).reshape(*ids.shape[:-1], -1)

    def __call__(self, h: jax.Array, ids: jax.Array, mode: str):
        """h [B, T, hc, d] bf16 -> (h', gate [B, T, hc])."""
        kv = self.wkv(self.lookup(ids), mode)
        key = kv[..., : self.hc * self.dim].astype(jnp.float32).reshape(*kv.shape[:-1], self.hc, self.dim)
        value = kv[..., self.hc * self.dim:].astype(jnp.float32)
        w = self.q_weight[...].astype(jnp.float32) * self.k_weight[...].astype(jnp.float32)
        x = h.astype(jnp.float32)
        eps = jnp.float32(self.eps)
        rstd = inv_sqrt(mean_square(x, mode)[..., 0] + eps, mode) * inv_sqrt(mean_square(key, mode)[..., 0] + eps, mode)
        if mode == "exact":  # torch's summation order and its exp (see exact_ops, sleef_exp)
            dot = torch_sum_last(no_fma(no_fma(x * w) * key))
            dot = no_fma(no_fma(dot * rstd) * jnp.float32(self.dim ** -0.5))
        else:
            dot = jnp.sum(x * w * key, -1) * rstd * jnp.float32(self.dim ** -0.5)
        root = sqrt(jnp.maximum(jnp.abs(dot), jnp.float32(1e-6)), mode)
        # One oracle call per sequence is [T, hc]: its last elements (every one at decode, hc < 32)
        # take torch's scalar sigmoid (glibc expf), the rest SLEEF's vector body (docs/NUMERICS.md).
        gate = sigmoid(jnp.copysign(root, dot), mode, tail_dims=2)
        inject = gate[..., None] * value[..., None, :]
        if mode == "exact":
            inject = no_fma(inject)
        return (x + inject).astype(h.dtype), gate
