"""The V4.1 vision tower (ViT) and aligner as Flax NNX modules (docs/VISION.md).

ViT: patch linear, then blocks of x += wo(attn(RoPE2d(q), RoPE2d(k), v)) over RMSNorm(x) and
x += w2(silu(gate) * up) over RMSNorm(x), a final RMSNorm. Full bidirectional attention over one
image, no sink. The 2-D RoPE rotates the half-split pairs (i, i + hd/2) of each head: the first
hd/4 pairs by the patch row, the rest by the patch column. Aligner: zero-pad the patch grid to
multiples of r at the bottom/right, flatten every r x r cell channel-major (channel, row, column)
and run w2(gelu_erf(w1(.))) into the model width.

Exact mode mirrors the golden oracle's vision numerics: every Linear is an exact dot plus bias
rounded once to BF16; attention scores are F32(exact q.k) x scale, softmax in F32 as torch's CPU
kernel, P.V exact and rounded once to BF16; norms, RoPE, SiLU and GELU as torch's CPU ops.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.config import ModelConfig
from dsv41_jax.numerics import mkl_sincos
from dsv41_jax.numerics.activations import gelu_erf, silu, softmax_lastdim
from dsv41_jax.layers.basic import KeyStream, matmul, rms_norm, round_from_f64
from dsv41_jax.layers.rope import rope_frequencies
from dsv41_jax.numerics.exact_ops import no_fma

VISION_NORM_EPS = 1e-6


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None, mode: str) -> jax.Array:
    """x @ w.T (+ b) in BF16; exact mode sums the exact dot and the bias and rounds once."""
    if mode == "exact":
        y = jnp.einsum("...i,oi->...o", x.astype(jnp.float64), w.astype(jnp.float64),
                       precision=jax.lax.Precision.HIGHEST)
        if b is not None:
            y = y + b.astype(jnp.float64)
        return round_from_f64(y, jnp.bfloat16)
    y = jnp.einsum("...i,oi->...o", x, w, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(jnp.bfloat16)


class Linear(nnx.Module):
    """A BF16 Linear with an optional bias (names as the checkpoint: weight [out, in], bias [out])."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, rngs: KeyStream, std: float | None = None):
        std = 1.0 / math.sqrt(in_features) if std is None else std
        self.weight = nnx.Param((jax.random.normal(rngs.params(), (out_features, in_features)) * std).astype(jnp.bfloat16))
        self.bias = nnx.Param((jax.random.normal(rngs.params(), (out_features,)) * 0.1).astype(jnp.bfloat16)) if bias else None

    def __call__(self, x, mode):
        return linear(x, self.weight[...], None if self.bias is None else self.bias[...], mode)


class Norm(nnx.Module):
    """RMSNorm with an F32 gain and eps 1e-6 (the vision norms)."""

    def __init__(self, dim: int):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))

    def __call__(self, x, mode):
        return rms_norm(x, self.weight[...], VISION_NORM_EPS, mode)


