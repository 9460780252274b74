"""Host-side FP8 weights with 32x32 E8M0 tiles, for the one tensor the model keeps wider than
the release stores it: `attn.wo_a` (FP8 + scale on disk, bf16 in use; docs/REFERENCE.md §4).

numpy rather than `dsv41_jax.numerics.quant` because this runs per tensor while reading or writing
shards, where eager JAX would compile a program per shape.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

BLOCK = 32
E4M3_MAX = 448.0
_BF16, _E4M3 = np.dtype(ml_dtypes.bfloat16), np.dtype(ml_dtypes.float8_e4m3fn)


def e8m0_values(scale_bytes: np.ndarray) -> np.ndarray:
    """2^(b-127) as float32 (b = 0 gives the subnormal 2^-127; 255 is NaN)."""
    b = np.asarray(scale_bytes).view(np.uint8).astype(np.int32)
    return np.where(b == 255, np.float32(np.nan), np.ldexp(np.float32(1), b - 127)).astype(np.float32)


def _tile_repeat(s: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    return np.repeat(np.repeat(s, BLOCK, 0), BLOCK, 1)[: shape[0], : shape[1]]


def dequantize(weight: np.ndarray, scale_bytes: np.ndarray) -> np.ndarray:
    """bf16 values of an E4M3 [N, K] weight: fp32 product with its tile scale, one rounding."""
    return (weight.astype(np.float32) * _tile_repeat(e8m0_values(scale_bytes), weight.shape)).astype(_BF16)


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(E4M3 [N, K], E8M0 bytes [ceil(N/32), ceil(K/32)]): s = 2^ceil(log2(amax/448)) per tile,
    read from the float32 bits as the reference does (golden README), q = e4m3_rne(w / s)."""
    w = np.asarray(w, np.float32)
    n, k = w.shape
    pad = np.pad(w, ((0, -n % BLOCK), (0, -k % BLOCK)))
    amax = np.abs(pad.reshape(pad.shape[0] // BLOCK, BLOCK, pad.shape[1] // BLOCK, BLOCK)).max(axis=(1, 3))
    bits = (amax / np.float32(E4M3_MAX)).astype(np.float32).view(np.uint32)
    exp, man = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    b = np.minimum(exp + ((man != 0) & (exp != 255)), 255).astype(np.uint8)
    q = np.clip(w / _tile_repeat(e8m0_values(b), w.shape), -E4M3_MAX, E4M3_MAX).astype(_E4M3)
    return q, b


def exact_fp8(w_bf16: np.ndarray):
    """(q, scale bytes, lossless?) for a bf16 matrix."""
    q, s = quantize(w_bf16.astype(np.float32))
    return q, s, np.array_equal(dequantize(q, s).view(np.uint16), np.asarray(w_bf16, _BF16).view(np.uint16))
