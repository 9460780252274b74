"""The serving engine's placement on a mesh: parameters, caches and step programs laid out by a preset.

`Engine(model, mesh=..., preset=...)` holds one `MeshPlacement`. It places the parameters by the
preset's shardings (Engram tables padded to equal row shards first, as `dsv41 plan` and
`sharding.load.load_sharded` count them), gives the engine the graphdef of the distributed model
(`sharding.step.distribute`: expert-parallel MoE with all-to-all dispatch, row-sharded Engram
lookups; the params pytree is the plain model's), and lays every cache out by the same preset.
The engine's jitted steps are then SPMD programs over the whole mesh; each step's returned cache
is constrained to the preset's layout, so decode steps chain without resharding.
"""
from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from sharding.engram_shard import pad_tables, unpadded_tables
from sharding.load import table_row_shards
from sharding.mesh import format_mesh_spec, mesh_shape
from sharding.rules import cache_shardings, get_rules, param_shardings
from sharding.step import distribute


class MeshPlacement:
    """Where an engine's arrays live on `mesh` under `preset` (see the module doc)."""

    def __init__(self, model, mesh: Mesh, preset: str = "inference", *, engram_host: bool = False):
        """engram_host: the model's Engram tables are empty placeholders (`engram_shard.split_host_tables`);
        each step brings its compact tables replicated, so the lookups stay plain gathers."""
        get_rules(preset)  # an unknown preset is refused here, naming the choices
        self.mesh, self.preset = mesh, preset
        graphdef, state = nnx.split(model)
        state = pad_tables(state, table_row_shards(mesh, preset))  # no-op when already padded / divisible
        self.param_shardings = param_shardings(state, mesh, preset)
        self.params = jax.device_put(state, self.param_shardings)
        self.graphdef, _ = nnx.split(distribute(nnx.merge(graphdef, self.params), mesh, preset,
                                                sharded_engram=not engram_host))

    def describe(self) -> str:
        return f"mesh {format_mesh_spec(mesh_shape(self.mesh))} ({self.mesh.devices.size} devices), preset {self.preset}"

    def cache(self, cache: dict) -> dict:
        """Put a cache (a slot table or one prefill row) on the mesh by the preset."""
        return jax.device_put(cache, cache_shardings(cache, self.mesh, self.preset))

    def place(self, tree):
        """A cache by the preset; any other input (prefill buffers) replicated over the mesh."""
        if isinstance(tree, dict) and "length" in tree:
            return self.cache(tree)
        return jax.device_put(tree, NamedSharding(self.mesh, PartitionSpec()))

    def constrain(self, tree):
        """Inside a jitted step: a returned cache keeps the preset's layout; any other tree the
        engine's steps return (the per-slot sampling history the slot insert also writes, the
        logits the sampler and the log-softmax read) is replicated, as `place` puts it (the
        cache rules name cache entries only)."""
        if isinstance(tree, dict) and "length" in tree:
            return jax.lax.with_sharding_constraint(tree, cache_shardings(tree, self.mesh, self.preset))
        return jax.lax.with_sharding_constraint(tree, NamedSharding(self.mesh, PartitionSpec()))

    def unpadded(self, params, cfg):
        """The params with Engram tables cut back to their stored rows (the model's fingerprint is
        the same on a mesh as on one device, so prefix-cache files move between them)."""
        return unpadded_tables(params, cfg)


def bytes_per_device(tree) -> dict:
    """{device: bytes} the arrays of `tree` hold on each device (from their own shards)."""
    per: dict = {}
    for leaf in jax.tree.leaves(tree):
        for s in leaf.addressable_shards:
            per[s.device] = per.get(s.device, 0) + s.data.nbytes
    return per
