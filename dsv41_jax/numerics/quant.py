"""Number formats of DeepSeek-V4.1 (docs/REFERENCE.md §4): E8M0 scales, E4M3 and E2M1 values, FP4 packing.

Every quantiser here reproduces the golden oracle bit for bit (golden README "What the reference run
includes", oracle choice 1); they are model semantics, not an approximation, because FP4/FP8
rounding moves the indexer's top-k.

Storage conventions (the checkpoint's raw-byte layouts, golden README "Weights"):
  * E8M0 scale: uint8 biased exponent byte b, value 2^(b-127); 255 is NaN.
  * E4M3 value: ``jnp.float8_e4m3fn``.
  * E2M1 code: 4 bits, sign = bit 3, low 3 bits index ``{0, .5, 1, 1.5, 2, 3, 4, 6}``.
  * packed FP4: uint8, element 2i in the low nibble, 2i+1 in the high nibble.

E2M1 encoding edge cases (our choice, documented): the sign bit is always kept, so -0 and negative
values that round to zero encode as code 8 (-0), as the oracle does; +-inf and NaN saturate to the
largest magnitude (+-6, sign from the sign bit). ml_dtypes' float4_e2m1fn differs only for NaN
(it gives -0).

All functions operate on the last axis, accept any leading shape and bf16/f32 input, and jit.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.numerics.exact_ops import true_divide

E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)
E4M3_MAX = 448.0
E2M1_MAX = 6.0
# amax floors of the three activation quantisers (golden README, oracle choice 1).
FP8_ACT_AMAX_FLOOR = 1e-4
FP4_MX_AMAX_FLOOR = 6.0 * 2.0**-126
FP4_KV_AMAX_FLOOR = 6.0 * 2.0**-9


# ----------------------------------------------------------------------------- scales


def e8m0_to_float(b: jax.Array) -> jax.Array:
    """Value 2^(b-127) of E8M0 bytes, built from float32 bits so b = 0 (2^-127) stays exact."""
    b = jnp.asarray(b).astype(jnp.uint32)
    normal = jax.lax.bitcast_convert_type(b << 23, jnp.float32)
    value = jnp.where(b == 0, jnp.float32(2.0**-127), normal)
    return jnp.where(b == 255, jnp.float32(jnp.nan), value)


def float_to_e8m0_ceil(x: jax.Array) -> jax.Array:
    """Smallest power of two >= x (x >= 0), as an E8M0 byte.

    Read from the float32 bit pattern (exponent field, +1 when the mantissa is non-zero) exactly
    as the oracle does; an ml_dtypes e8m0 cast rounds to nearest instead. Subnormal x gives 2^-126,
    0 gives 2^-127, inf/NaN give 255 (NaN).
    """
    bits = jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.float32), jnp.uint32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    bumped = exponent + jnp.where((mantissa != 0) & (exponent != 255), 1, 0).astype(jnp.uint32)
    return jnp.minimum(bumped, 255).astype(jnp.uint8)


def _e8m0_reciprocal(b: jax.Array) -> jax.Array:
    """Exact 2^(127-b) from bits, so dividing by an E8M0 scale becomes an exact multiply."""
    b = jnp.asarray(b).astype(jnp.uint32)
    field = jnp.uint32(254) - jnp.minimum(b, 254)
    normal = jax.lax.bitcast_convert_type(field << 23, jnp.float32)
    value = jnp.where(b == 254, jnp.float32(2.0**-127), normal)
    return jnp.where(b == 255, jnp.float32(jnp.nan), value)


def _to_e4m3(x: jax.Array) -> jax.Array:
    """Round float32 to E4M3 (nearest-even), saturating at +-448 like torch's cast."""
    return jnp.clip(x, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)


# ----------------------------------------------------------------------------- E2M1 codes


