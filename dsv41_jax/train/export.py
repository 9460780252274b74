"""Trained masters -> a checkpoint folder the serving path loads (and back).

The folder holds `config.json` (HF form, FP8 quantization_config) and `model.safetensors`
with the reference tensor names and storage dtypes (F8_E4M3 weights, E8M0 scale bytes,
packed E2M1 experts), i.e. what `weights.load_reference_state_dict` reads.
"""
from __future__ import annotations

import json
import pathlib
import struct

import jax
import ml_dtypes
import numpy as np

from dsv41_jax.config import ModelConfig
from dsv41_jax.train.params import Format, merge_model, serving_graph
from dsv41_jax.train.weight_quant import export_serving_jit, import_serving_jit

WEIGHTS_FILE = "model.safetensors"
_DTYPES = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn, "U8": np.uint8,
           "I8": np.int8, "F16": np.float16, "I32": np.int32, "I64": np.int64}


def serving_model(cfg: ModelConfig, master: dict, formats: dict[str, Format]):
    """The served (quantized) Transformer for fp32 masters."""
    graphdef, _ = serving_graph(cfg)
    return merge_model(graphdef, export_serving_jit(master, formats))


def export_checkpoint(out_dir, cfg: ModelConfig, master: dict, formats: dict[str, Format]) -> pathlib.Path:
    """Write config.json + model.safetensors for fp32 masters; returns the folder."""
    from safetensors.flax import save_file

    from dsv41_jax.checkpoint.weights import to_reference_state_dict

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = to_reference_state_dict(serving_model(cfg, master, formats))
    save_file({k: jax.numpy.asarray(v) for k, v in tensors.items()}, str(out / WEIGHTS_FILE))
    (out / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=1))
    return out


def read_safetensors(path) -> dict[str, np.ndarray]:
    """All tensors of one safetensors file as memory-mapped numpy arrays (FP8/BF16 through
    ml_dtypes, which the `safetensors` numpy reader lacks); nothing is read until used."""
    path = pathlib.Path(path)
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name} has dtype {info['dtype']}, which this reader does not know")
        a, b = info["data_offsets"]
        out[name] = data[a:b].view(_DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


def load_exported(folder, cfg: ModelConfig | None = None):
    """(config, served model) from a checkpoint folder (one or many safetensors files, e.g. the
    release's shards), through `weights.load_reference_state_dict`."""
    from dsv41_jax.checkpoint.weights import load_reference_state_dict

    folder = pathlib.Path(folder)
    cfg = cfg or ModelConfig.from_file(folder / "config.json")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {folder}")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        tensors.update(read_safetensors(f))
    model, _ = load_reference_state_dict(cfg, lambda k: np.asarray(tensors[k]), list(tensors))
    return cfg, model


def masters_from_checkpoint(folder, formats: dict[str, Format], cfg: ModelConfig | None = None) -> dict:
    """Start from released (or exported) weights: dequantize FP8/FP4 storage into fp32 masters."""
    from dsv41_jax.train.params import flatten_state

    _, model = load_exported(folder, cfg)
    return import_serving_jit(flatten_state(model), formats)
