"""Trained masters -> a checkpoint folder the serving path loads (and back).

The folder is what `hf_writer.write_hf_folder` writes and `hf_loader.load_checkpoint` reads:
`config.json` (HF form, FP8 quantization_config), the safetensors shards and their index, with
the reference tensor names and storage dtypes (F8_E4M3 weights, E8M0 scale bytes, packed E2M1
experts), the release's layout.
"""
from __future__ import annotations

import pathlib

from dsv41_jax.checkpoint.atomic import check_destination
from dsv41_jax.checkpoint.hf_loader import load_checkpoint
from dsv41_jax.checkpoint.hf_writer import model_entries, write_hf_folder
from dsv41_jax.config import ModelConfig
from dsv41_jax.train.data import ByteTokenizer
from dsv41_jax.train.params import flatten_state, Format, merge_model, serving_graph
from dsv41_jax.train.weight_quant import export_serving_jit, import_serving_jit


def serving_model(cfg: ModelConfig, master: dict, formats: dict[str, Format]):
    """The served (quantized) Transformer for fp32 masters."""
    graphdef, _ = serving_graph(cfg)
    return merge_model(graphdef, export_serving_jit(master, formats))


def export_checkpoint(out_dir, cfg: ModelConfig, master: dict, formats: dict[str, Format], *,
                      overwrite: bool = False, tokenizer=None) -> pathlib.Path:
    """Write fp32 masters as an HF checkpoint folder (`hf_writer.write_hf_folder`: config.json,
    shards, index; atomically). A non-empty out_dir is refused unless overwrite=True (CLI:
    --force), which replaces it as a whole. `tokenizer`: the one trained with (a loaded
    tokenizer.json, or the byte-level `ByteTokenizer`, written as a tokenizer.json), so the folder
    is self-contained for `dsv41 generate` / `dsv41 serve`. Returns the folder."""
    import tempfile

    check_destination(out_dir, overwrite=overwrite)  # before the masters are quantized
    model = serving_model(cfg, master, formats)
    with tempfile.TemporaryDirectory() as tmp:
        tok_file = None
        if isinstance(tokenizer, ByteTokenizer):
            tok_file = tokenizer.save_json(pathlib.Path(tmp) / "tokenizer.json")
        elif tokenizer is not None:
            tok_file = tokenizer.path
        write_hf_folder(out_dir, cfg, model_entries(model), overwrite=overwrite, tokenizer=tok_file)
    return pathlib.Path(out_dir)


def load_exported(folder, cfg: ModelConfig | None = None, *, check_values: bool = True):
    """(config, served model) from an HF checkpoint folder (an export or the release), through the
    one HF loader (`hf_loader.load_checkpoint`). cfg: load into this config instead of the
    folder's (e.g. with another max_seq_len); its shapes must match the tensors."""
    cfg, model, _ = load_checkpoint(folder, cfg=cfg, progress=False, check_values=check_values)
    return cfg, model


def masters_from_checkpoint(folder, formats: dict[str, Format], cfg: ModelConfig | None = None) -> dict:
    """Start from released (or exported) weights: dequantize FP8/FP4 storage into fp32 masters."""
    _, model = load_exported(folder, cfg)
    return import_serving_jit(flatten_state(model), formats)
