"""Kernel calls on a mesh: each runs per device inside `shard_map`.

The XLA partitioner (GSPMD) cannot split a Mosaic (or Triton) custom call: a kernel inside a
sharded step is refused ("Mosaic kernels cannot be automatically partitioned"). So while a step is
traced for a mesh, its driver names which mesh axes split the batch and which split the attention
heads (`kernel_mesh`, entered by `sharding.step.make_sharded_step`, which reads them from its preset),
and each kernel's public entry point runs the kernel through `per_device`: a `shard_map` whose
inputs are split along the batch (and heads, where the kernel treats heads independently) and
replicated otherwise. Every output element is then computed by the same kernel code from the same
inputs as on one device, so the results are the same bits.

Axes are chosen per call as the sharding rules choose them (`sharding.rules.resolve`): in order,
an axis is used while the product of those taken divides the dimension, so a call splits its
batch exactly as the caches are laid out and GSPMD moves nothing. Outside a `kernel_mesh` (one
device), or inside a `shard_map` already (the expert-parallel MoE runs its expert kernel on each
device's own rows and experts), `per_device` calls the kernel as it is.
"""
from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import jax
from jax.sharding import PartitionSpec as P


class KernelMesh(NamedTuple):
    mesh: object  # jax.sharding.Mesh
    batch: tuple[str, ...]  # mesh axes that split a kernel's batch (rows) dimension, in order
    heads: tuple[str, ...]  # mesh axes that split attention heads


_ACTIVE: list[KernelMesh] = []


@contextlib.contextmanager
def kernel_mesh(mesh, batch: tuple[str, ...] = (), heads: tuple[str, ...] = ()):
    """While tracing a step for `mesh`: kernel calls run per device, batch split over `batch`, heads over `heads`.

    Axes of size 1 (or not in the mesh) are left out; a mesh of one device changes nothing."""
    sizes = dict(zip(mesh.axis_names, mesh.devices.shape))
    keep = lambda axes: tuple(a for a in axes if sizes.get(a, 1) > 1)  # noqa: E731
    _ACTIVE.append(KernelMesh(mesh, keep(batch), keep(heads)))
    try:
        yield
    finally:
        _ACTIVE.pop()


def active() -> KernelMesh | None:
    """The mesh kernel calls are split over now, or None (one device, or already inside a shard_map)."""
    if not _ACTIVE or _ACTIVE[-1].mesh.devices.size == 1:
        return None
    if getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()):
        return None
    return _ACTIVE[-1]


def _axes_for(axes: tuple[str, ...], dim: int, sizes: dict, used: set) -> tuple[str, ...]:
    chosen: list[str] = []
    for a in axes:
        if a in used or dim % (math.prod(sizes[x] for x in chosen) * sizes[a]):
            continue
        chosen.append(a)
    return tuple(chosen)


def per_device(fn, args: tuple, dims: tuple, out_dims, *, batch: int, heads: int | None = None):
    """fn(*args) run per device on the active `kernel_mesh` (or as it is without one).

    dims: per argument, a tuple naming its leading dimensions "batch", "heads" or None (the rest
    whole; the same for every array of a container such as `kv_layout.WindowKV`), or () for an
    argument every device gets whole (weights). None arguments pass through as they are.
    out_dims: the output's, likewise. batch / heads: the sizes of those dimensions, which decide
    the axes used (see the module doc)."""
    km = active()
    if km is None:
        return fn(*args)
    sizes = dict(zip(km.mesh.axis_names, km.mesh.devices.shape))
    b_axes = _axes_for(km.batch, batch, sizes, set())
    h_axes = _axes_for(km.heads, heads, sizes, set(b_axes)) if heads is not None else ()

    def spec(names):
        entry = {"batch": b_axes or None, "heads": h_axes or None}
        return P(*(entry.get(n) if n else None for n in names))

    present = [i for i, a in enumerate(args) if a is not None]

    def body(*given):
        full = list(args)
        for i, a in zip(present, given):
            full[i] = a
        return fn(*full)

    # jax.shard_map (jax >= 0.10, the versions this package supports); replication is not checked: a
    # kernel's outputs are as split as its inputs by construction
    out_spec = jax.tree.map(spec, out_dims, is_leaf=lambda x: isinstance(x, tuple))
    return jax.shard_map(body, mesh=km.mesh, in_specs=tuple(spec(dims[i]) for i in present), out_specs=out_spec,
                     check_vma=False)(*(args[i] for i in present))
