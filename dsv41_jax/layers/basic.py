"""Small building blocks: quantization-aware Linear, RMSNorm, and exact-mode dot products."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.numerics import gemm, quant
from dsv41_jax.numerics.exact_ops import exact_sqrt, no_fma, torch_mean_last, true_divide


def round_from_f64(y: jax.Array, dtype) -> jax.Array:
    """Round a float64 result to `dtype` the way torch's CPU cast does: through fp32.

    (torch converts double -> float -> bfloat16; the golden oracle's "rounded once" results
    went through that cast, so we mirror it rather than a direct correctly rounded cast.)
    """
    return y.astype(jnp.float32).astype(dtype)


def matmul(x: jax.Array, w: jax.Array, spec: str, out_dtype, mode: str) -> jax.Array:
    """einsum with the oracle's numerics in exact mode (float64, one rounding), fp32 accumulation otherwise."""
    if mode == "exact":
        y = jnp.einsum(spec, x.astype(jnp.float64), w.astype(jnp.float64), precision=jax.lax.Precision.HIGHEST)
        return round_from_f64(y, out_dtype)
    y = jnp.einsum(spec, x, w, preferred_element_type=jnp.float32, precision=jax.lax.Precision.HIGHEST)
    return y.astype(out_dtype)


def mean_square(x: jax.Array, mode: str = "fast") -> jax.Array:
    """mean(x^2) over the last axis in fp32 (keepdims). Exact mode squares in fp32 and sums in
    the order of torch's CPU reduction kernel (`exact_ops.torch_mean_last`), as the oracle did."""
    xf = x.astype(jnp.float32)
    if mode == "exact":
        return torch_mean_last(no_fma(xf * xf), keepdims=True)
    return jnp.mean(jnp.square(xf), axis=-1, keepdims=True)


def inv_sqrt(x: jax.Array, mode: str = "fast") -> jax.Array:
    """1/sqrt(x); exact mode rounds sqrt and the division separately (torch's vectorized rsqrt)."""
    if mode == "exact":  # the fence stops XLA from rewriting 1/sqrt into its (inexact) rsqrt
        return true_divide(jnp.ones_like(x), no_fma(exact_sqrt(x)))
    return jax.lax.rsqrt(x)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, mode: str = "fast") -> jax.Array:
    """RMSNorm computed in fp32, returned in the input dtype (reference RMSNorm)."""
    xf = x.astype(jnp.float32)
    y = xf * inv_sqrt(mean_square(xf, mode) + jnp.float32(eps), mode)
    if mode == "exact":  # two roundings, as torch does: no FMA with the gain multiply
        y = no_fma(y)
    return (weight.astype(jnp.float32) * y).astype(x.dtype)


class RMSNorm(nnx.Module):
    """Norm with a learned (bf16) gain; eps is tiny (1e-20) in V4.1, so fp32 matters."""

    def __init__(self, dim: int, eps: float, *, dtype=jnp.bfloat16):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x, mode: str = "fast"):
        return rms_norm(x, self.weight[...], self.eps, mode)


class QLinear(nnx.Module):
    """A Linear whose weight is kept as the checkpoint stores it.

    kind "fp8": E4M3 weight + E8M0 scale per 32x32 block; "fp4": packed E2M1 [out, in/2] + E8M0
    per 32 along in; "dense": a plain bf16/fp32 matrix. Quantized kinds quantize the activation
    to FP8 per 32 first, as the reference `linear()` does.
    """

    def __init__(self, in_features: int, out_features: int, kind: str, *, rngs: nnx.Rngs,
                 dtype=jnp.bfloat16, std: float | None = None):
        self.in_features, self.out_features, self.kind = in_features, out_features, kind
        std = 1.0 / math.sqrt(in_features) if std is None else std
        w = jax.random.normal(rngs.params(), (out_features, in_features), jnp.float32) * std
        if kind == "fp8":
            q, s = quant.quant_fp8_weight(w)
            self.weight, self.scale = nnx.Param(q), nnx.Param(s)
        elif kind == "fp4":
            q, s = quant.quant_fp4_weight(w)
            self.weight, self.scale = nnx.Param(q), nnx.Param(s)
        elif kind == "dense":
            self.weight, self.scale = nnx.Param(w.astype(dtype)), None
        else:
            raise ValueError(f"QLinear kind must be 'fp8', 'fp4' or 'dense', got {kind!r}")

    def __call__(self, x: jax.Array, mode: str = "fast", out_dtype=None) -> jax.Array:
        scale = None if self.scale is None else self.scale[...]
        return gemm.linear(x, self.weight[...], scale, kind=self.kind, mode=mode, out_dtype=out_dtype)

    def dequantized(self) -> jax.Array:
        """The weight as fp32 values (exact: FP8/FP4 values are representable)."""
        if self.kind == "fp8":
            return quant.dequant_fp8_weight(self.weight[...], self.scale[...])
        if self.kind == "fp4":
            return quant.dequant_fp4_weight(self.weight[...], self.scale[...])
        return self.weight[...].astype(jnp.float32)


def weight_kind(cfg, *, expert: bool = False) -> str:
    """Storage kind of a quantizable Linear under this config (docs/REFERENCE.md §4 table)."""
    if expert:
        return "fp4" if cfg.expert_dtype == "fp4" else ("fp8" if cfg.dtype == "fp8" else "dense")
    return "fp8" if cfg.dtype == "fp8" else "dense"


class KeyStream:
    """Deterministic per-parameter keys (fold_in of a counter).

    Used instead of `nnx.Rngs` streams inside module constructors: folding in a counter keeps
    tracing linear in the number of parameters, which matters under `nnx.eval_shape` of the
    full 40-layer model.
    """

    def __init__(self, seed):
        if isinstance(seed, nnx.Rngs):
            seed = seed.params()
        self.key = jax.random.key(seed) if isinstance(seed, int) else seed
        self.count = 0

    def params(self) -> jax.Array:
        self.count += 1
        return jax.random.fold_in(self.key, self.count)
