"""Expert GEMMs: ragged MXFP4 x FP8 grouped GEMM and the dense FP8 block-scaled GEMM."""
from pallas_kernels.expert_gemm.api import expert_gemm_moe, fp8_block_gemm, grouped_fp4_gemm

__all__ = ["grouped_fp4_gemm", "fp8_block_gemm", "expert_gemm_moe"]