def rope_2d(n_h: int, n_w: int, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin [n_h * n_w, head_dim / 2]: per patch (row-major), hd/4 angles row * f_i then hd/4
    angles column * f_i, f_i = theta^(-i / (hd/4)), in F32 as the reference's table (cos/sin
    rounded as torch's CPU kernels round them: `numerics.mkl_sincos`)."""
    freqs = rope_frequencies(head_dim // 2, theta)  # [hd/4] fp32, 1 / theta^(2i / (hd/2))
    rows = np.repeat(np.arange(n_h), n_w).astype(np.float32)
    cols = np.tile(np.arange(n_w), n_h).astype(np.float32)
    ang = np.concatenate([rows[:, None] * freqs, cols[:, None] * freqs], -1).astype(np.float32)
    # the reference's freqs.cos() / freqs.sin(): torch's CPU cos/sin are MKL's, not correctly rounded;
    # a float64 cos rounded once differs on ~8 % of the angles, enough to flip bf16 q/k values
    return jnp.asarray(mkl_sincos.cosf_mkl(ang)), jnp.asarray(mkl_sincos.sinf_mkl(ang))


def apply_rope_half(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate pairs (i, i + D/2) of x [N, H, D]; cos/sin [N, D/2]. F32 math, result in x.dtype."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    x1, x2 = xf[..., :half], xf[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    out = jnp.concatenate([no_fma(x1 * c) - no_fma(x2 * s), no_fma(x2 * c) + no_fma(x1 * s)], -1)
    return out.astype(x.dtype)


class Attention(nnx.Module):
    """Fused QKV (with bias), 2-D RoPE, full softmax attention over the image, output Linear (with bias)."""

    def __init__(self, cfg: ModelConfig, *, rngs: KeyStream):
        d = cfg.vision_dim
        self.n_heads, self.head_dim = cfg.vision_n_heads, d // cfg.vision_n_heads
        self.wqkv = Linear(d, 3 * d, bias=True, rngs=rngs)
        self.wo = Linear(d, d, bias=True, rngs=rngs, std=0.5 / math.sqrt(d))

    def __call__(self, x, cos, sin, mode):
        N = x.shape[0]
        qkv = self.wqkv(x, mode).reshape(N, 3, self.n_heads, self.head_dim)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        q, k = apply_rope_half(q, cos, sin), apply_rope_half(k, cos, sin)
        scale = jnp.float32(self.head_dim ** -0.5)
        scores = matmul(q, k, "nhd,mhd->hnm", jnp.float32, mode) * scale
        p = softmax_lastdim(scores, mode)
        o = matmul(p, v.astype(jnp.float32) if mode != "exact" else v, "hnm,mhd->nhd", jnp.bfloat16, mode)
        return self.wo(o.reshape(N, -1), mode)


class MLP(nnx.Module):
    """Bias-free SwiGLU: w1 gives [gate, up] halves, w2 projects back."""

    def __init__(self, cfg: ModelConfig, *, rngs: KeyStream):
        d, f = cfg.vision_dim, cfg.vision_inter_dim
        self.w1 = Linear(d, 2 * f, bias=False, rngs=rngs)
        self.w2 = Linear(f, d, bias=False, rngs=rngs, std=0.5 / math.sqrt(f))

    def __call__(self, x, mode):
        gate, up = jnp.split(self.w1(x, mode), 2, axis=-1)
        h = silu(gate, mode).astype(jnp.bfloat16) * up
        return self.w2(h, mode)


class VitBlock(nnx.Module):
    """Pre-norm attention and MLP, residual in BF16."""

    def __init__(self, cfg: ModelConfig, *, rngs: KeyStream):
        self.norm1 = Norm(cfg.vision_dim)
        self.attn = Attention(cfg, rngs=rngs)
        self.norm2 = Norm(cfg.vision_dim)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x, cos, sin, mode):
        x = x + self.attn(self.norm1(x, mode), cos, sin, mode)
        return x + self.mlp(self.norm2(x, mode), mode)


class PatchEmbed(nnx.Module):
    """One Linear over the flattened (channel, row, column) patch."""

    def __init__(self, cfg: ModelConfig, *, rngs: KeyStream):
        self.proj = Linear(3 * cfg.vision_patch_size ** 2, cfg.vision_dim, bias=True, rngs=rngs)

    def __call__(self, patches, mode):
        return self.proj(patches.reshape(patches.shape[0], -1).astype(jnp.bfloat16), mode)


class ViT(nnx.Module):
    """patches [n_h * n_w, 3, p, p] (row-major) -> features [n_h * n_w, vision_dim] after the final norm."""

    def __init__(self, cfg: ModelConfig, *, rngs: KeyStream):
        self.head_dim, self.theta = cfg.vision_dim // cfg.vision_n_heads, cfg.vision_rope_theta
        self.patch_embed = PatchEmbed(cfg, rngs=rngs)
        self.blocks = nnx.List([VitBlock(cfg, rngs=rngs) for _ in range(cfg.vision_n_layers)])
        self.norm = Norm(cfg.vision_dim)

    def __call__(self, patches, n_h: int, n_w: int, mode: str = "fast", trace: dict | None = None):
        if patches.shape[0] != n_h * n_w:
            raise ValueError(f"ViT: {patches.shape[0]} patches do not fill a {n_h} x {n_w} grid")
        cos, sin = rope_2d(n_h, n_w, self.head_dim, self.theta)
        x = self.patch_embed(patches, mode)
        if trace is not None:
            trace["patch_embed"] = x
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, mode)
            if trace is not None:
                trace[f"vit_block{i}"] = x
        return self.norm(x, mode)


def unfold_cells(x: jax.Array, n_h: int, n_w: int, r: int) -> jax.Array:
    """Features [n_h * n_w, C] -> [ceil(n_h/r) * ceil(n_w/r), C * r * r]: the grid zero-padded to
    multiples of r at the bottom/right, each r x r cell flattened (channel, row, column), cells in
    reading order (torch's F.unfold with kernel = stride = r)."""
    C = x.shape[-1]
    H, W = -(-n_h // r), -(-n_w // r)
    g = jnp.pad(x.reshape(n_h, n_w, C), ((0, H * r - n_h), (0, W * r - n_w), (0, 0)))
    g = g.reshape(H, r, W, r, C).transpose(0, 2, 4, 1, 3)  # [H, W, C, r, r]
    return g.reshape(H * W, C * r * r)


class Aligner(nnx.Module):
    """r x r cells of ViT features -> one model-width vector each: w2(gelu_erf(w1(cell)))."""

    def __init__(self, cfg: ModelConfig, *, rngs: KeyStream):
        self.r = cfg.vision_downsample_ratio
        self.w1 = Linear(cfg.vision_dim * self.r ** 2, cfg.dim, bias=True, rngs=rngs)
        self.w2 = Linear(cfg.dim, cfg.dim, bias=True, rngs=rngs)

    def __call__(self, x, n_h: int, n_w: int, mode: str = "fast"):
        h = self.w1(unfold_cells(x, n_h, n_w, self.r), mode)
        return self.w2(gelu_erf(h, mode).astype(jnp.bfloat16), mode)
