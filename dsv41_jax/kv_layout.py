"""The kernel-facing cache layout: the one place that says how cached KV is stored.

Every cached tensor is stored quantized, in the byte formats of SPEC §4, so that
the model, the Pallas kernels and the byte accounting all read the same thing:

- window ring (per layer): E4M3 values + one E8M0 byte per 32 dims  -> 512 + 16 = 528 B
- compressed KV (per KV source): packed E2M1 + one E4M3 scale per 16 -> 256 + 32 = 288 B
- index keys (per KV source): packed E2M1 + one E8M0 byte per 32     ->  64 +  4 =  68 B

The serving engine's packed, paged layout replaces these containers; kernels and
model code only go through the constructors and dequantizers below.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class WindowKV(NamedTuple):
    """FP8 window entries: values [..., D] float8_e4m3fn, scales [..., D/32] uint8 (E8M0)."""

    values: jax.Array
    scales: jax.Array


class CompressedKV(NamedTuple):
    """FP4 compressed entries: packed [..., D/2] uint8 (E2M1 pairs), scales [..., D/16] float8_e4m3fn."""

    packed: jax.Array
    scales: jax.Array


class IndexKeys(NamedTuple):
    """MXFP4 index keys: packed [..., Di/2] uint8, scales [..., Di/32] uint8 (E8M0)."""

    packed: jax.Array
    scales: jax.Array


def quantize_window(x: jax.Array) -> WindowKV:
    from dsv41_jax import quant

    return WindowKV(*quant.quant_fp8_act(x, 32))


def dequantize_window(w: WindowKV) -> jax.Array:
    from dsv41_jax import quant

    return quant.dequant_fp8_act(w.values, w.scales, 32)


def quantize_compressed(x: jax.Array) -> CompressedKV:
    from dsv41_jax import quant

    return CompressedKV(*quant.quant_fp4_kv(x, 16))


def dequantize_compressed(c: CompressedKV) -> jax.Array:
    from dsv41_jax import quant

    return quant.dequant_fp4_kv(c.packed, c.scales, 16)


def quantize_index_keys(x: jax.Array) -> IndexKeys:
    from dsv41_jax import quant

    return IndexKeys(*quant.quant_fp4_mx(x, 32))


def dequantize_index_keys(k: IndexKeys) -> jax.Array:
    from dsv41_jax import quant

    return quant.dequant_fp4_mx(k.packed, k.scales, 32)


def empty_window(batch: int, slots: int, dim: int) -> WindowKV:
    return WindowKV(jnp.zeros((batch, slots, dim), jnp.float8_e4m3fn), jnp.zeros((batch, slots, dim // 32), jnp.uint8))


def empty_compressed(batch: int, entries: int, dim: int) -> CompressedKV:
    return CompressedKV(jnp.zeros((batch, entries, dim // 2), jnp.uint8), jnp.zeros((batch, entries, dim // 16), jnp.float8_e4m3fn))


def empty_index_keys(batch: int, entries: int, dim: int) -> IndexKeys:
    return IndexKeys(jnp.zeros((batch, entries, dim // 2), jnp.uint8), jnp.zeros((batch, entries, dim // 32), jnp.uint8))


def row_bytes(container: tuple) -> int:
    """Bytes of one cached row (last axis) of a layout container, from its dtypes and shapes."""
    return sum(int(a.shape[-1]) * jnp.dtype(a.dtype).itemsize for a in container)
