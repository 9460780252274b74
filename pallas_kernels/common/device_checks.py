"""Kernel-vs-reference checks compiled for real hardware (interpret=False), shared by pallas_kernels/common/test_gpu_kernels.py, pallas_kernels/common/test_tpu_kernels.py and
bench/device_suite.py (which runs them interpreted, at small shapes, with --tiny).

Shapes are V4.1-Flash head sizes with small batches and caches, so one run takes seconds of
device time. Each check compares the compiled kernel with the jnp reference on the same device.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.numerics import kv_layout, quant


def _close(out, ref, rtol, what):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    finite = np.isfinite(ref)
    np.testing.assert_array_equal(np.isfinite(out), finite, err_msg=f"{what}: -inf pattern differs")
    scale = np.maximum(np.abs(np.where(finite, ref, 0)).max(axis=-1, keepdims=True), 1e-30)
    err = np.where(finite, np.abs(np.where(finite, out, 0) - np.where(finite, ref, 0)), 0)
    assert np.all(err <= rtol * scale), f"{what}: worst relative error {np.max(err / scale):.3g}"


def check_sparse_attention(platform: str, B=4, S=2, H=64, D=512, W=128, G=4096, K=512, interpret: bool = False) -> None:
    # deferred: each check loads only the kernel it runs
    from pallas_kernels import sparse_sink_attention

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, S, H, D)), jnp.bfloat16)
    window = kv_layout.quantize_window(jnp.asarray(rng.standard_normal((B, W, D)), jnp.float32))
    compressed = kv_layout.quantize_compressed(jnp.asarray(rng.standard_normal((B, G, D)), jnp.float32))
    widx = np.where(rng.random((B, S, W)) < 0.1, -1, rng.integers(0, W, (B, S, W))).astype(np.int32)
    cidx = np.where(rng.random((B, S, K)) < 0.1, -1, rng.integers(0, G, (B, S, K))).astype(np.int32)
    widx[0, 0], cidx[0, 0] = -1, -1
    sink = jnp.asarray(rng.standard_normal(H), jnp.float32)
    args = (q, window, compressed, jnp.asarray(widx), jnp.asarray(cidx), sink, D ** -0.5)
    out = sparse_sink_attention(*args, impl="pallas", interpret=interpret, platform=platform)
    ref = sparse_sink_attention(*args, impl="xla")
    _close(out, ref, 2e-2, "sparse_sink_attention")


def check_indexer(platform: str, B=2, S=3, Hi=32, Di=128, G=3000, interpret: bool = False) -> None:
    # deferred: each check loads only the kernel it runs
    from pallas_kernels import indexer_scores

    rng = np.random.default_rng(1)
    qp, qs = quant.quant_fp4_mx(jnp.asarray(rng.standard_normal((B, S, Hi, Di)), jnp.float32), 32)
    keys = kv_layout.quantize_index_keys(jnp.asarray(rng.standard_normal((B, G, Di)), jnp.float32))
    w = jnp.asarray(rng.standard_normal((B, S, Hi)), jnp.bfloat16).astype(jnp.float32)
    clen = jnp.asarray(rng.integers(0, G + 1, (B, S)), jnp.int32)
    pool = jnp.asarray(rng.random((B, S, G)) < 0.5)
    args = (qp, qs, keys, w, clen, pool)
    _close(indexer_scores(*args, impl="pallas", interpret=interpret, platform=platform),
           indexer_scores(*args, impl="xla"), 1e-5, "indexer_scores")


def check_grouped_gemm(platform: str, E=16, N=2304, K=5120, M=200, interpret: bool = False) -> None:
    # deferred: each check loads only the kernel it runs
    from pallas_kernels import grouped_fp4_gemm

    rng = np.random.default_rng(2)
    w = jnp.asarray(rng.standard_normal((E, N, K)), jnp.float32)
    wp, ws = jax.vmap(quant.quant_fp4_weight)(w)
    sizes = rng.multinomial(M - 7, np.ones(E) / E)
    sizes[3] = 0
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    args = (x, jnp.asarray(sizes, jnp.int32), wp, ws)
    _close(grouped_fp4_gemm(*args, impl="pallas", interpret=interpret, platform=platform),
           grouped_fp4_gemm(*args, impl="xla"), 1e-4, "grouped_fp4_gemm")


def check_fp8_gemm(platform: str, M=64, N=4096, K=1280, interpret: bool = False) -> None:
    # deferred: each check loads only the kernel it runs
    from pallas_kernels import fp8_block_gemm

    rng = np.random.default_rng(3)
    w8, s8 = quant.quant_fp8_weight(jnp.asarray(rng.standard_normal((N, K)), jnp.float32))
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    _close(fp8_block_gemm(x, w8, s8, impl="pallas", interpret=interpret, platform=platform),
           fp8_block_gemm(x, w8, s8, impl="xla"), 1e-4, "fp8_block_gemm")


CHECKS = {
    "sparse_attention": check_sparse_attention,
    "indexer": check_indexer,
    "grouped_gemm": check_grouped_gemm,
    "fp8_gemm": check_fp8_gemm,
}
