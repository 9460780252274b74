"""Weights by the reference's state-dict names <-> the model's parameter tree.

The reference (and the HF checkpoint, which uses the same bare names) stores one tensor per
expert matrix; we stack experts, so `layers.L.ffn.experts.E.w1.weight` is row E of
`layers[L].ffn.experts.w1`. Quantized tensors keep their storage: E4M3 as float8_e4m3fn,
E8M0 scales and packed E2M1 as uint8 bytes.
"""
from __future__ import annotations

from typing import Callable, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.config import ModelConfig
from dsv41_jax.model.param_names import flat_params, is_vision_name, our_path, reference_name
from dsv41_jax.model.transformer import Transformer


class WeightError(ValueError):
    """A tensor is missing, unexpected, or has the wrong shape/dtype."""


def is_ignored(name: str, vision: bool = False, *, dspark: bool = False) -> bool:
    """Tensors the model does not hold: the VL part unless the model has the tower (`vision`), and
    DSpark (mtp.*) unless the model carries the drafter (`dspark`)."""
    if name.startswith("mtp."):
        return not dspark
    return not vision and is_vision_name(name)


def has_dspark_tensors(names: Iterable[str]) -> bool:
    return any(n.startswith("mtp.") for n in names)


def config_for_names(cfg: ModelConfig, names: Iterable[str]) -> ModelConfig:
    """The config a checkpoint can fill: without the drafter when it ships no mtp.* tensors."""
    return cfg.without_dspark() if cfg.has_dspark and not has_dspark_tensors(names) else cfg


_WIDE_FLOATS = (np.dtype(jnp.bfloat16), np.dtype(np.float16), np.dtype(np.float32))


def _coerce(arr: np.ndarray, want: jax.ShapeDtypeStruct, name: str) -> np.ndarray:
    """Bring a stored tensor to the parameter's dtype without changing its values or bytes."""
    want_dt = np.dtype(want.dtype)
    a = np.asarray(arr)
    if a.dtype == want_dt:
        return a
    if a.dtype.itemsize == 1 and want_dt.itemsize == 1:
        return a.view(want_dt)  # raw bytes: U8/I8 holding E4M3, E8M0 or packed E2M1
    if a.dtype in _WIDE_FLOATS and want_dt in _WIDE_FLOATS and want_dt.itemsize >= a.dtype.itemsize:
        return a.astype(want_dt)  # bf16 on disk, fp32 in the model (compressor, head): exact
    raise WeightError(f"{name}: stored dtype {a.dtype} cannot become the model's {want_dt} without changing values")


def load_reference_state_dict(cfg: ModelConfig, get: Callable[[str], np.ndarray], names: Iterable[str],
                              *, model: nnx.Module | None = None, strict: bool = True):
    """Build a Transformer from tensors named as the reference's state dict.

    get(name) returns a numpy array (only called for names we use). Raises WeightError naming
    every missing, unexpected or mis-shaped tensor. Returns (model, skipped names).
    """
    names = list(names)
    if model is None:
        cfg = config_for_names(cfg, names)
    abstract = model if model is not None else nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    params = flat_params(state)
    dspark = any(p[0] == "mtp" for p in params)
    filled: dict[tuple, np.ndarray] = {}
    expert_parts: dict[tuple, dict[int, np.ndarray]] = {}
    skipped, unexpected, problems = [], [], []
    for name in names:
        if is_ignored(name, cfg.vision_enabled, dspark=dspark):
            skipped.append(name)
            continue
        mapped = our_path(name)
        if mapped is None or mapped[0] not in params:
            unexpected.append(name)
            continue
        path, expert = mapped
        want = params[path]
        if expert is None:
            arr = _coerce(get(name), want, name)
            if tuple(arr.shape) != tuple(want.shape):
                problems.append(f"{name}: shape {tuple(arr.shape)}, expected {tuple(want.shape)}")
                continue
            filled[path] = arr
        else:
            sub = jax.ShapeDtypeStruct(want.shape[1:], want.dtype)
            arr = _coerce(get(name), sub, name)
            if tuple(arr.shape) != tuple(sub.shape):
                problems.append(f"{name}: shape {tuple(arr.shape)}, expected {tuple(sub.shape)}")
                continue
            expert_parts.setdefault(path, {})[expert] = arr
    for path, parts in expert_parts.items():
        n = params[path].shape[0]
        missing = [e for e in range(n) if e not in parts]
        if missing:
            problems.append(f"{'.'.join(map(str, path))}: experts {missing[:8]}{'...' if len(missing) > 8 else ''} missing")
            continue
        filled[path] = np.stack([parts[e] for e in range(n)])
    missing = [".".join(map(str, p)) for p in params if p not in filled]
    if strict and (missing or unexpected or problems):
        msg = []
        if missing:
            msg.append(f"missing tensors for parameters: {missing[:20]}{' ...' if len(missing) > 20 else ''}")
        if unexpected:
            msg.append(f"unexpected tensors: {unexpected[:20]}{' ...' if len(unexpected) > 20 else ''}")
        msg.extend(problems)
        raise WeightError("; ".join(msg))
    for path, arr in filled.items():
        params[path].set_value(jnp.asarray(arr))
    state = nnx.from_flat_state([(p, v) for p, v in params.items()])
    return nnx.merge(graphdef, state), skipped


def to_reference_state_dict(model: nnx.Module) -> dict[str, np.ndarray]:
    """Inverse of the loader: reference names -> numpy arrays in the model's storage dtypes."""
    out = {}
    for path, var in flat_params(model).items():
        value = np.asarray(var.get_value())
        if path[2:4] == ("ffn", "experts"):
            w = path[4]
            base, kind = (w[:2], "scale") if w.endswith("_scale") else (w, "weight")
            for e in range(value.shape[0]):
                out[f"{path[0]}.{path[1]}.ffn.experts.{e}.{base}.{kind}"] = value[e]
        else:
            out[reference_name(path)] = value
    return out
