"""Number-format decoders built only from 32-bit integer and float ops.

Kernels cannot call `dsv41_jax.numerics.quant` (its table lookups and float8 casts do not lower to Mosaic
TPU on every generation, nor to Triton), so they decode raw bytes with shifts, masks and float
bit patterns. Every function takes int32 codes and returns float32, and lowers on Mosaic TPU,
Triton and the interpreter. Tests check each one against `dsv41_jax.numerics.quant` and ml_dtypes over all
256 (or 16) codes. Formats: docs/REFERENCE.md §4 and golden README "Weights".
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

_TWO_POW_M127 = 2.0**-127
_TWO_POW_M9 = 2.0**-9


def _bits_to_f32(bits: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(bits.astype(jnp.int32), jnp.float32)


def e8m0_to_f32(code: jax.Array) -> jax.Array:
    """E8M0 byte b -> 2^(b-127); b = 0 gives 2^-127 (a float32 subnormal), b = 255 NaN."""
    code = code & 0xFF
    normal = _bits_to_f32(code << 23)
    value = jnp.where(code == 0, jnp.float32(_TWO_POW_M127), normal)
    return jnp.where(code == 255, jnp.float32(jnp.nan), value)


def e4m3_to_f32(code: jax.Array) -> jax.Array:
    """E4M3 (fn) byte -> float32: bias 7, subnormals m * 2^-9, 0x7F / 0xFF are NaN, no inf."""
    code = code & 0xFF
    sign = code >> 7
    exponent = (code >> 3) & 0xF
    mantissa = code & 0x7
    normal = _bits_to_f32(((exponent + 120) << 23) | (mantissa << 20))
    subnormal = mantissa.astype(jnp.float32) * jnp.float32(_TWO_POW_M9)
    magnitude = jnp.where(exponent == 0, subnormal, normal)
    magnitude = jnp.where((exponent == 15) & (mantissa == 7), jnp.float32(jnp.nan), magnitude)
    return jnp.where(sign == 1, -magnitude, magnitude)


def e2m1_to_f32(code: jax.Array) -> jax.Array:
    """4-bit E2M1 code (sign = bit 3) -> one of {0, .5, 1, 1.5, 2, 3, 4, 6} with its sign."""
    code = code & 0xF
    exponent = (code >> 1) & 0x3
    mantissa = (code & 0x1).astype(jnp.float32)
    # exponent e > 0: (1 + m/2) * 2^(e-1); e = 0: the subnormal m/2
    power = _bits_to_f32((exponent + 126) << 23)
    magnitude = jnp.where(exponent == 0, mantissa * 0.5, (1.0 + mantissa * 0.5) * power)
    return jnp.where(code >= 8, -magnitude, magnitude)


def byte_of_word(words: jax.Array, which: int) -> jax.Array:
    """Byte `which` (0 = least significant) of int32 words, as int32 in [0, 255]."""
    return jax.lax.shift_right_logical(words, jnp.int32(8 * which)) & 0xFF


def nibble_of_word(words: jax.Array, which: int) -> jax.Array:
    """Nibble `which` (0 = least significant) of int32 words, as int32 in [0, 15]."""
    return jax.lax.shift_right_logical(words, jnp.int32(4 * which)) & 0xF


def idiv(x: jax.Array, n: int) -> jax.Array:
    """x // n for non-negative int32 x, as lax.div: jnp's floor division lowers through `sign`,
    which Mosaic only lowers on a real chip, and a bare Python n would turn int64 under x64."""
    return jax.lax.div(x, jnp.asarray(n, x.dtype))


def irem(x: jax.Array, n: int) -> jax.Array:
    """x % n for non-negative int32 x (see `idiv`)."""
    return jax.lax.rem(x, jnp.asarray(n, x.dtype))
