"""float32 exp with the rounding of torch's CPU ``torch.exp`` on the oracle's machine: MKL VML.

``torch.exp`` on a float32 CPU tensor is MKL's ``vmsExp`` for every element, whatever the call
length (no SLEEF body and glibc tail, unlike sigmoid/silu/softplus). On the oracle-class AMD EPYC
(AVX-512) host MKL 2024.2 inside torch 2.14.1 runs ``mkl_vml_kernel_sExp_EXHAynn`` (gdb:
``torch.exp`` -> ``vmsExp`` -> that kernel; read with objdump). The golden oracle's
``sparse_attn`` stand-in takes its P, rescale and sink exps with ``torch.exp``
(docs/NUMERICS.md, "dspark_P77_S10").

Main path (|x| <= 0x42aeac4f = 87.3365), SSE float32, no fused multiply-adds, each step rounded:

    t = x * 128/ln2 + 1.5 * 2^23        (two roundings; the low 7 bits of t's mantissa are j)
    n = t - 1.5 * 2^23                  (exact: round(x * 128/ln2))
    r = (x - n * C3) + n * C4           (C3 = 0x3bb18000 > ln2/128, C4 = 0x35de8083 = C3 - ln2/128)
    p = (r * r) * 0.5 + r
    y = (p * A[j] + B[j]) + A[j]        (A[j] = RN(2^(j/128)), B[j] = RN(2^(j/128) - A[j]))
    exp = y * 2^((t >> 7) - bias)       (the exponent field built from t's bits)

The table in the binary (``vsexp_data`` + 0x300, 128 float pairs) equals A and B computed here
from 2^(j/128) to 60 digits, entry for entry. Outside the main range (and inf, NaN) MKL's
``vsexp_cout_rare`` computes more accurately than the main path; it is not transcribed: this
module rounds a float64 exp there, which differs from torch on 2 of 2 x 10^6 inputs in
[-104, -87.34] (subnormal results) and 82 of 2 x 10^6 in [87.34, 88.72]. Measured against torch
2.14.1 on this CPU: the main path equal on 8 x 10^6 inputs ([-20, 0], [-87.3, 87.3], [-1, 1],
[-0.01, 0.01]); torch.exp differs from SLEEF ``expf_u10`` on 9.5 % and from glibc ``expf`` on
1.0 % of inputs in [-20, 0]. An Intel host's MKL may run another kernel (as for ``sqrt``,
`mkl_sqrt`).
"""
from __future__ import annotations

import decimal
import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.numerics.exact_ops import no_fma

MAIN_LIMIT_BITS = 0x42AEAC4F  # |x| above this (as bits) takes MKL's rare path
_C0, _C1, _C2, _C3, _C4 = (np.uint32(v).view(np.float32) for v in
                           (0x4338AA3B, 0x4B400000, 0xCB400000, 0x3BB18000, 0x35DE8083))


@functools.lru_cache(maxsize=1)
def exp2_table() -> tuple[np.ndarray, np.ndarray]:
    """(A, B) float32 [128]: 2^(j/128) split into its float32 rounding and the rounded remainder."""
    ctx = decimal.Context(prec=60)
    exact = [ctx.power(decimal.Decimal(2), decimal.Decimal(j) / 128) for j in range(128)]
    a = np.array([float(v) for v in exact]).astype(np.float32)
    b = np.array([float(ctx.subtract(v, decimal.Decimal(float(h)))) for v, h in zip(exact, a)]).astype(np.float32)
    return a, b


def _lookup(bits: dict, values: np.ndarray, bit: int = 64) -> jax.Array:
    """values[j] for j in [0, len(values)) as a tree of selects on j's bits (`bits[b]`: j & b != 0,
    computed once for both tables rather than at each of the tree's 127 nodes), with scalar
    constants only: a Pallas kernel (the interpreted exact sparse attention) cannot capture a table array."""
    if len(values) == 1:
        return jnp.float32(values[0])
    half = len(values) // 2
    return jnp.where(bits[bit], _lookup(bits, values[half:], bit // 2), _lookup(bits, values[:half], bit // 2))


def expf_mkl(x: jax.Array) -> jax.Array:
    """exp(x) in float32, bit-identical to MKL's EXHA kernel on its main range (torch.exp on the
    oracle's CPU); outside it a float64 exp rounded once (needs jax.enable_x64 for that part to be
    float64; without it the rare range is XLA's float32 exp)."""
    f32 = jnp.float32
    x = jnp.asarray(x, f32)
    t = no_fma(no_fma(x * _C0) + _C1)  # fenced: XLA would otherwise fold (a + C1) + C2 into a
    tb = jax.lax.bitcast_convert_type(t, jnp.uint32)
    j = (tb & 127).astype(jnp.int32)
    n = t + _C2
    r = no_fma(x - no_fma(n * _C3)) + no_fma(n * _C4)
    r = no_fma(r)
    p = no_fma(no_fma(no_fma(r * r) * f32(0.5)) + r)
    a_tab, b_tab = exp2_table()
    bits = {1 << k: (j & (1 << k)) != 0 for k in range(7)}
    a, b = _lookup(bits, a_tab), _lookup(bits, b_tab)
    y = no_fma(no_fma(no_fma(p * a) + b) + a)
    scale = jax.lax.bitcast_convert_type(((tb << 16) + jnp.uint32(0x3F800000)) & jnp.uint32(0x7F800000), f32)
    main = no_fma(y * scale)
    wide = jnp.float64 if jax.dtypes.canonicalize_dtype(jnp.float64) == jnp.float64 else f32
    v = jnp.exp(x.astype(wide))
    # XLA's CPU flushes subnormal float32 results to zero: build those from their bits (the count
    # of 2^-149 units, rounded half to even), as `mkl_sqrt` does for its subnormal inputs
    units = jnp.round(v * wide(2.0 ** 149)).astype(jnp.uint32)
    rare = jnp.where(v < wide(2.0 ** -126), jax.lax.bitcast_convert_type(units, f32), v.astype(f32))
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0x7FFFFFFF)
    return jnp.where(bits > jnp.uint32(MAIN_LIMIT_BITS), rare, main)
