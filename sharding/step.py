"""A model step on a mesh: the model's own forward, with its MoE and Engram swapped for their
distributed forms and every input and cache laid out by a preset.

Attention heads, the indexer's heads, the vocabulary and FSDP need no code: their shardings are
set on the parameters and caches, and the XLA partitioner (GSPMD) inserts the collectives (e.g.
the all-reduce of the indexer's per-head scores before every shard takes the same top-k).
The MoE (all-to-all dispatch) and the Engram lookup (gather from the owner) are explicit
shard_map code, because the partitioner would otherwise gather whole expert stacks or tables.
The Pallas kernels (impl "pallas") run per device too (`kernels_on`): the partitioner cannot split
a Mosaic call.
"""
from __future__ import annotations

import functools

import jax
from flax import nnx
from jax.sharding import Mesh

from dsv41_jax.model.transformer import forward
from dsv41_jax.runtime import COMPILER_OPTIONS
from dsv41_jax.runtime import Runtime
from pallas_kernels.common.partition import kernel_mesh
from sharding.engram_shard import table_axes, with_sharded_engram
from sharding.moe_ep import with_expert_parallel
from sharding.rules import cache_shardings, get_rules


def distribute(model, mesh: Mesh, preset="inference", *, expert_parallel: bool = True, sharded_engram: bool = True,
               expert_axis: str = "expert", dispatch: str = "auto"):
    """A copy of `model` (same params pytree) with expert-parallel MoE and row-sharded Engram lookups."""
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    if expert_parallel and sizes.get(expert_axis, 1) > 1:
        model = with_expert_parallel(model, mesh, expert_axis=expert_axis, dispatch=dispatch)
    if sharded_engram and table_axes(mesh, preset):
        model = with_sharded_engram(model, mesh, preset)
    return model


def make_sharded_step(model, mesh: Mesh, preset="inference", runtime: Runtime = Runtime(), *, collect: bool = False,
                      **distribute_kwargs):
    """A jitted `(params, tokens, cache, engram_ids=None) -> (logits, cache, aux)` for `mesh`.

    Place the inputs first (`rules.shard_params`, `rules.shard_cache`, `rules.batch_sharding`);
    the returned cache keeps the preset's layout, so decode steps chain without resharding.
    """
    graphdef, _ = nnx.split(distribute(model, mesh, preset, **distribute_kwargs))

    @functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS)
    def step(params, tokens, cache, engram_ids=None):
        m = nnx.merge(graphdef, params)
        with kernels_on(mesh, preset):
            logits, new_cache, aux = forward(m, tokens, cache, runtime=runtime, engram_ids=engram_ids, collect=collect)
        new_cache = jax.lax.with_sharding_constraint(new_cache, cache_shardings(new_cache, mesh, preset))
        return logits, new_cache, aux

    return step


def kernels_on(mesh: Mesh, preset="inference"):
    """The context a step on `mesh` is traced in: its Pallas kernels run per device (`shard_map`), the
    batch split as the preset splits the caches' batch, attention heads as it splits the heads."""
    rules = get_rules(preset)
    return kernel_mesh(mesh, batch=rules.get("batch", ()), heads=rules.get("heads", ()))
