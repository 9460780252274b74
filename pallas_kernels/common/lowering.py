"""Lower a kernel for a platform this machine does not have (jax.export), for CI lowering tests.

TPU: Pallas lowers to Mosaic MLIR inside a `tpu_custom_call`; the export succeeds when every
Pallas->Mosaic lowering rule and block-shape check passes (Mosaic's own layout passes run later,
when a TPU compiles it). GPU: the Triton-lowered kernels become a `__gpu$xla.gpu.triton` custom
call holding Triton IR; that target has no export-compatibility guarantee, so the check is
disabled here on purpose (we only want the lowering, never a serialized artifact).
"""
from __future__ import annotations

import jax

_TRITON = "__gpu$xla.gpu.triton"


def lower_for(platform: str, fn, *shapes: jax.ShapeDtypeStruct) -> str:
    """Export `fn` for "tpu" or "gpu" from abstract shapes; return the StableHLO text."""
    if platform == "tpu":
        exported = jax.export.export(jax.jit(fn), platforms=["tpu"])(*shapes)
    elif platform == "gpu":
        exported = jax.export.export(
            jax.jit(fn), platforms=["cuda"], disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(_TRITON)]
        )(*shapes)
    else:
        raise ValueError(f"lower_for: platform must be 'tpu' or 'gpu', got {platform!r}")
    return exported.mlir_module()


def custom_call_targets(text: str) -> set[str]:
    """Names of the custom calls in a StableHLO module text (to assert a kernel was really emitted)."""
    import re

    return set(re.findall(r"stablehlo\.custom_call @([\w$.]+)", text))