def e2m1_encode(x: jax.Array) -> jax.Array:
    """Round float32 to the E2M1 grid (nearest, ties to the even code) and return 4-bit codes.

    Magnitudes above 6 saturate; see the module docstring for -0 / NaN. The thresholds are the
    grid midpoints; a tie goes to the neighbour whose index is even.
    """
    x = jnp.asarray(x, jnp.float32)
    a = jnp.abs(x)
    # index = number of midpoints passed; "<=" at a midpoint keeps the lower (even) index,
    # "<" moves to the upper (even) index.
    index = (
        (a > 0.25).astype(jnp.uint8)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    ).astype(jnp.uint8)
    index = jnp.where(jnp.isnan(x), jnp.uint8(7), index)
    sign = (jax.lax.bitcast_convert_type(x, jnp.uint32) >> 31).astype(jnp.uint8)
    return (sign << 3) | index


def e2m1_decode(codes: jax.Array) -> jax.Array:
    """Float32 value of 4-bit E2M1 codes (the upper nibble bits are ignored)."""
    return jnp.asarray(E2M1_VALUES)[jnp.asarray(codes).astype(jnp.int32) & 0xF]


def pack_fp4(codes: jax.Array) -> jax.Array:
    """Pack E2M1 codes [..., K] into bytes [..., K/2], even element in the low nibble."""
    codes = jnp.asarray(codes).astype(jnp.uint8)
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4 needs an even last dimension, got shape {codes.shape}; pad it")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2) & 0xF
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_fp4(packed: jax.Array) -> jax.Array:
    """Inverse of `pack_fp4`: bytes [..., K/2] -> codes [..., K]."""
    packed = jnp.asarray(packed).astype(jnp.uint8)
    pairs = jnp.stack([packed & 0xF, packed >> 4], axis=-1)
    return pairs.reshape(*packed.shape[:-1], packed.shape[-1] * 2)


# ----------------------------------------------------------------------------- helpers


def _blocks(x: jax.Array, block: int, what: str) -> jax.Array:
    """View [..., K] as float32 [..., K/block, block]; K must be a multiple of block."""
    x = jnp.asarray(x)
    if x.ndim == 0 or x.shape[-1] % block:
        raise ValueError(
            f"{what}: last dimension {x.shape[-1:] or '()'} of shape {x.shape} is not a multiple of "
            f"the block size {block}; pad the input to a multiple of {block}"
        )
    return x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _block_amax(xb: jax.Array, floor: float) -> jax.Array:
    return jnp.maximum(jnp.max(jnp.abs(xb), axis=-1), jnp.float32(floor))


def _flat(xb: jax.Array) -> jax.Array:
    return xb.reshape(*xb.shape[:-2], xb.shape[-2] * xb.shape[-1])


# ----------------------------------------------------------------------------- FP8 activations


def quant_fp8_act(x: jax.Array, block: int = 32) -> tuple[jax.Array, jax.Array]:
    """E4M3 with an E8M0 scale per `block` (window KV, activations into FP8/FP4 GEMMs).

    scale = 2^ceil(log2(amax * f32(1/448))), amax floored at 1e-4; q = e4m3_rne(x / scale).
    """
    xb = _blocks(x, block, "quant_fp8_act")
    amax = _block_amax(xb, FP8_ACT_AMAX_FLOOR)
    scale = float_to_e8m0_ceil(amax * jnp.float32(1.0 / E4M3_MAX))
    # x / 2^k == x * 2^-k exactly, and a multiply is safe from XLA's division rewrites
    q = _to_e4m3(xb * _e8m0_reciprocal(scale)[..., None])
    return _flat(q), scale


def dequant_fp8_act(q: jax.Array, scale: jax.Array, block: int = 32) -> jax.Array:
    """Float32 values of `quant_fp8_act` output."""
    qb = _blocks(q, block, "dequant_fp8_act")
    return _flat(qb * e8m0_to_float(scale)[..., None])


# ----------------------------------------------------------------------------- MXFP4 (indexer)


