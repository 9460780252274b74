"""The weights a plan's TPU kernels read, made once at load: `kernel_params`.

Kept apart from the layer body (`dsv41_jax.model.block`), which only runs on whatever params it is
given: this is a load-time relayout of the stored FP8/FP4 bytes into 32-bit word views.
"""
from __future__ import annotations

import jax
from flax import nnx

from dsv41_jax.layers.basic import QLinear
from dsv41_jax.layers.moe import Experts
from dsv41_jax.model.block import Plan


def kernel_params(graphdef, params, plan: Plan):
    """params with the layers' stored weights in the word views `plan`'s TPU kernels read (pure:
    params in, params out; the one place they are made, once at load, `Engine` for its plan).

    The TPU kernels decode 32-bit words; built per call from the stored bytes, that relayout reads
    and writes every weight on every step. Here, for a plan in fast numerics on impl "pallas" whose
    kernels are the TPU ones (compiled, or interpreted on CPU): the routed experts' MXFP4 stacks and
    scales become `layout.fp4_weight_words`, and, when the plan runs the FP8 block GEMM, the dense
    FP8 linears' weights `layout.fp8_weight_view` (scales stay bytes: the kernel reads them as they
    are). The views hold the same bytes (FP8: plus K's zero padding to 32), replacing the stored
    arrays, so the footprint does not grow. Any other plan (exact mode, impl "xla", the GPU kernels,
    which read the bytes) gets params back unchanged; the prepared params serve only `plan`
    (`gemm.linear` and the kernels' wrappers reject a word view elsewhere). The DSpark stages
    (`model.mtp`) keep their bytes: they run the XLA math. Works on abstract params too
    (`jax.eval_shape`)."""
    if plan.runtime.mode != "fast" or plan.runtime.impl != "pallas":
        return params
    # deferred: the kernels' modules load only for a plan that runs them
    from pallas_kernels.common.backend import resolve
    from pallas_kernels.expert_gemm import layout

    if resolve("pallas", plan.runtime.interpret).kind != "tpu":
        return params
    model = nnx.merge(graphdef, params, copy=True)  # fresh Variables (the same arrays): params stay as they are
    for _, node in nnx.iter_graph(model.layers):
        if isinstance(node, Experts) and node.kind == "fp4" and not layout.is_words(node.w1):
            for w, s in ((node.w1, node.w1_scale), (node.w2, node.w2_scale), (node.w3, node.w3_scale)):
                words, swords = _jit(layout.fp4_weight_words)(w.get_value(), s.get_value())
                w.set_value(words)
                s.set_value(swords)
        elif (isinstance(node, QLinear) and node.kind == "fp8" and plan.runtime.fp8_kernel
              and not layout.is_words(node.weight)):
            node.weight.set_value(_jit(layout.fp8_weight_view)(node.weight.get_value()))
    return nnx.state(model)


def _jit(fn):
    """One weight's conversion as one fused program: eagerly, `astype(uint32)` alone would hold a
    4x copy of the weight; weight by weight, the peak is the params plus one weight's view."""
    return jax.jit(fn)
