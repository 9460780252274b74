"""The serving engine's strategies on a mesh (`serving.placement` states what they answer).

`MeshPlacement`: parameters, caches and step programs laid out by a preset. It places the parameters by the
preset's shardings (Engram tables padded to equal row shards first, as `dsv41 plan` and
`sharding.load.load_sharded` count them), gives the engine the graphdef of the distributed model
(`sharding.step.distribute`: expert-parallel MoE with all-to-all dispatch, row-sharded Engram
lookups; the params pytree is the plain model's), and lays every cache out by the same preset.
The engine's jitted steps are then SPMD programs over the whole mesh; each step's returned cache
is constrained to the preset's layout, so decode steps chain without resharding.

`HostTables`: the Engram tables in host memory (`engram_shard.HostEngramTables`, `dsv41 serve
--engram host`): each step's hash ids are known before it runs, so only the rows it reads go to the
device, as a compact table per layer, replicated where the params live; the numbers are those of
the tables in device memory, bit for bit.
"""
from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dsv41_jax.model.kernel_weights import kernel_params
from dsv41_jax.model.transformer import stack_layers
from sharding.engram_shard import compact_params, pad_tables, split_host_tables, unpadded_tables
from sharding.load import table_row_shards
from sharding.mesh import format_mesh_spec, mesh_shape
from sharding.rules import cache_shardings, get_rules, param_shardings
from sharding.step import distribute, kernels_on


class MeshPlacement:
    """Where an engine's arrays live on `mesh` under `preset` (see the module doc)."""

    def __init__(self, mesh: Mesh, preset: str = "inference"):
        get_rules(preset)  # an unknown preset is refused here, naming the choices
        self.mesh, self.preset = mesh, preset
        self.replicated = NamedSharding(mesh, PartitionSpec())

    def load(self, model, plan=None, host_tables: bool = False, taps: bool = False):
        """(graphdef of the distributed model, params placed by the preset, params as stored).
        host_tables: the model's Engram tables are empty placeholders (`HostTables`); each step
        brings its compact tables replicated, so the lookups stay plain gathers. The weights are
        placed as `plan`'s TPU kernels read them (`kernel_params`' word views, made once here, as
        on one device), each split like its stored bytes: a device holds its own experts' views,
        which the FP4 kernel reads inside the expert-parallel MoE. The runs of layers `plan`'s steps
        scan are stacked before placement (`stack_layers`; taps: a speculating engine's), each
        stacked parameter split like one layer's, its layer axis whole."""
        graphdef, state = nnx.split(model)
        state = pad_tables(state, table_row_shards(self.mesh, self.preset))  # no-op when already padded / divisible
        # the fingerprint is the stored bytes', the same on a mesh as on one device, so prefix-cache
        # files move between them
        stored = unpadded_tables(state, model.cfg)
        if plan is not None:
            graphdef, state = stack_layers(graphdef, kernel_params(graphdef, state, plan), plan, taps)
        self.param_shardings = param_shardings(state, self.mesh, self.preset)
        params = jax.device_put(state, self.param_shardings)
        graphdef, _ = nnx.split(distribute(nnx.merge(graphdef, params), self.mesh, self.preset,
                                           sharded_engram=not host_tables))
        return graphdef, params, stored

    def trace(self):
        """The context the engine's steps are traced in: their kernels run per device (`kernels_on`)."""
        return kernels_on(self.mesh, self.preset)

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


class HostTables:
    """The Engram tables in host memory (see the module doc); `host` holds them after `prepare`."""

    host = None

    def prepare(self, model):
        """(the model with empty tables, its full params for the fingerprint: the same as the
        tables in device memory give, so prefix-cache files move between the two)."""
        cfg = model.cfg
        if not cfg.engram_layer_ids:
            raise ValueError("engram_host=True (--engram host) but this model has no Engram layers "
                             "(engram_layer_ids is empty); drop the option")
        stored = unpadded_tables(nnx.state(model), cfg)
        model, self.host = split_host_tables(model, cfg)
        return model, stored

    def inputs(self, params, ids, replicated):
        """The compact tables have B*T*C rows for a step of B rows of T tokens, so each step shape
        still compiles once."""
        compact, remapped = self.host.prefetch(ids, sharding=replicated)
        return compact_params(params, compact), remapped


def bytes_per_device(tree) -> dict:
    """{device: bytes} the arrays of `tree` hold on each device (from their own shards)."""
    per: dict = {}
    for leaf in jax.tree.leaves(tree):
        for s in leaf.addressable_shards:
            per[s.device] = per.get(s.device, 0) + s.data.nbytes
    return per


def engine_strategies(mesh=None, preset: str = "inference", engram_host: bool = False) -> dict:
    """The `placement` and `tables` keywords of `Engine` for a mesh (`sharding.mesh.make_mesh`, laid
    out by `preset`, the vocabulary of `dsv41 plan`; None = one device, as given) and Engram tables
    in host memory (`dsv41 serve --engram host`) or not."""
    out = {}
    if mesh is not None:
        out["placement"] = MeshPlacement(mesh, preset)
    if engram_host:
        out["tables"] = HostTables()
    return out
