"""Rotary embeddings on interleaved pairs of the last `rope_head_dim` dims, with YaRN (docs/REFERENCE.md §1)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np


def rope_frequencies(dim: int, base: float, original_seq_len: int = 0, factor: float = 1.0,
                     beta_fast: int = 32, beta_slow: int = 1) -> np.ndarray:
    """Per-pair inverse wavelengths [dim/2] in fp32. With original_seq_len > 0, YaRN blends
    interpolated (÷factor) and original frequencies across the beta_fast..beta_slow band
    (reference model.py: precompute_freqs_cis)."""
    exps = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    freqs = (np.float32(1.0) / np.power(np.float32(base), exps, dtype=np.float32)).astype(np.float32)
    if original_seq_len > 0:
        def corrected_dim(rotations: float) -> float:
            return dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corrected_dim(beta_fast)), 0)
        high = min(math.ceil(corrected_dim(beta_slow)), dim - 1)
        ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(max(high - low, 1e-3)), 0, 1)
        smooth = (np.float32(1) - ramp).astype(np.float32)
        freqs = (freqs / np.float32(factor) * (np.float32(1) - smooth) + freqs * smooth).astype(np.float32)
    return freqs


def layer_frequencies(cfg, ratio: int) -> np.ndarray:
    """Ratio-0 layers use plain RoPE at rope_theta; compressed layers YaRN at compress_rope_theta."""
    if ratio:
        return rope_frequencies(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.original_seq_len,
                                cfg.rope_factor, cfg.beta_fast, cfg.beta_slow)
    return rope_frequencies(cfg.rope_head_dim, cfg.rope_theta)


def cos_sin(positions: jax.Array, freqs: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables [..., dim/2] for integer positions (angle = f32(pos) * freq, as the reference)."""
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(freqs, jnp.float32)
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, rope_dim: int, *, inverse: bool = False) -> jax.Array:
    """Rotate the last `rope_dim` dims of x (pairs (2i, 2i+1)); cos/sin broadcast over heads.

    x: [..., S, (H,) D]; cos/sin: [..., S, rope_dim/2]. Computed in fp32, returned in x.dtype.
    """
    head_axes = x.ndim - cos.ndim
    for _ in range(head_axes):
        cos, sin = cos[..., None, :], sin[..., None, :]
    if inverse:
        sin = -sin
    rot = x[..., -rope_dim:].astype(jnp.float32).reshape(*x.shape[:-1], rope_dim // 2, 2)
    a, b = rot[..., 0], rot[..., 1]
    out = jnp.stack([a * cos - b * sin, a * sin + b * cos], axis=-1).reshape(*x.shape[:-1], rope_dim)
    return jnp.concatenate([x[..., :-rope_dim], out.astype(x.dtype)], axis=-1)
