"""Synthetic checkpoints: random parameters in the release's storage, built on the host.

Why not `Transformer(cfg)`: its eager initialisation compiles hundreds of small XLA programs,
which costs about a minute on a shared CPU; these numpy parameters cost milliseconds and are
exact in the release format by construction (FP8 weights with E8M0 32x32 tiles, packed E2M1
experts, bf16-valued compressor weights, FP8-exact `wo_a`). Magnitudes follow the golden
README's recipe (std 1/sqrt(fan_in), norms 1, mHC scale in [0.5, 1.5]) so the model runs with
finite outputs; they are not meant to be a good language model.
"""
from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx

from dsv41_jax.checkpoint import fp8_tiles
from dsv41_jax.checkpoint.names import disk_tensors, DiskTensor
from dsv41_jax.checkpoint.safetensors_file import DTYPES, TensorEntry
from dsv41_jax.config import ModelConfig
from dsv41_jax.model.info import abstract_model
from dsv41_jax.model.param_names import flat_params

_E4M3, _BF16 = DTYPES["F8_E4M3"], DTYPES["BF16"]
_E2M1_RMS = math.sqrt(sum(v * v for v in (0, .5, 1, 1.5, 2, 3, 4, 6)) / 8)
_FP8_SPREAD = 16.0  # E4M3 codes drawn with this std; the scale brings them back to 1/sqrt(fan_in)


def _scale_byte(target_std: float, code_std: float) -> int:
    return int(127 + round(math.log2(target_std / code_std)))


def _value(path: tuple, shape: tuple, dt: np.dtype, flat: dict, rng: np.random.Generator) -> np.ndarray:
    leaf = path[-1]
    if dt == _E4M3:  # FP8 codes; their scale sibling sets the magnitude
        return np.clip(rng.standard_normal(shape) * _FP8_SPREAD, -448, 448).astype(_E4M3)
    if dt == np.uint8:
        if leaf == "scale" or leaf.endswith("_scale"):
            weight = flat[path[:-1] + ("weight",)] if leaf == "scale" else flat[path[:-1] + (leaf[: -len("_scale")],)]
            if leaf == "embed_scale":  # Engram table rows: values of order 1
                return np.full(shape, _scale_byte(1.0, _FP8_SPREAD), np.uint8)
            packed = np.dtype(weight.dtype) == np.uint8
            fan_in = weight.shape[-1] * (2 if packed else 1)
            b = _scale_byte(1 / math.sqrt(fan_in), _E2M1_RMS if packed else _FP8_SPREAD)
            return np.full(shape, b, np.uint8) + rng.integers(0, 2, shape, dtype=np.uint8)
        return rng.integers(0, 256, shape, dtype=np.uint8)  # packed E2M1: every code, both signs
    if leaf in ("base",):
        return (rng.standard_normal(shape) * 0.5).astype(dt)
    if leaf == "scale":  # mHC
        return rng.uniform(0.5, 1.5, shape).astype(dt)
    if leaf in ("q_weight", "k_weight") or (len(shape) == 1 and leaf == "weight"):
        return (1 + 0.1 * rng.standard_normal(shape)).astype(dt)  # norms, Engram q/k gains
    if leaf in ("attn_sink",):
        return rng.standard_normal(shape).astype(dt)
    if leaf == "bias":
        return (0.1 * rng.standard_normal(shape)).astype(dt)
    std = 1.0 if path == ("embed",) else 1 / math.sqrt(shape[-1])
    w = (rng.standard_normal(shape) * std).astype(np.float32)
    if path[-2:] == ("wo_a", "weight"):
        return fp8_tiles.dequantize(*fp8_tiles.quantize(w)).astype(dt)
    return w.astype(_BF16).astype(dt)  # bf16 values even where the model keeps fp32 (compressor)


def random_params(cfg: ModelConfig, seed: int = 0) -> dict[tuple, np.ndarray]:
    """Host parameters for every path of `Transformer(cfg)`, in the model's storage dtypes."""
    flat = flat_params(abstract_model(cfg))
    rng = np.random.default_rng(seed)
    return {p: _value(p, tuple(v.shape), np.dtype(v.dtype), flat, rng) for p, v in flat.items()}


