"""Which elements torch's vectorised CPU loop hands to its scalar lambda (docs/NUMERICS.md).

`cpu_kernel_vec` walks a contiguous run in steps of two vectors (2 x 16 float32 lanes on the
oracle's AVX512 machine) and finishes the remainder with the scalar lambda, which calls a
different library (glibc instead of SLEEF). For a tensor of N contiguous elements, element e takes
the scalar path iff e >= 32 * floor(N / 32). The oracle ran every call with batch 1, so the run is
one sequence's [T, k] block: decode (T = 1, k = 4) is entirely scalar, a 97-token prefill has its
last token's 4 coefficients scalar.
"""
from __future__ import annotations

import math

import numpy as np

TORCH_AVX512_STEP = 32  # float32 elements per vectorised loop step (2 x __m512)


def scalar_tail_mask(shape: tuple[int, ...], block_dims: int, step: int = TORCH_AVX512_STEP) -> np.ndarray:
    """Bool mask over `shape`: True where torch's scalar path computes the element, treating the
    last `block_dims` dims as one contiguous tensor of the oracle (the leading dims are separate
    calls). A static numpy constant: shapes are static under jit."""
    if block_dims < 1 or block_dims > len(shape):
        raise ValueError(f"block_dims must be in [1, {len(shape)}] for shape {shape}, got {block_dims}")
    block = tuple(shape[len(shape) - block_dims:])
    n = math.prod(block)
    mask = np.arange(n) >= (n // step) * step
    return np.broadcast_to(mask.reshape(block), tuple(shape))
