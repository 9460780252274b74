"""The load-time value check: NaN and inf in checkpoint tensors, named by tensor.

Why: the attention treats a row whose running max is not finite as fully masked and outputs
zeros for it, so NaN weights (an all-NaN FP8 tensor, E8M0 scale bytes of 0xFF) would otherwise
give finite logits and plausible text. Each tensor is checked in its disk dtype as it is read,
on the host block the loader already holds, so the check costs one pass over bytes that are in
memory anyway; `check_values=False` (CLI `--no-value-check`) skips it for huge checkpoints.
Nothing here runs on the model's hot path.
"""
from __future__ import annotations

import numpy as np

from dsv41_jax.checkpoint.names import disk_tensors
from dsv41_jax.checkpoint.weights import WeightError
from dsv41_jax.model.param_names import flat_params

SKIP_HINT = "pass --no-value-check (check_values=False) to load it anyway"


def _describe(name: str, disk_dtype: str, arr: np.ndarray) -> str | None:
    """What is wrong with the values of one tensor (block), or None when they are all finite."""
    n = arr.size
    if n == 0:
        return None
    if disk_dtype == "F8_E4M3":  # e4m3fn: no inf; NaN is S.1111.111
        bad = int(np.count_nonzero((arr.view(np.uint8) & 0x7F) == 0x7F))
        return f"{bad} of {n} FP8 E4M3 values are NaN" + (" (all of them)" if bad == n else "") if bad else None
    if disk_dtype == "F8_E8M0" or (disk_dtype == "U8" and name.endswith(".scale")):
        bad = int(np.count_nonzero(arr.view(np.uint8) == 0xFF))
        return f"{bad} of {n} E8M0 scale bytes are 0xFF, which encodes NaN" if bad else None
    if disk_dtype in ("BF16", "F16", "F32", "F64", "F8_E5M2"):
        a = arr.astype(np.float32) if arr.dtype.itemsize < 2 or disk_dtype == "BF16" else arr
        nan, inf = int(np.count_nonzero(np.isnan(a))), int(np.count_nonzero(np.isinf(a)))
        if not (nan or inf):
            return None
        parts = [f"{k} {what}" for k, what in ((nan, "NaN"), (inf, "inf")) if k]
        return f"{' and '.join(parts)} among {n} {disk_dtype} values"
    return None  # integers, packed E2M1 (every code is finite), bool


def check_values(name: str, disk_dtype: str, arr: np.ndarray) -> None:
    """Raise WeightError naming `name` and what was found when `arr` holds NaN or inf."""
    problem = _describe(name, disk_dtype, np.asarray(arr))
    if problem:
        raise WeightError(f"{name}: {problem}; the checkpoint holds non-finite weights (a damaged file or a "
                          f"diverged training run), which would give silently wrong output; {SKIP_HINT}")


def check_model_values(model_or_state) -> None:
    """`check_values` for every parameter of a loaded model (the orbax path, which restores whole
    arrays), each named by its checkpoint tensor name; one host copy of a parameter at a time."""
    import jax

    flat = flat_params(model_or_state)
    host: dict[tuple, np.ndarray] = {}
    for t in disk_tensors(flat, wo_a_fp8=False):
        if t.path not in host:
            host.clear()
            host[t.path] = np.asarray(jax.device_get(flat[t.path].get_value()))
        v = host[t.path]
        check_values(t.name, t.dtype, v[t.expert] if t.expert is not None else v)
