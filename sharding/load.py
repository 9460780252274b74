"""Loading a checkpoint onto a mesh by shard: every device receives only the slices it holds.

The HF loader (`dsv41_jax.checkpoint.hf_loader.load_checkpoint`) already places each parameter
block by block from the safetensors files (`checkpoint.placement.place`: each device's block is
read by slicing the file, large blocks streamed in row chunks); this module gives it the preset's
layout: `preset_sharding(mesh, preset)` is the `(path, shape, dtype) -> NamedSharding` hook built
from the same logical-axis rules `dsv41 plan` uses, and `load_sharded` pads the Engram tables to
equal row shards as the plan counts them (`sharding.plan.weight_bytes`). Quantized tensors keep
their storage (FP8 / packed E2M1 / E8M0 bytes), so each device's bytes are the plan's
per-device weights + Engram figure; the report's `bytes_per_device` says what each device got.
"""
from __future__ import annotations

import math

from jax.sharding import Mesh, NamedSharding

from dsv41_jax.checkpoint.hf_loader import load_checkpoint
from sharding.engram_shard import is_table, padded_rows
from sharding.mesh import mesh_shape
from sharding.rules import get_rules, param_logical_axes, resolve


def table_row_shards(mesh: Mesh, preset="inference") -> int:
    """How many row shards the preset splits each Engram table into on `mesh`."""
    sizes = mesh_shape(mesh)
    return math.prod(sizes.get(a, 1) for a in get_rules(preset).get("table_rows", ()))


def padded_table_shape(mesh: Mesh, preset="inference"):
    """(path, shape) -> shape with Engram tables (and their scales) padded to equal row shards."""
    n = table_row_shards(mesh, preset)

    def shape_of(path: tuple, shape: tuple) -> tuple:
        if is_table(tuple(path)):
            return (padded_rows(shape[0], n),) + tuple(shape[1:])
        return tuple(shape)

    return shape_of


def preset_sharding(mesh: Mesh, preset="inference"):
    """The load hook: (param path, shape, dtype) -> the preset's NamedSharding of that parameter."""
    rules, sizes = get_rules(preset), mesh_shape(mesh)

    def sharding_of(path: tuple, shape: tuple, dtype) -> NamedSharding:
        r = resolve(param_logical_axes(tuple(path), len(shape)), tuple(shape), rules, sizes)
        return NamedSharding(mesh, r.spec)

    return sharding_of


def load_sharded(folder, mesh: Mesh, preset="inference", **kwargs):
    """(cfg, model, report) of an HF checkpoint laid out on `mesh` by `preset`, read by shard.

    kwargs go to `load_checkpoint` (progress, config_overrides, check_values, ...). The model's
    Engram tables come back padded to equal row shards (zero rows, never addressed).
    """
    return load_checkpoint(folder, shardings=preset_sharding(mesh, preset),
                           padded_shape=padded_table_shape(mesh, preset), **kwargs)