def quant_fp4_mx(x: jax.Array, block: int = 32) -> tuple[jax.Array, jax.Array]:
    """MXFP4: E2M1 with an E8M0 scale per `block` (indexer Q and K).

    scale = 2^ceil(log2(amax * f32(1/6))), amax floored at 6*2^-126; codes = e2m1_rne(x / scale).
    """
    xb = _blocks(x, block, "quant_fp4_mx")
    amax = _block_amax(xb, FP4_MX_AMAX_FLOOR)
    scale = float_to_e8m0_ceil(amax * jnp.float32(1.0 / E2M1_MAX))
    codes = e2m1_encode(xb * _e8m0_reciprocal(scale)[..., None])
    return pack_fp4(_flat(codes)), scale


def dequant_fp4_mx(packed: jax.Array, scale: jax.Array, block: int = 32) -> jax.Array:
    """Float32 values of `quant_fp4_mx` output."""
    vb = _blocks(e2m1_decode(unpack_fp4(packed)), block, "dequant_fp4_mx")
    return _flat(vb * e8m0_to_float(scale)[..., None])


# ----------------------------------------------------------------------------- FP4 compressed KV


def quant_fp4_kv(
    x: jax.Array, block: int = 16, *, scale_by: str = "divide", divide_values: bool = True
) -> tuple[jax.Array, jax.Array]:
    """E2M1 with an E4M3 scale per `block` (compressed KV entries).

    scale = e4m3(amax / 6) (saturating at 448), amax floored at 6*2^-9; codes = e2m1_rne(x / scale).
    docs/REFERENCE.md §6 lists the unconfirmed kernel details; two concern this function, and the defaults are
    the ones the golden vectors match:
      scale_by:       "divide" -> amax / 6;  "reciprocal" -> amax * f32(1/6).  Both give the same
                      E4M3 scale for every finite bf16 amax (checked exhaustively in the tests),
                      so the vectors cannot and need not tell them apart.
      divide_values:  True -> x / scale;     False -> x * f32(1/scale).  Only True reproduces the
                      vectors (the reciprocal rounds twice and flips a code in row 6).
    """
    xb = _blocks(x, block, "quant_fp4_kv")
    amax = _block_amax(xb, FP4_KV_AMAX_FLOOR)
    if scale_by == "divide":
        raw = true_divide(amax, jnp.float32(E2M1_MAX))
    elif scale_by == "reciprocal":
        raw = amax * jnp.float32(1.0 / E2M1_MAX)
    else:
        raise ValueError(f"quant_fp4_kv: scale_by must be 'divide' or 'reciprocal', got {scale_by!r}")
    scale = _to_e4m3(raw)
    s = scale.astype(jnp.float32)[..., None]
    scaled = true_divide(xb, s) if divide_values else xb * (jnp.float32(1.0) / s)
    return pack_fp4(_flat(e2m1_encode(scaled))), scale


def dequant_fp4_kv(packed: jax.Array, scale: jax.Array, block: int = 16) -> jax.Array:
    """Float32 values of `quant_fp4_kv` output."""
    vb = _blocks(e2m1_decode(unpack_fp4(packed)), block, "dequant_fp4_kv")
    return _flat(vb * jnp.asarray(scale).astype(jnp.float32)[..., None])


# ----------------------------------------------------------------------------- fake quant (STE)


