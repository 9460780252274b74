"""Rotary embeddings on interleaved pairs of the last `rope_head_dim` dims, with YaRN (docs/REFERENCE.md §1)."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.numerics import libm_sincos, sleef_powf
from dsv41_jax.numerics.exact_ops import no_fma



def rope_frequencies(dim: int, base: float, original_seq_len: int = 0, factor: float = 1.0,
                     beta_fast: int = 32, beta_slow: int = 1) -> np.ndarray:
    """Per-pair inverse wavelengths [dim/2] in fp32, in the reference's operation order
    (docs/NUMERICS.md, "RoPE tables"). With original_seq_len > 0, YaRN blends interpolated
    (÷factor) and original frequencies across the beta_fast..beta_slow band."""
    f32 = np.float32
    exps = np.arange(0, dim, 2, dtype=f32) / f32(dim)  # true fp32 division
    # torch's pow(Scalar, Tensor) on the oracle's CPU: SLEEF's powf_u10 on its AVX-512 body (the first
    # 32 * floor(n / 32) elements), glibc powf on the scalar rest, so every element is glibc's when
    # dim/2 < 32 (every shared golden table) and SLEEF's for the released rope_head_dim 64
    # (numerics/sleef_powf.py; both transcribed, so the table does not depend on this host's numpy).
    powers = sleef_powf.rope_pow(base, exps)
    freqs = (f32(1.0) / powers).astype(f32)  # torch: reciprocal, then * 1.0 (exact)
    if original_seq_len > 0:
        def corrected_dim(rotations: float) -> float:  # Python float64, as the reference
            return dim * math.log(original_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(corrected_dim(beta_fast)), 0)
        high = min(math.ceil(corrected_dim(beta_slow)), dim - 1)
        ramp = np.clip((np.arange(dim // 2, dtype=f32) - f32(low)) / f32(max(high - low, 1e-3)), f32(0), f32(1))
        smooth = (f32(1) - ramp).astype(f32)
        freqs = (freqs / f32(factor) * (f32(1) - smooth) + freqs * smooth).astype(f32)
    return freqs


@dataclass(frozen=True, eq=False)
class RopeTable:
    """The reference's `precompute_freqs_cis` rows, built once on the host: cos/sin [rows, dim/2]
    of the fp32 angle f32(position) * freq, with glibc's cosf/sinf (what `torch.polar` calls).
    Built in numpy so no backend's cos (XLA on GPU/TPU rounds differently) enters the tables."""
    freqs: np.ndarray
    cos: np.ndarray
    sin: np.ndarray

    @property
    def rows(self) -> int:
        return self.cos.shape[0]


@functools.lru_cache(maxsize=16)
def rope_table(dim: int, rows: int, base: float, original_seq_len: int = 0, factor: float = 1.0,
               beta_fast: int = 32, beta_slow: int = 1) -> RopeTable:
    """`precompute_freqs_cis(dim, rows, original_seq_len, base, factor, beta_fast, beta_slow)`."""
    freqs = rope_frequencies(dim, base, original_seq_len, factor, beta_fast, beta_slow)
    angles = np.arange(rows, dtype=np.int64).astype(np.float32)[:, None] * freqs[None, :]  # torch.outer
    return RopeTable(freqs, libm_sincos.cosf(angles), libm_sincos.sinf(angles))


def layer_rope(cfg, ratio: int) -> RopeTable:
    """Ratio-0 layers use plain RoPE at rope_theta; compressed layers YaRN at compress_rope_theta.
    One row per position below max_seq_len, like the reference's freqs_cis buffer."""
    if ratio:
        return rope_table(cfg.rope_head_dim, cfg.max_seq_len, float(cfg.compress_rope_theta), cfg.original_seq_len,
                          float(cfg.rope_factor), cfg.beta_fast, cfg.beta_slow)
    return rope_table(cfg.rope_head_dim, cfg.max_seq_len, float(cfg.rope_theta))


def cos_sin(positions: jax.Array, rope: RopeTable) -> tuple[jax.Array, jax.Array]:
    """cos/sin [..., dim/2] for integer positions: rows of the reference's table. Positions past
    the table (a serving cache larger than max_seq_len; the reference has no such rows) use XLA's
    cos/sin of the same fp32 angle."""
    positions = jnp.asarray(positions)
    inside = (positions >= 0) & (positions < rope.rows)
    rows = jnp.clip(positions, 0, rope.rows - 1)
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope.freqs, jnp.float32)
    cos = jnp.where(inside[..., None], jnp.asarray(rope.cos)[rows], jnp.cos(ang))
    sin = jnp.where(inside[..., None], jnp.asarray(rope.sin)[rows], jnp.sin(ang))
    return cos, sin


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
    # torch's complex multiply rounds each product, then adds; under jit XLA's CPU backend would contract
    # a product and the add into one FMA (one rounding), which flips a bf16 rounding of the output now and
    # then (dspark_fp8/spec_greedy_P24_N40's corrected drafts, steps 10 and 16): fence the products.
    ac, bs, as_, bc = no_fma(a * cos), no_fma(b * sin), no_fma(a * sin), no_fma(b * cos)
    out = jnp.stack([ac - bs, as_ + bc], axis=-1).reshape(*x.shape[:-1], rope_dim)
    return jnp.concatenate([x[..., :-rope_dim], out.astype(x.dtype)], axis=-1)
