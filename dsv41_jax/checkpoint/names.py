"""The HF checkpoint's tensor census, derived from a (possibly abstract) parameter tree.

Each model parameter maps to one or more bare checkpoint names (docs/REFERENCE.md §9 "Files"): routed
experts are stacked in the model and stored one tensor per expert on disk, and `attn.wo_a`,
kept in bf16 by the model, is stored as FP8 + scale in the release (docs/REFERENCE.md §4). This module lists
those names with their on-disk dtype strings and shapes without touching any values, so the
full-size census works on `nnx.eval_shape` output, and the loader and writer agree on names.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dsv41_jax.checkpoint.fp8_tiles import BLOCK
from dsv41_jax.model.param_names import flat_params, our_path, reference_name


@dataclass(frozen=True)
class DiskTensor:
    """One checkpoint tensor: its name, the parameter it fills, and how the release stores it.

    expert: row of the stacked parameter it fills (None for whole parameters).
    dtype: the release's safetensors dtype string for it.
    role: "value" (the parameter's values), or "wo_a_scale" (the E8M0 tiles of an FP8 `wo_a`).
    """

    name: str
    path: tuple
    expert: int | None
    shape: tuple[int, ...]
    dtype: str
    role: str = "value"


def _is_scale(name: str) -> bool:
    return name.endswith(".scale")


def is_wo_a(path: tuple) -> bool:
    return path[-2:] == ("wo_a", "weight")


def is_compressor_weight(path: tuple) -> bool:
    return len(path) >= 5 and path[3] == "compressor" and path[4] in ("wkv", "wgate")


def release_dtype(name: str, path: tuple, dtype) -> str:
    """The safetensors dtype the release uses for a parameter of this dtype (docs/REFERENCE.md §9 table)."""
    dt = np.dtype(dtype)
    if dt.name == "float8_e4m3fn":
        return "F8_E4M3"
    if dt == np.uint8:
        return "F8_E8M0" if _is_scale(name) else "I8"  # packed E2M1, even element in the low nibble
    if dt.name == "bfloat16":
        return "BF16"
    if dt == np.float32:
        return "BF16" if is_compressor_weight(path) else "F32"  # compressor: bf16 on disk, fp32 in use
    raise ValueError(f"{name}: no checkpoint dtype for a parameter of dtype {dt}")


def wo_a_scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    return (-(-shape[0] // BLOCK), -(-shape[1] // BLOCK))


def disk_tensors(model_or_state, *, wo_a_fp8: bool = True) -> list[DiskTensor]:
    """Every checkpoint tensor of a model (abstract or concrete, or its `flat_params` dict), in parameter order.

    wo_a_fp8: list `attn.wo_a` as the release stores it (F8_E4M3 + `.scale`); False lists the
    bf16 form that DeepSeek's convert.py leaves.
    """
    out = []
    flat = model_or_state if isinstance(model_or_state, dict) else flat_params(model_or_state)
    for path, var in flat.items():
        shape, dtype = tuple(int(s) for s in var.shape), var.dtype
        if path[2:4] == ("ffn", "experts"):
            w = path[4]
            base, kind = (w[:-len("_scale")], "scale") if w.endswith("_scale") else (w, "weight")
            for e in range(shape[0]):
                name = f"{path[0]}.{path[1]}.ffn.experts.{e}.{base}.{kind}"
                out.append(DiskTensor(name, path, e, shape[1:], release_dtype(name, path, dtype)))
            continue
        name = reference_name(path)
        if is_wo_a(path) and wo_a_fp8:
            out.append(DiskTensor(name, path, None, shape, "F8_E4M3"))
            out.append(DiskTensor(name[: -len("weight")] + "scale", path, None, wo_a_scale_shape(shape), "F8_E8M0", "wo_a_scale"))
            continue
        out.append(DiskTensor(name, path, None, shape, release_dtype(name, path, dtype)))
    return out


def check_name_mapping(tensors: list[DiskTensor]) -> None:
    """Raise if `param_names.our_path` would map a listed name elsewhere (the two must agree)."""
    for t in tensors:
        if t.role != "value":
            continue
        got = our_path(t.name)
        if got != (t.path, t.expert):
            raise AssertionError(f"{t.name}: param_names.our_path gives {got}, the census says {(t.path, t.expert)}")
