"""Pallas kernels for DeepSeek-V4.1-Flash's hot paths, each behind an `impl=` switch.

    sparse_sink_attention  FP8 window + FP4 compressed sparse attention with a per-head sink
                           (`sparse_sink_attention_values`: training's, rows in, gradients for them)
    indexer_scores         FP4 indexer scores (+ candidate_pool, topk_indices in XLA)
    grouped_fp4_gemm       ragged MXFP4 x FP8 expert GEMM
    fp8_block_gemm         dense FP8 GEMM with 32x32 E8M0 weight tiles

impl="auto" runs the Pallas kernel on TPU (Mosaic) and GPU (Triton) and the jnp reference on CPU;
"pallas" forces the kernel (interpreted on CPU); "xla" forces the reference. See README.md.
"""
from pallas_kernels.expert_gemm import expert_gemm_moe, fp8_block_gemm, grouped_fp4_gemm
from pallas_kernels.indexer import candidate_pool, indexer_scores, topk_indices
from pallas_kernels.sparse_attention import sparse_sink_attention, sparse_sink_attention_values

__all__ = [
    "sparse_sink_attention", "sparse_sink_attention_values", "indexer_scores", "candidate_pool", "topk_indices",
    "grouped_fp4_gemm", "fp8_block_gemm", "expert_gemm_moe",
]
