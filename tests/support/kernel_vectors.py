"""Loader for the golden kernel vectors (golden README, "Kernel vectors"), shared by the numerics tests."""
import functools
import pathlib

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy)
import numpy as np
from safetensors import safe_open


@functools.lru_cache(maxsize=None)
def _load(path: str) -> dict:
    with safe_open(path, "flax") as f:
        return {name: np.asarray(f.get_tensor(name)) for name in f.keys()}


def kernel_vectors(golden_root: pathlib.Path) -> dict:
    """Every tensor of quant_vectors.safetensors as numpy (bf16 via ml_dtypes, U8 as raw bytes)."""
    return _load(str(golden_root / "quant_vectors.safetensors"))


def bits(a) -> np.ndarray:
    """Raw bit pattern of an array, so equality checks are bit-exact (-0 != 0, NaN == NaN)."""
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])
