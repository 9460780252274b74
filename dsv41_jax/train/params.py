"""Flat parameter dicts, and the storage format of every served parameter.

Training keeps parameters as flat dicts keyed by dotted paths ("layers.3.attn.wq_a.weight"):
string keys suit orbax, optax labels, LoRA targets and sharding rules alike, and turn back
into a module with `merge_model`. The storage formats are read from the serving model's own
shapes (`nnx.eval_shape` of the checkpoint config), so QAT, import and export follow whatever
`layers/` builds rather than a second copy of the docs/REFERENCE.md §4 table.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.config import ModelConfig
from dsv41_jax.model.transformer import Transformer

FP8_WEIGHT = "fp8_weight"  # E4M3 + E8M0 per 32x32 tile (stacked: per expert)
FP4_WEIGHT = "fp4_weight"  # packed E2M1 + E8M0 per 32 along K (routed experts)
FP8_ROWS = "fp8_rows"  # Engram table: E4M3 rows + E8M0 per 32 (quantized per looked-up row)
BF16 = "bf16"
F32 = "f32"

_SCALE_DTYPES = (jnp.dtype(jnp.uint8), jnp.dtype(jnp.float8_e4m3fn))


@dataclasses.dataclass(frozen=True)
class Format:
    """How one master parameter is stored when served: its format and, if quantized, its scale's key."""

    kind: str
    scale_key: str | None = None


def path_key(path) -> str:
    return ".".join(str(p) for p in path)


def key_path(key: str) -> tuple:
    return tuple(int(p) if p.isdigit() else p for p in key.split("."))


def flatten_state(state) -> dict[str, jax.Array]:
    """nnx.State (or Module) -> {dotted key: array}."""
    if isinstance(state, nnx.Module):
        state = nnx.state(state)
    return {path_key(p): (v.get_value() if isinstance(v, nnx.Variable) else v) for p, v in nnx.to_flat_state(state)}


def merge_model(graphdef, flat: dict[str, jax.Array]):
    """A module from its graphdef and a flat dict (traceable: use inside jit)."""
    return nnx.merge(graphdef, nnx.from_flat_state([(key_path(k), v) for k, v in flat.items()]))


def serving_graph(cfg: ModelConfig):
    """(graphdef, abstract flat params) of the served model, without allocating it."""
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=0))
    graphdef, state = nnx.split(abstract)
    return graphdef, flatten_state(state)


def _is_storage_scale(key: str, dtype) -> bool:
    last = key.rsplit(".", 1)[-1]
    return jnp.dtype(dtype) in _SCALE_DTYPES and (last == "scale" or last.endswith("_scale"))


def serving_formats(cfg: ModelConfig, abstract_flat: dict | None = None) -> dict[str, Format]:
    """Master key -> serving Format, for every parameter except the quantization scales."""
    flat = abstract_flat if abstract_flat is not None else serving_graph(cfg)[1]
    out = {}
    for key, a in flat.items():
        dt = jnp.dtype(a.dtype)
        if _is_storage_scale(key, dt):
            continue
        if dt in (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.uint8)):
            kind = FP8_ROWS if key.endswith("engram.embed") else (FP8_WEIGHT if dt == jnp.dtype(jnp.float8_e4m3fn) else FP4_WEIGHT)
            scale = _scale_key_for(key, flat)
            out[key] = Format(kind, scale)
        elif dt == jnp.dtype(jnp.bfloat16):
            out[key] = Format(BF16)
        elif dt == jnp.dtype(jnp.float32):
            out[key] = Format(F32)
        else:
            raise ValueError(f"serving parameter {key} has dtype {dt}, which no training format covers")
    return out


def _scale_key_for(key: str, flat: dict) -> str:
    candidates = [key[: -len("weight")] + "scale"] if key.endswith(".weight") else []
    candidates.append(key + "_scale")
    for c in candidates:
        if c in flat:
            return c
    raise ValueError(f"quantized serving parameter {key} has no scale (looked for {candidates})")

