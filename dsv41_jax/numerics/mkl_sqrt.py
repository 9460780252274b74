"""float32 sqrt with the rounding of torch's CPU ``torch.sqrt`` on the oracle's machine: MKL VML.

torch evaluates float32 ``sqrt`` through MKL's ``vmsSqrt`` (vector body and tail alike). MKL
picks a kernel per CPU; on the oracle-class AMD EPYC (AVX-512) host it runs
``mkl_vml_kernel_sSqrt_EXHAynn`` (MKL 2024.2 inside torch 2.14.1; found with gdb, read with
objdump), a Goldschmidt iteration in SSE float32 without fused multiply-adds:

    r = rsqrtps(x); s = x r; h = r / 2 (as r * 0.5); e = 0.5 - s h; s1 = s e + s; h1 = h e + h;
    d = x - s1 s1; sqrt = d h1 + s1

Its error reaches 0.75 ulp: 17 % of log-uniform inputs differ from IEEE sqrt, all where the
exact root lies 0.25..0.5 ulp from the nearest float. ``rsqrtps`` is vendor-specific; its values
on that CPU are a 8192-entry table (`amd_rsqrtps_table`). Zero, subnormal, negative, infinite
and NaN inputs take MKL's special path, which equals IEEE sqrt (checked against torch).

An Intel AVX-512 host runs ``Z0HAynn`` instead, another algorithm: the oracle's gate traces
(DSpark, 1200 values) match this CPU's MKL, so this is the one emulated. Checked against torch
2.14.1 on 10^7 inputs (tests/numerics/test_mkl_sqrt.py, slow; skips on other CPUs, whose torch would be
a different oracle).
"""
from __future__ import annotations

import base64
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.numerics.exact_ops import exact_sqrt, no_fma


@functools.lru_cache(maxsize=1)
def rsqrtps_table() -> np.ndarray:
    """uint32 [8192]: rsqrtps bits for an input of biased exponent 126 + parity (see the table module)."""
    from dsv41_jax.numerics.amd_rsqrtps_table import TABLE_B64  # deferred: a 240-line table, read on first use

    v = np.frombuffer(base64.b64decode("".join(TABLE_B64)), "<u2").astype(np.uint32)
    return ((np.uint32(0x70) | (v >> np.uint32(12))) << np.uint32(23)) | ((v & np.uint32(0xFFF)) << np.uint32(11))


def rsqrtps(x: jax.Array) -> jax.Array:
    """The CPU's ``rsqrtps`` of positive normal float32 x (other inputs: meaningless)."""
    u = jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.int32)
    e = (u >> 23) & 0xFF
    par = (e - 126) & 1
    key = (par << 12) | ((u & 0x7FFFFF) >> 11)
    shift = (e - 126 - par) // 2  # even numerator: exact
    t = jnp.asarray(rsqrtps_table().view(np.int32))[key] - (shift << 23)
    return jax.lax.bitcast_convert_type(t, jnp.float32)


def sqrt_mkl(x: jax.Array) -> jax.Array:
    """float32 sqrt bit-identical to MKL's EXHA kernel (torch.sqrt on the oracle's CPU)."""
    f32 = jnp.float32
    x = jnp.asarray(x, f32)
    u = jax.lax.bitcast_convert_type(x, jnp.int32)
    e = (u >> 23) & 0xFF
    # MKL's own test (int32(u + 0x7f800000) > int32(0xfefff000)) sends everything but
    # [0x00800000, 0x7f7ff000] to its special path, which equals IEEE sqrt there
    normal = (u >= 0x00800000) & (u <= 0x7F7FF000)
    # XLA flushes float32 subnormals; the residual d = x - s1^2 is ~2^-24 x, subnormal below
    # x = 2^-102. Inputs under 2^-96 run on x 2^64 and scale back by 2^-32: every step scales
    # exactly (rsqrtps(4x) = rsqrtps(x) / 2), and MKL's own residual stays normal down to 2^-102.
    small = normal & (e < 127 - 96)
    xs = jnp.where(normal, jnp.where(small, no_fma(x * f32(2.0 ** 64)), x), f32(1.0))
    r = rsqrtps(xs)
    s = no_fma(xs * r)
    h = no_fma(r * f32(0.5))
    err = no_fma(f32(0.5) - no_fma(s * h))
    s1 = no_fma(no_fma(s * err) + s)
    h1 = no_fma(no_fma(h * err) + h)
    d = no_fma(xs - no_fma(s1 * s1))
    out = no_fma(no_fma(d * h1) + s1)
    out = jnp.where(small, no_fma(out * f32(2.0 ** -32)), out)
    # subnormal x = m 2^-149 (XLA would flush it): sqrt(2m) 2^-75, 2m < 2^24 exact; negative: NaN
    m2 = ((u & 0x7FFFFF) * 2).astype(f32)
    sub = jnp.where(u >= 0, no_fma(exact_sqrt(m2) * f32(2.0 ** -75)), f32(jnp.nan))
    special = jnp.where((e == 0) & ((u & 0x7FFFFF) != 0), sub, exact_sqrt(x))
    return jnp.where(normal, out, special)
