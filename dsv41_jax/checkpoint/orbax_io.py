"""Parameters <-> orbax: the one place that knows how a parameter tree is stored with orbax.

A folder holds `config.json` (the HF form, `cfg.to_hf_dict()`), the parameters under
`params/` (orbax StandardCheckpointer, one array per parameter in its storage dtype, so FP8,
E8M0 and packed E2M1 stay bytes), and optionally `tokenizer.json`. Restores go straight onto
target shardings. The training checkpoint manager reuses `to_pure`, `abstract_target`,
`save_params` and `restore_params` for the parameter part of its steps.
"""
from __future__ import annotations

import json
import pathlib

import jax
import numpy as np
from flax import nnx

from dsv41_jax.checkpoint import atomic, placement
from dsv41_jax.checkpoint.hf_loader import CheckpointError, LoadReport, read_config
from dsv41_jax.checkpoint.hf_writer import tokenizer_file
from dsv41_jax.checkpoint.values import check_model_values
from dsv41_jax.config import ModelConfig
from dsv41_jax.model.info import abstract_model
from dsv41_jax.model.param_names import flat_params

PARAMS_DIR = "params"
CONFIG_FILE = "config.json"


def is_orbax_checkpoint(folder) -> bool:
    folder = pathlib.Path(folder)
    return (folder / PARAMS_DIR).is_dir() and (folder / CONFIG_FILE).is_file()


def to_pure(params) -> dict:
    """Nested plain dict of arrays from a model or an nnx.State (orbax-friendly)."""
    state = nnx.state(params) if isinstance(params, nnx.Module) else params
    return nnx.to_pure_dict(state)


def abstract_target(cfg: ModelConfig, shardings: placement.ShardingSpec = None):
    """(graphdef, abstract state, pure dict of ShapeDtypeStructs carrying their target shardings)."""
    graphdef, state = nnx.split(abstract_model(cfg))
    where = placement.resolve(shardings)
    for path, var in flat_params(state).items():
        shape, dtype = tuple(var.shape), np.dtype(var.dtype)
        var.set_value(jax.ShapeDtypeStruct(shape, dtype, sharding=where(path, shape, dtype)))
    return graphdef, state, nnx.to_pure_dict(state)


def save_params(folder, params, cfg: ModelConfig | None = None, *, tokenizer=None, overwrite: bool = False,
                sources=()) -> pathlib.Path:
    """Write params (model or state) under folder/params, with config.json (and tokenizer.json),
    as a whole (`atomic.atomic_folder`): built beside `folder`, it replaces it only when complete."""
    import orbax.checkpoint as ocp

    folder = pathlib.Path(folder).absolute()
    cfg = cfg if cfg is not None else getattr(params, "cfg", None)
    tok = tokenizer_file(tokenizer)
    with atomic.atomic_folder(folder, overwrite=overwrite, sources=sources) as tmp:
        if cfg is not None:
            atomic.write_text(tmp / CONFIG_FILE, json.dumps(cfg.to_hf_dict(), indent=2))
        if tok is not None:
            atomic.copy_file(tok, tmp / "tokenizer.json")
        with ocp.StandardCheckpointer() as ckptr:
            ckptr.save(tmp / PARAMS_DIR, to_pure(params))
            ckptr.wait_until_finished()
    return folder


def restore_params(folder, target: dict) -> dict:
    """The pure param dict stored in folder/params, placed as `target`'s ShapeDtypeStructs say."""
    import orbax.checkpoint as ocp

    folder = pathlib.Path(folder).absolute()
    with ocp.StandardCheckpointer() as ckptr:
        return ckptr.restore(folder / PARAMS_DIR, target)


def load_orbax_checkpoint(folder, *, shardings: placement.ShardingSpec = None, config_overrides: dict | None = None,
                          check_values: bool = True):
    """(cfg, model, report) from an orbax folder written by `save_params`; check_values refuses
    NaN/inf parameters (`values.py`)."""
    folder = pathlib.Path(folder)
    if not is_orbax_checkpoint(folder):
        raise CheckpointError(f"{folder} is not an orbax checkpoint folder (needs {CONFIG_FILE} and {PARAMS_DIR}/)")
    cfg = read_config(folder, config_overrides)
    graphdef, state, target = abstract_target(cfg, shardings)
    try:
        pure = restore_params(folder, target)
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise CheckpointError(f"{folder / PARAMS_DIR} does not hold the parameters of {folder / CONFIG_FILE}: {e}") from e
    nnx.replace_by_pure_dict(state, pure)
    if check_values:
        check_model_values(state)
    leaves = jax.tree.leaves(pure)
    report = LoadReport(str(folder), "orbax", tensors_read=len(leaves), bytes_read=sum(x.nbytes for x in leaves))
    return cfg, nnx.merge(graphdef, state), report
