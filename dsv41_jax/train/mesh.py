"""Device meshes and shardings for training.

Meshes are named by a spec such as "data=2,tensor=4" (axes data / expert / tensor), built by the
project's `sharding` mesh builder, and laid out by its "training" rule table (FSDP over data and
expert, experts over expert, heads over tensor); for a parameter the rules do not name (e.g. LoRA
adapters) a shape rule splits the largest dimension divisible by the tensor axis. Optimizer moments take their parameter's sharding (matched by key and
shape), so the whole state can be laid out for any mesh, which is how a checkpoint is
restored onto a different mesh. The batch is split over data (and expert); on an expert axis the
step's MoE runs expert-parallel (`step_graph`).
"""
from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from dsv41_jax.train.params import key_path, merge_model
from sharding import rules
from sharding.mesh import make_mesh as project_mesh
from sharding.moe_ep import with_expert_parallel

AXES = ("data", "expert", "tensor")


def _parse(spec: str | None, n: int) -> dict[str, int]:
    if not spec:
        return {"data": n}
    shape = {}
    for part in spec.replace(":", "=").split(","):
        name, _, size = part.strip().partition("=")
        if name not in AXES or not size.strip().lstrip("-").isdigit():
            raise ValueError(f"mesh spec {spec!r}: {part!r} is not 'axis=size' with axis in {AXES}")
        shape[name] = int(size)
    if list(shape.values()).count(-1) == 1:
        fixed = math.prod(v for v in shape.values() if v != -1)
        shape = {k: (n // fixed if v == -1 else v) for k, v in shape.items()}
    if math.prod(shape.values()) > n or min(shape.values()) < 1:
        raise ValueError(f"mesh {shape} needs {math.prod(shape.values())} devices but {n} are available; "
                         f"give positive sizes whose product is at most {n} (or -1 for one axis)")
    return shape


def make_mesh(spec: str | None = None, devices=None) -> Mesh:
    """A mesh over `devices` (default all): spec "data=2,tensor=4", "data=-1", or None (all data).
    A spec naming fewer devices than given uses the first ones (e.g. "data=1": one device)."""
    devices = list(jax.devices() if devices is None else devices)
    shape = _parse(spec, len(devices))
    devices = devices[: math.prod(shape.values())]
    return project_mesh(",".join(f"{k}={v}" for k, v in shape.items()), devices)


def _sizes(mesh: Mesh) -> dict[str, int]:
    return dict(zip(mesh.axis_names, mesh.devices.shape))


def _shape_rule(mesh: Mesh, shape) -> P:
    t = _sizes(mesh).get("tensor", 1)
    spec = [None] * len(shape)
    if t > 1:
        for i in sorted(range(len(shape)), key=lambda i: -shape[i]):
            if shape[i] % t == 0:
                spec[i] = "tensor"
                break
    return P(*spec)


def param_spec(mesh: Mesh, key: str, shape) -> P:
    """PartitionSpec of one parameter (master key) on `mesh`."""
    try:
        logical = rules.param_logical_axes(key_path(key), len(shape))
    except rules.ShardingRuleError:
        return _shape_rule(mesh, shape)
    return rules.resolve(logical, tuple(shape), rules.get_rules("training"), _sizes(mesh)).spec


def stored_layout(mesh: Mesh | None, view: dict) -> dict:
    """The forward's parameters (`weight_quant.qat_view`, keyed like the masters) pinned to their
    stored layout where they are made, so each layer gathers its own inside its checkpoint
    (`layer_layout`). Unpinned, the partitioner gathers a weight where its view is made, outside the
    checkpoints, and keeps it through the backward: every layer's expert stacks, 13.6 GB per chip at
    the released width (8 layers) on v5p:4x4x4. Without a mesh or on one device: `view`."""
    if mesh is None or mesh.devices.size == 1:
        return view
    return {k: jax.lax.with_sharding_constraint(v, NamedSharding(mesh, param_spec(mesh, k, v.shape)))
            for k, v in view.items()}


def layer_layout(mesh: Mesh | None):
    """What the training forward applies to each layer's module inside the layer's checkpoint
    (`model.block.run_layers`' layout): its weights laid out where its products use them
    (`rules.param_specs(compute=True)`: whole over the FSDP axes, split only as served), so each
    layer gathers its weights when it runs, and again when the backward recomputes it, and every
    device multiplies its own rows. None without a mesh or on one device (the forward unchanged)."""
    if mesh is None or mesh.devices.size == 1:
        return None

    def layout(block):
        graphdef, state = nnx.split(block)
        shardings = rules.param_shardings(state, mesh, "training", compute=True)
        return nnx.merge(graphdef, jax.lax.with_sharding_constraint(state, shardings))

    return layout


def state_shardings(mesh: Mesh, state, param_shapes: dict):
    """NamedShardings for a train-state tree: a leaf under a dict key naming a parameter (and of
    that parameter's shape) is laid out like the parameter; everything else is replicated."""
    def one(path, leaf):
        shape = tuple(leaf.shape)
        for entry in reversed(path):
            k = getattr(entry, "key", None)
            if isinstance(k, str) and k in param_shapes and tuple(param_shapes[k]) == shape:
                return NamedSharding(mesh, param_spec(mesh, k, shape))
        return NamedSharding(mesh, P())

    return jax.tree_util.tree_map_with_path(one, state)


# a device's rows per expert exchange in the training step (`sharding.moe_ep.routed_outputs`' chunk_rows)
EXCHANGE_CHUNK_ROWS = 256


def step_graph(graphdef, master_shapes: dict, mesh: Mesh):
    """The graph the step runs on `mesh`: with an expert axis its MoE layers run expert-parallel as
    served (`sharding.moe_ep`: each device runs its own experts on the routed rows sent to it);
    otherwise the partitioner gathers every expert onto every device once a batch routes to all of
    them (52 GB per chip for the released 384 in 8 layers). The parameter paths, and so the state and
    its layout, are `graphdef`'s. The fixed-capacity exchange ("dense"): it has a transpose on every
    backend, and CPU has no ragged all-to-all. Its buffers hold the worst case, 96 rows per row on
    the released model over expert=16, so a device's rows go through it `EXCHANGE_CHUNK_ROWS` at a
    time (a training row count of 1,024 per device would otherwise need 98,304 buffer rows)."""
    if _sizes(mesh).get("expert", 1) == 1:
        return graphdef
    model = with_expert_parallel(merge_model(graphdef, master_shapes), mesh, dispatch="dense",
                                 chunk_rows=EXCHANGE_CHUNK_ROWS)
    return nnx.split(model)[0]


def batch_sharding(mesh: Mesh) -> NamedSharding:
    axes = tuple(a for a in ("data", "expert") if _sizes(mesh).get(a, 1) > 1)
    return NamedSharding(mesh, P(axes if len(axes) > 1 else (axes[0] if axes else None)))


def process_rows(sharding: NamedSharding, batch_size: int) -> tuple[int, int]:
    """The rows [lo, hi) of a (batch_size, ...) array split by `sharding` that live on this process's
    devices (all of them on one process). Across processes each process feeds only these rows
    (`jax.make_array_from_process_local_data`); they must be one contiguous range, which a mesh
    whose data axes list each process's devices together gives (jax.make_mesh / sharding.mesh do)."""
    spans = sorted({(idx[0].start or 0, batch_size if idx[0].stop is None else idx[0].stop)
                    for idx in sharding.addressable_devices_indices_map((batch_size,)).values()})
    lo, hi = spans[0][0], spans[0][1]
    for a, b in spans[1:]:
        if a > hi:
            raise ValueError(f"this process's devices hold rows {spans} of the batch, not one contiguous range; "
                             "order the mesh's devices by process")
        hi = max(hi, b)
    return lo, hi


def global_from_host(mesh: Mesh, key: str, value) -> jax.Array:
    """A parameter's host value (the same on every process) laid out on `mesh` as `param_spec` says;
    each process places only its own shards."""
    value = np.asarray(value)
    sharding = NamedSharding(mesh, param_spec(mesh, key, value.shape))
    return jax.make_array_from_callback(value.shape, sharding, lambda idx: value[idx])


def check_batch(mesh: Mesh, batch_size: int) -> None:
    n = math.prod(_sizes(mesh).get(a, 1) for a in ("data", "expert"))
    if batch_size % n:
        raise ValueError(f"batch size {batch_size} does not split over the mesh's data axes ({n} ways); "
                         f"use a multiple of {n}")


def param_shapes_of(state: dict) -> dict:
    """{key: shape} of every master / adapter / bias in a train state."""
    out = {}
    for group in ("master", "bias", "lora"):
        out.update({k: tuple(v.shape) for k, v in state[group].items()})
    return out