def model_from_params(cfg: ModelConfig, params: dict[tuple, np.ndarray], device=None) -> nnx.Module:
    """A Transformer holding `params` (numpy, model dtypes) on `device` (default: the first)."""
    graphdef, state = nnx.split(abstract_model(cfg))
    flat = flat_params(state)
    device = device or jax.devices()[0]
    for p, var in flat.items():
        v = params[p]
        if tuple(v.shape) != tuple(var.shape) or np.dtype(v.dtype) != np.dtype(var.dtype):
            raise ValueError(f"{p}: got {v.dtype}{list(v.shape)}, the model wants {np.dtype(var.dtype)}{list(var.shape)}")
        var.set_value(jax.device_put(v, device))
    return nnx.merge(graphdef, nnx.from_flat_state(list(flat.items())))


def synthetic_model(cfg: ModelConfig, seed: int = 0) -> nnx.Module:
    return model_from_params(cfg, random_params(cfg, seed))


def fake_extra_entries(cfg: ModelConfig, seed: int = 0) -> list[TensorEntry]:
    """Small stand-ins for tensors a V4.1 release carries but the text model skips:
    DSpark (`mtp.*`), vision, aligner and the VL gate bias (docs/REFERENCE.md §9 "Files")."""
    rng = np.random.default_rng(seed)
    d, kb = cfg.dim, -(-2 * cfg.dim // 32)

    def normal(shape, dt):
        return lambda: rng.standard_normal(shape).astype(DTYPES[dt])

    return [
        TensorEntry("mtp.0.main_proj.weight", "F8_E4M3", (d, 2 * d), normal((d, 2 * d), "F8_E4M3")),
        TensorEntry("mtp.0.main_proj.scale", "F8_E8M0", (-(-d // 32), kb), lambda: np.full((-(-d // 32), kb), 120, np.uint8)),
        TensorEntry("mtp.0.norm.weight", "BF16", (d,), normal((d,), "BF16")),
        TensorEntry("vision.patch_embed.weight", "BF16", (16, 3 * 14 * 14), normal((16, 3 * 14 * 14), "BF16")),
        TensorEntry("aligner.proj.weight", "BF16", (d, 16), normal((d, 16), "BF16")),
        TensorEntry("layers.0.ffn.gate.bias_vl", "F32", (cfg.n_routed_experts,), normal((cfg.n_routed_experts,), "F32")),
    ]


def random_entries(cfg: ModelConfig, seed: int = 0, *, chunk_bytes: int = 32 << 20) -> list[TensorEntry]:
    """Random bytes of the release dtypes for every tensor of `cfg`, produced per tensor in row
    chunks without building the model: for loader tests at sizes no host copy should be made of.
    The values do not make a working model."""
    tensors = disk_tensors(abstract_model(cfg), wo_a_fp8=cfg.dtype == "fp8")
    return [TensorEntry(t.name, t.dtype, t.shape, _random_chunks(t, seed * 1_000_003 + i, chunk_bytes))
            for i, t in enumerate(tensors)]


def _random_chunks(t: DiskTensor, seed: int, chunk_bytes: int):
    dt = DTYPES[t.dtype]

    def produce():
        rng = np.random.default_rng(seed)
        rows = t.shape[0] if t.shape else 1
        row_elems = math.prod(t.shape[1:]) if t.shape else 1
        per = max(1, chunk_bytes // max(1, row_elems * dt.itemsize))
        for r0 in range(0, rows, per):
            n = min(per, rows - r0) * row_elems
            if t.dtype == "F8_E8M0":
                yield rng.integers(110, 128, n, dtype=np.uint8)
            elif dt.itemsize == 1:
                b = rng.integers(0, 256, n, dtype=np.uint8)
                if t.dtype == "F8_E4M3":
                    b[(b & 0x7F) == 0x7F] = 0x38  # E4M3FN NaN codes -> 1.0
                yield b
            else:
                yield rng.standard_normal(n, dtype=np.float32).astype(dt)

    return produce
