"""Master weights <-> the served storage formats, and the QAT view of the weights.

Master weights are fp32 copies of what the checkpoint stores. Three maps connect them:
  * `import_serving`: dequantize a loaded checkpoint (FP8 tiles, packed MXFP4 experts, FP8
    Engram rows) into masters (exact: every stored value is representable in fp32);
  * `qat_view`: what the forward uses: every FP8/FP4 weight goes through its own quantizer
    round trip with a straight-through gradient, then takes its compute dtype (bf16, or fp32
    where the served model computes in fp32);
  * `export_serving`: quantize masters back into storage, producing exactly the values
    `qat_view` computed with, so the exported model reproduces the trained one.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dsv41_jax.numerics import quant
from dsv41_jax.train.params import BF16, F32, Format, FP4_WEIGHT, FP8_ROWS, FP8_WEIGHT
from dsv41_jax.train.qat_modules import ONE_SHOT_COMPILE


def _per_matrix(fn, w):
    """Apply a [N, K] quantizer to a matrix or to each matrix of a stack [E, N, K]."""
    return jax.vmap(fn)(w) if w.ndim == 3 else fn(w)


def fake_fp8_weight_values(w: jax.Array) -> jax.Array:
    """fp32 values of w after the E4M3 / 32x32 E8M0 storage round trip."""
    return _per_matrix(lambda m: quant.dequant_fp8_weight(*quant.quant_fp8_weight(m)), w)


def fake_fp4_weight_values(w: jax.Array) -> jax.Array:
    """fp32 values of w after the MXFP4 (E2M1, E8M0 per 32 along K) storage round trip."""
    return _per_matrix(lambda m: quant.dequant_fp4_weight(*quant.quant_fp4_weight(m)), w)


def _straight_through(values_fn):
    @jax.custom_vjp
    def fake(w):
        return values_fn(w).astype(w.dtype)

    fake.defvjp(lambda w: (fake(w), None), lambda _, g: (g,))
    return fake


# The weight's storage round trip forward, identity backward (QAT of the weights).
ste_fp8_weight = _straight_through(fake_fp8_weight_values)
ste_fp4_weight = _straight_through(fake_fp4_weight_values)


def qat_view(master: dict, formats: dict[str, Format], *, fake_quant_weights: bool = True) -> dict:
    """The parameters the training forward runs on (differentiable in `master`).

    FP8/FP4 weights: storage round trip (if `fake_quant_weights`) then bf16, as the served
    GEMMs see them. Engram rows stay fp32 here: they are quantized per looked-up row inside
    the forward, so the (huge) table is never quantized whole. Others: their served dtype.
    """
    out = {}
    for key, w in master.items():
        kind = formats[key].kind
        if kind == FP8_WEIGHT:
            out[key] = (ste_fp8_weight(w) if fake_quant_weights else w).astype(jnp.bfloat16)
        elif kind == FP4_WEIGHT:
            out[key] = (ste_fp4_weight(w) if fake_quant_weights else w).astype(jnp.bfloat16)
        elif kind == FP8_ROWS:
            out[key] = w
        elif kind == BF16:
            out[key] = w.astype(jnp.bfloat16)
        elif kind == F32:
            out[key] = w.astype(jnp.float32)
        else:
            raise ValueError(f"{key}: unknown format {kind!r}")
    return out


def export_serving(master: dict, formats: dict[str, Format]) -> dict:
    """Masters -> the served flat state (quantized values plus their scale tensors)."""
    out = {}
    for key, w in master.items():
        fmt = formats[key]
        if fmt.kind == FP8_WEIGHT:
            out[key], out[fmt.scale_key] = _per_matrix(quant.quant_fp8_weight, w)
        elif fmt.kind == FP4_WEIGHT:
            out[key], out[fmt.scale_key] = _per_matrix(quant.quant_fp4_weight, w)
        elif fmt.kind == FP8_ROWS:
            out[key], out[fmt.scale_key] = quant.quant_fp8_act(w, 32)
        elif fmt.kind == BF16:
            out[key] = w.astype(jnp.bfloat16)
        else:
            out[key] = w.astype(jnp.float32)
    return out


def import_serving(serving: dict, formats: dict[str, Format]) -> dict:
    """The served flat state (e.g. a loaded checkpoint) -> fp32 masters (exact)."""
    out = {}
    for key, fmt in formats.items():
        if key not in serving:
            raise KeyError(f"serving state lacks {key}; was it built from the same config?")
        w = serving[key]
        if fmt.kind == FP8_WEIGHT:
            out[key] = _per_matrix_pair(quant.dequant_fp8_weight, w, serving[fmt.scale_key])
        elif fmt.kind == FP4_WEIGHT:
            out[key] = _per_matrix_pair(quant.dequant_fp4_weight, w, serving[fmt.scale_key])
        elif fmt.kind == FP8_ROWS:
            out[key] = quant.dequant_fp8_act(w, serving[fmt.scale_key], 32)
        else:
            out[key] = jnp.asarray(w).astype(jnp.float32)
    return out


def _per_matrix_pair(fn, w, s):
    return jax.vmap(fn)(w, s) if w.ndim == 3 else fn(w, s)


@functools.lru_cache(maxsize=None)
def _jitted(name):
    fns = {"export": export_serving, "import": import_serving}

    return jax.jit(fns[name], static_argnums=1, compiler_options=ONE_SHOT_COMPILE)


def export_serving_jit(master: dict, formats: dict[str, Format]) -> dict:
    """`export_serving` as one compiled program (eager quantizers compile once per shape)."""
    return _jitted("export")(master, _Frozen(formats))


def import_serving_jit(serving: dict, formats: dict[str, Format]) -> dict:
    return _jitted("import")(serving, _Frozen(formats))


class _Frozen(dict):
    """A hashable dict of Formats, so format tables can be static jit arguments."""

    def __hash__(self):
        return hash(tuple(sorted(self.items())))
