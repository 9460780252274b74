"""`sparse_sink_attention`: the one entry point the model calls, with the impl switch and the VJP.

The forward runs the Pallas kernel (TPU or GPU) or the jnp reference. The kernels have no
backward of their own: `jax.custom_vjp` differentiates the jnp reference (reference.py) instead,
recomputing its forward in the backward pass. Gradients flow to q and the sink; the quantized
caches and the index lists get zero cotangents (they are integer/FP8 storage, not trainable
values; training that needs dK/dV uses impl="xla" on the dequantized KV).

mode="exact" (the golden oracle's numerics, float64 dots) runs the TPU kernel's exact variant,
which exists only in interpret mode; its VJP is the exact-mode reference's.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from dsv41_jax.numerics import kv_layout, quant
from dsv41_jax.numerics.sparse_attention import sparse_attention
from pallas_kernels.common.backend import resolve
from pallas_kernels.common.partition import per_device
from pallas_kernels.sparse_attention.reference import sparse_sink_attention_reference


def _kernel_for(kind: str):
    # deferred: each backend's kernel module loads for that backend only (the GPU one imports Triton's lowering)
    if kind == "tpu":
        # deferred: each backend's kernel module loads for that backend only
        from pallas_kernels.sparse_attention.tpu import sparse_sink_attention_tpu

        return sparse_sink_attention_tpu
    # deferred: each backend's kernel module loads for that backend only
    from pallas_kernels.sparse_attention.gpu import sparse_sink_attention_gpu

    return sparse_sink_attention_gpu


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _kernel_with_reference_vjp(kind, interpret, scale, mode, q, window, compressed, window_idx, compressed_idx, sink,
                               layer=None):
    extra = {"exact": True} if mode == "exact" else {}
    if layer is not None:
        extra["window_layer"] = layer
    return _kernel_for(kind)(q, window, compressed, window_idx, compressed_idx, sink, scale, interpret=interpret, **extra)


def _fwd(kind, interpret, scale, mode, q, window, compressed, window_idx, compressed_idx, sink, layer=None):
    out = _kernel_with_reference_vjp(kind, interpret, scale, mode, q, window, compressed, window_idx, compressed_idx,
                                     sink, layer)
    return out, (q, window, compressed, window_idx, compressed_idx, sink, layer)


def _bwd(kind, interpret, scale, mode, residuals, g):
    q, window, compressed, window_idx, compressed_idx, sink, layer = residuals
    if layer is not None:
        window = kv_layout.ring_rows(kv_layout.LayerRing(window, layer))

    def reference(q_, sink_):
        return sparse_sink_attention_reference(q_, window, compressed, window_idx, compressed_idx, sink_, scale,
                                               mode=mode)

    _, vjp = jax.vjp(reference, q, sink)
    dq, dsink = vjp(g)
    return dq, None, None, None, None, dsink, None


_kernel_with_reference_vjp.defvjp(_fwd, _bwd)


def _validate(q, window, compressed, window_idx, compressed_idx, sink) -> None:
    if q.ndim != 4:
        raise ValueError(f"sparse_sink_attention: q must be [B, S, H, D], got shape {q.shape}")
    B, S, H, D = q.shape
    if D % 32:
        raise ValueError(f"sparse_sink_attention: head dim {D} must be a multiple of 32 (one scale per 32)")
    if sink.shape != (H,):
        raise ValueError(f"sparse_sink_attention: sink must be [H] = [{H}], got shape {sink.shape}")
    if window is not None:
        if isinstance(window, kv_layout.LayerRing):
            window = jax.eval_shape(kv_layout.ring_rows, window)
        if not isinstance(window, (kv_layout.WindowKV, kv_layout.WindowWords)):
            raise TypeError(f"sparse_sink_attention: window must be a kv_layout.WindowKV or WindowWords (or a "
                            f"LayerRing of them), got {type(window).__name__}")
        if window[0].ndim != 3 or window[0].shape[0] != B or kv_layout.dim_of(window) != D:
            raise ValueError(f"sparse_sink_attention: window rows must be [B={B}, Nw, D={D}], got "
                             f"{window[0].shape[:2] + (kv_layout.dim_of(window),)}")
        if window_idx is None or window_idx.shape[:2] != (B, S):
            raise ValueError(f"sparse_sink_attention: window_idx must be [B={B}, S={S}, Kw], got "
                             f"{None if window_idx is None else window_idx.shape}")
    if compressed is not None:
        if not isinstance(compressed, (kv_layout.CompressedKV, kv_layout.CompressedWords)):
            raise TypeError(f"sparse_sink_attention: compressed must be a kv_layout.CompressedKV or CompressedWords, "
                            f"got {type(compressed).__name__}")
        if compressed.packed.ndim != 3 or compressed.packed.shape[0] != B or kv_layout.dim_of(compressed) != D:
            raise ValueError(f"sparse_sink_attention: compressed rows must be [B={B}, G, D={D}], got "
                             f"{compressed.packed.shape[:2] + (kv_layout.dim_of(compressed),)}")
        if compressed_idx is None or compressed_idx.shape[:2] != (B, S):
            raise ValueError(f"sparse_sink_attention: compressed_idx must be [B={B}, S={S}, Kc], got "
                             f"{None if compressed_idx is None else compressed_idx.shape}")
    if window is None and compressed is None:
        raise ValueError("sparse_sink_attention: give at least one of window / compressed")


def sparse_sink_attention(
    q: jax.Array,
    window: kv_layout.WindowKV | None,
    compressed: kv_layout.CompressedKV | None,
    window_idx: jax.Array | None,
    compressed_idx: jax.Array | None,
    sink: jax.Array,
    scale: float,
    *,
    impl: str = "auto",
    interpret: bool | None = None,
    platform: str | None = None,
    mode: str = "fast",
) -> jax.Array:
    """Attention of each query row over its window slots, then its compressed slots (K = V).

    q [B, S, H, D] bf16; window: WindowKV [B, Nw, D] (E4M3 + E8M0 per 32); compressed:
    CompressedKV [B, G, D] (E2M1 + E4M3 per 16) or None; either also as the TPU kernel's word view
    (`kv_layout.WindowWords` / `CompressedWords`, which it reads as they are, with no relayout); the
    window also as one layer of rings held stacked (`kv_layout.LayerRing`: the TPU kernel reads that
    layer where it lies, the others read a copy of it); window_idx [B, S, Kw] / compressed_idx
    [B, S, Kc] int32 row indices, -1 = empty slot (indices must be < Nw / G; the kernels clamp
    larger ones); sink [H] f32 logits; scale the softmax scale. Returns [B, S, H, D] in q.dtype:
    o_h = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink_h}), s_j = scale * q_h . k_j, and 0 for a
    row without a valid slot (docs/REFERENCE.md §3 "Attention"). Duplicated slots count twice (as in the
    reference). S = 1 is decode; any S is prefill / training.

    impl: "xla" the jnp reference, "pallas" a kernel, "auto" the kernel on TPU/GPU and the
    reference on CPU. interpret: run the kernel in the Pallas interpreter (default: on CPU).
    platform: "tpu" / "gpu" kernel to use (default: the backend's; the TPU kernel on CPU).
    mode: "fast" (f32 accumulation) or "exact" (the golden oracle's numerics: float64 dots, 64-slot
    online-softmax blocks, MKL exp (`mkl_exp`); needs `jax.enable_x64(True)`). With a kernel, "exact" needs
    the TPU kernel in interpret mode (float64 cannot be compiled for TPU or Triton).
    The backward pass is the jnp reference's VJP (see the module docstring).
    """
    if mode not in ("fast", "exact"):
        raise ValueError(f"sparse_sink_attention: mode must be 'fast' or 'exact', got {mode!r}")
    _validate(q, window, compressed, window_idx, compressed_idx, sink)
    choice = resolve(impl, interpret, platform)
    layer = None
    if isinstance(window, kv_layout.LayerRing):
        if choice.kind == "tpu":  # the kernel reads the layer where it lies
            window, layer = window.rings, window.layer.reshape(1).astype(jnp.int32)
        else:
            window = kv_layout.ring_rows(window)
    if choice.kind == "xla":
        return sparse_sink_attention_reference(q, window, compressed, window_idx, compressed_idx, sink, scale, mode=mode)
    if mode == "exact" and (choice.kind != "tpu" or not choice.interpret):
        raise ValueError("sparse_sink_attention(mode='exact') with a kernel needs platform='tpu' (the default on "
                         f"CPU) and interpret=True, got platform={choice.kind!r}, interpret={choice.interpret}")
    kernel = functools.partial(_kernel_with_reference_vjp, choice.kind, choice.interpret, float(scale), mode)
    return _per_device(kernel, q, window, compressed, window_idx, compressed_idx, sink, layer=layer)


def _per_device(kernel, q, window, compressed, window_idx, compressed_idx, sink, heads=True, layer=None):
    """`kernel` on a mesh (`partition.per_device`): rows split over the batch axes, the query heads
    (and their sinks) over the head axes; each head attends on its own, so the split changes no bit.
    heads False: the heads stay whole (the values-in kernel's gradients for the shared rows). layer:
    the window holds stacked rings (a leading layer axis, whole on every device) and this is the one read."""
    h = "heads" if heads else None
    b = ("batch",)
    args, dims = (q, window, compressed, window_idx, compressed_idx, sink), (("batch", None, h), b, b, b, b, (h,))
    if layer is not None:
        args, dims = args + (layer,), dims[:1] + ((None, "batch"),) + dims[2:] + ((),)
    return per_device(kernel, args, dims, ("batch", None, h), batch=q.shape[0], heads=q.shape[2] if heads else None)


# ------------------------------------------------------------------------- training (values in)
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _values_in(kind, interpret, scale, q, window_raw, compressed_raw, window_idx, compressed_idx, sink):
    window = kv_layout.quantize_window(window_raw)
    compressed = None if compressed_raw is None else kv_layout.quantize_compressed(compressed_raw)
    return _kernel_for(kind)(q, window, compressed, window_idx, compressed_idx, sink, scale, interpret=interpret)


def _values_in_fwd(kind, interpret, scale, q, window_raw, compressed_raw, window_idx, compressed_idx, sink):
    out = _values_in(kind, interpret, scale, q, window_raw, compressed_raw, window_idx, compressed_idx, sink)
    return out, (q, window_raw, compressed_raw, window_idx, compressed_idx, sink)


def _values_in_bwd(kind, interpret, scale, residuals, g):
    q, window_raw, compressed_raw, window_idx, compressed_idx, sink = residuals

    def reference(q_, w_, c_, sink_):
        return _values_in_reference(q_, w_, c_, window_idx, compressed_idx, sink_, scale)

    _, vjp = jax.vjp(reference, q, window_raw, compressed_raw, sink)
    dq, dw, dc, dsink = vjp(g)
    return dq, dw, dc, None, None, dsink


_values_in.defvjp(_values_in_fwd, _values_in_bwd)


def sparse_sink_attention_values(
    q: jax.Array,
    window_raw: jax.Array,
    compressed_raw: jax.Array | None,
    window_idx: jax.Array,
    compressed_idx: jax.Array | None,
    sink: jax.Array,
    scale: float,
    *,
    impl: str = "auto",
    interpret: bool | None = None,
    platform: str | None = None,
) -> jax.Array:
    """`sparse_sink_attention` for training (fast numerics), with gradients for the values too.

    window_raw [B, Nw, D] / compressed_raw [B, G, D]: the rows before quantization (the training
    store's fake quantization takes the same rows: Q8 per 32 for the window, Q4_16 for the
    compressed KV, docs/REFERENCE.md §3). The forward quantizes them into the kernel's containers,
    whose values are the fake-quantized rows bit for bit (quantizing the raw rows is the fake
    quantization's own first half), and runs the kernel; the backward is the VJP of the XLA math
    over the fake-quantized rows (`numerics.sparse_attention`, window slots first, the
    quantizers straight-through): dq, d window_raw, d compressed_raw and d sink, as training's XLA
    path has them. impl "xla" runs that XLA math forward as well.
    """
    if window_raw.ndim != 3 or window_raw.shape[0] != q.shape[0] or window_raw.shape[2] != q.shape[3]:
        raise ValueError(f"sparse_sink_attention_values: window_raw must be [B={q.shape[0]}, Nw, D={q.shape[3]}], "
                         f"got {window_raw.shape}")
    if (compressed_raw is None) != (compressed_idx is None):
        raise ValueError("sparse_sink_attention_values: give compressed_raw and compressed_idx together")
    choice = resolve(impl, interpret, platform)
    if choice.kind == "xla":
        return _values_in_reference(q, window_raw, compressed_raw, window_idx, compressed_idx, sink, scale)
    kernel = functools.partial(_values_in, choice.kind, choice.interpret, float(scale))
    return _per_device(kernel, q, window_raw, compressed_raw, window_idx, compressed_idx, sink, heads=False)


def _values_in_reference(q, window_raw, compressed_raw, window_idx, compressed_idx, sink, scale):
    """Training's XLA math: attention over the fake-quantized rows (straight-through), window slots first."""
    rows, idx = quant.fake_fp8_act(window_raw, 32), window_idx
    if compressed_raw is not None:
        n = rows.shape[1]
        rows = jnp.concatenate([rows, quant.fake_fp4_kv(compressed_raw, 16)], 1)
        idx = jnp.concatenate([idx, jnp.where(compressed_idx >= 0, compressed_idx + n, -1)], -1)
    return sparse_attention(q, rows.astype(q.dtype), sink, idx, scale, mode="fast")