def _straight_through(name: str, quant, dequant):
    """Fake-quant in x.dtype with an identity gradient (straight-through estimator for QAT)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
    def fake(x, block):
        return dequant(*quant(x, block), block).astype(x.dtype)

    def fwd(x, block):
        return fake(x, block), None

    def bwd(block, _, g):
        return (g,)

    fake.defvjp(fwd, bwd)

    def wrapper(x: jax.Array, block: int) -> jax.Array:
        return fake(jnp.asarray(x), int(block))

    wrapper.__name__ = name
    return wrapper


_fake_fp8_act = _straight_through("fake_fp8_act", quant_fp8_act, dequant_fp8_act)
_fake_fp4_mx = _straight_through("fake_fp4_mx", quant_fp4_mx, dequant_fp4_mx)
_fake_fp4_kv = _straight_through("fake_fp4_kv", quant_fp4_kv, dequant_fp4_kv)


def fake_fp8_act(x: jax.Array, block: int = 32) -> jax.Array:
    """Q8 of docs/REFERENCE.md §3: E4M3/E8M0 round trip in x.dtype; gradient passes straight through."""
    return _fake_fp8_act(x, block)


def fake_fp4_mx(x: jax.Array, block: int = 32) -> jax.Array:
    """Q4_32 of docs/REFERENCE.md §3 (indexer): MXFP4 round trip in x.dtype; straight-through gradient."""
    return _fake_fp4_mx(x, block)


def fake_fp4_kv(x: jax.Array, block: int = 16) -> jax.Array:
    """Q4_16 of docs/REFERENCE.md §3 (compressed KV): E2M1/E4M3 round trip in x.dtype; straight-through grad."""
    return _fake_fp4_kv(x, block)


# ----------------------------------------------------------------------------- weights


def _check_matrix(w: jax.Array, what: str) -> None:
    if jnp.ndim(w) != 2:
        raise ValueError(f"{what}: expected a [N, K] weight matrix, got shape {jnp.shape(w)}")


def quant_fp8_weight(w: jax.Array, block: int = 32) -> tuple[jax.Array, jax.Array]:
    """E4M3 weight with one E8M0 scale per block x block tile; edge tiles may be partial.

    s = 2^ceil(log2(amax / 448)) per tile, q = e4m3_rne(w / s) (golden README, "How the values
    were made"). Returns (q [N, K], scale uint8 [ceil(N/block), ceil(K/block)]).
    """
    _check_matrix(w, "quant_fp8_weight")
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    wp = jnp.pad(jnp.asarray(w, jnp.float32), ((0, nb * block - n), (0, kb * block - k)))
    tiles = wp.reshape(nb, block, kb, block)
    amax = jnp.max(jnp.abs(tiles), axis=(1, 3))
    scale = float_to_e8m0_ceil(true_divide(amax, jnp.float32(E4M3_MAX)))
    q = _to_e4m3(tiles * _e8m0_reciprocal(scale)[:, None, :, None])
    return q.reshape(nb * block, kb * block)[:n, :k], scale


def dequant_fp8_weight(w: jax.Array, scale: jax.Array, block: int = 32) -> jax.Array:
    """Float32 [N, K] values of an E4M3 weight with E8M0 block x block tile scales."""
    _check_matrix(w, "dequant_fp8_weight")
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    if tuple(scale.shape) != (nb, kb):
        raise ValueError(
            f"dequant_fp8_weight: scale shape {tuple(scale.shape)} does not match weight {w.shape}; "
            f"expected ({nb}, {kb}) for {block}x{block} tiles"
        )
    s = jnp.repeat(jnp.repeat(e8m0_to_float(scale), block, axis=0), block, axis=1)[:n, :k]
    return jnp.asarray(w).astype(jnp.float32) * s


def quant_fp4_weight(w: jax.Array, block: int = 32) -> tuple[jax.Array, jax.Array]:
    """MXFP4 weight (routed experts): s = 2^ceil(log2(amax / 6)) per `block` along K.

    Returns (packed uint8 [N, K/2], scale uint8 [N, K/block]); K must be a multiple of `block`.
    """
    _check_matrix(w, "quant_fp4_weight")
    wb = _blocks(w, block, "quant_fp4_weight")
    amax = jnp.max(jnp.abs(wb), axis=-1)
    scale = float_to_e8m0_ceil(true_divide(amax, jnp.float32(E2M1_MAX)))
    codes = e2m1_encode(wb * _e8m0_reciprocal(scale)[..., None])
    return pack_fp4(_flat(codes)), scale


def dequant_fp4_weight(packed: jax.Array, scale: jax.Array, block: int = 32) -> jax.Array:
    """Float32 [N, K] values of a packed MXFP4 weight."""
    _check_matrix(packed, "dequant_fp4_weight")
    n, half = packed.shape
    if tuple(scale.shape) != (n, 2 * half // block):
        raise ValueError(
            f"dequant_fp4_weight: scale shape {tuple(scale.shape)} does not match packed weight "
            f"{tuple(packed.shape)}; expected ({n}, {2 * half // block})"
        )
    return dequant_fp4_mx(packed, scale, block)
