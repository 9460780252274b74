"""Checkpoints: the released HF shard format (load, write) and orbax (fast restarts).

`load(folder)` opens either kind; `hf_loader.load_checkpoint` and `orbax_io` are the two
readers, `hf_writer` and `orbax_io.save_params` the writers. Placement (`shardings=`) follows
`placement`: None = first device, a Sharding, or a callable (path, shape, dtype) -> Sharding.
"""
from __future__ import annotations

import pathlib

from dsv41_jax.checkpoint.hf_loader import CheckpointError, INDEX_FILE, load_checkpoint, LoadReport, SINGLE_FILE
from dsv41_jax.checkpoint.hf_writer import save_hf_checkpoint, write_hf_folder
from dsv41_jax.model.info import abstract_model
from dsv41_jax.model.param_names import flat_params

__all__ = ["CheckpointError", "LoadReport", "checkpoint_format", "load", "load_checkpoint", "save_hf_checkpoint",
           "write_hf_folder"]


def checkpoint_format(folder) -> str:
    """"hf" or "orbax" for a checkpoint folder; CheckpointError when it is neither."""
    from dsv41_jax.checkpoint import orbax_io  # deferred: the orbax side loads for an orbax folder only

    folder = pathlib.Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint folder {folder} does not exist")
    if (folder / INDEX_FILE).is_file() or (folder / SINGLE_FILE).is_file():
        return "hf"
    if orbax_io.is_orbax_checkpoint(folder):
        return "orbax"
    raise CheckpointError(f"{folder} is neither an HF checkpoint ({INDEX_FILE} + shards) nor an orbax one "
                          f"({orbax_io.CONFIG_FILE} + {orbax_io.PARAMS_DIR}/)")


def load(folder, *, shardings=None, progress: bool = True, config_overrides: dict | None = None,
         check_values: bool = True, language_model_only: bool = False):
    """(cfg, model, report) from an HF or orbax checkpoint folder; check_values refuses NaN/inf
    weights, naming the tensor (`values.py`; False skips that pass on huge checkpoints).

    language_model_only: build the text-only model (no vision tower, no `bias_vl`), as vLLM's
    --language-model-only; an HF load does not read those tensors at all."""
    if checkpoint_format(folder) == "orbax":
        from dsv41_jax.checkpoint.orbax_io import load_orbax_checkpoint  # deferred: as in checkpoint_format

        cfg, model, report = load_orbax_checkpoint(folder, shardings=shardings, config_overrides=config_overrides,
                                                   check_values=check_values)
        if language_model_only and cfg.vision_enabled:
            cfg, model = cfg.language_model_only(), _without_vision(cfg.language_model_only(), model)
        return cfg, model, report
    return load_checkpoint(folder, shardings=shardings, progress=progress, config_overrides=config_overrides,
                           check_values=check_values, language_model_only=language_model_only)


def _without_vision(text_cfg, model):
    """The text-only model holding `model`'s backbone arrays (shared, not copied)."""
    from flax import nnx

    graphdef, state = nnx.split(abstract_model(text_cfg))
    have = flat_params(model)
    flat = flat_params(state)
    for path, var in flat.items():
        var.set_value(have[path].get_value())
    return nnx.merge(graphdef, nnx.from_flat_state(list(flat.items())))
