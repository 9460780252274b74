"""Device meshes named by a spec string such as ``data=1,expert=16,tensor=4``.

A mesh is the only place where devices are named; everything else (rules, presets, the
plan) talks about mesh *axes*. Multi-host slices work the same way: after
`jax.distributed.initialize`, `jax.devices()` lists every process's devices, and the mesh
spans them all. A multi-slice deployment (several ICI domains joined by DCN) names the DCN
part separately (`dcn=`), so that the slow links carry only the axis meant for them.
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# The axes the rule tables know about; a spec may use any subset, in any order.
KNOWN_AXES = ("data", "expert", "tensor")


class MeshSpecError(ValueError):
    """A mesh spec that cannot describe the devices at hand."""


def parse_mesh_spec(spec: str | Mapping[str, int]) -> dict[str, int]:
    """``"data=1,expert=4,tensor=2"`` -> ``{"data": 1, "expert": 4, "tensor": 2}`` (order kept).

    One size may be -1 ("whatever is left"), resolved by `resolve_mesh_shape`.
    """
    if isinstance(spec, Mapping):
        items = list(spec.items())
    else:
        text = str(spec).strip()
        if not text:
            raise MeshSpecError("empty mesh spec; write e.g. 'data=1,expert=4,tensor=2'")
        items = []
        for part in text.split(","):
            name, sep, size = part.strip().partition("=")
            if not sep or not name.strip() or not size.strip():
                raise MeshSpecError(f"mesh spec {text!r}: {part.strip()!r} is not 'axis=size' (e.g. 'expert=4')")
            try:
                items.append((name.strip(), int(size)))
            except ValueError:
                raise MeshSpecError(f"mesh spec {text!r}: size {size.strip()!r} of axis {name.strip()!r} is not an integer") from None
    out: dict[str, int] = {}
    for name, size in items:
        if name in out:
            raise MeshSpecError(f"mesh spec names axis {name!r} twice")
        if not name.isidentifier():
            raise MeshSpecError(f"mesh axis name {name!r} must be an identifier (letters, digits, _)")
        size = int(size)
        if size == 0 or size < -1:
            raise MeshSpecError(f"mesh axis {name!r} has size {size}; sizes are positive (or -1 for 'the rest')")
        out[name] = size
    if sum(1 for s in out.values() if s == -1) > 1:
        raise MeshSpecError(f"mesh spec {format_mesh_spec(out)}: at most one axis may be -1")
    return out


def format_mesh_spec(shape: Mapping[str, int]) -> str:
    return ",".join(f"{k}={v}" for k, v in shape.items())


def resolve_mesh_shape(spec: str | Mapping[str, int], n_devices: int) -> dict[str, int]:
    """Fill a -1 axis and check that the sizes multiply to `n_devices`."""
    shape = parse_mesh_spec(spec)
    fixed = math.prod(s for s in shape.values() if s != -1)
    if -1 in shape.values():
        if n_devices % fixed:
            raise MeshSpecError(f"mesh {format_mesh_spec(shape)}: {n_devices} devices are not divisible by the "
                                f"fixed axes' product {fixed}, so the -1 axis has no integer size")
        shape = {k: (n_devices // fixed if v == -1 else v) for k, v in shape.items()}
    total = math.prod(shape.values())
    if total != n_devices:
        raise MeshSpecError(
            f"mesh {format_mesh_spec(shape)} needs {total} devices but {n_devices} are available "
            f"({_device_summary()}); change the axis sizes so they multiply to {n_devices}, use -1 for one axis, "
            f"or, on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count={total} before JAX starts")
    return shape


def _device_summary() -> str:
    try:
        return f"{jax.process_count()} process(es), platform {jax.default_backend()}"
    except Exception:  # noqa: BLE001 (only decorates an error message)
        return "backend not initialised"


def _auto_axis_types(n: int):
    """GSPMD ("Auto") axes: the partitioner propagates shardings through the model code."""
    axis_type = getattr(jax.sharding, "AxisType", None)
    return None if axis_type is None else (axis_type.Auto,) * n


def make_mesh(spec: str | Mapping[str, int], devices: Sequence | None = None, *,
              dcn: str | Mapping[str, int] | None = None) -> Mesh:
    """A Mesh over `devices` (default: every device of every process, `jax.devices()`).

    dcn: for multi-slice jobs, the per-axis number of slices, e.g. ``"data=2"``; the spec then
    gives the per-slice (ICI) sizes and the mesh axis size is their product.
    """
    devices = list(jax.devices() if devices is None else devices)
    names_types = None
    if dcn is None:
        shape = resolve_mesh_shape(spec, len(devices))
        names = tuple(shape)
        names_types = _auto_axis_types(len(names))
        kwargs = {} if names_types is None else {"axis_types": names_types}
        try:
            # jax.make_mesh orders devices along the physical topology (ICI rings on TPU)
            return jax.make_mesh(tuple(shape.values()), names, devices=devices, **kwargs)
        except (ValueError, NotImplementedError, AssertionError):
            # a device subset the topology helper cannot tile: keep the given order
            grid = np.asarray(devices, dtype=object).reshape(tuple(shape.values()))
    else:
        from jax.experimental import mesh_utils

        dcn_shape = parse_mesh_spec(dcn)
        ici = parse_mesh_spec(spec)
        unknown = set(dcn_shape) - set(ici)
        if unknown:
            raise MeshSpecError(f"dcn axes {sorted(unknown)} are not in the mesh spec {format_mesh_spec(ici)}")
        n_slices = math.prod(dcn_shape.values())
        if len(devices) % n_slices:
            raise MeshSpecError(f"{len(devices)} devices cannot form {n_slices} slices (dcn {format_mesh_spec(dcn_shape)})")
        ici = resolve_mesh_shape(ici, len(devices) // n_slices)
        names = tuple(ici)
        grid = mesh_utils.create_hybrid_device_mesh(
            tuple(ici.values()), tuple(dcn_shape.get(n, 1) for n in names), devices)
        names_types = _auto_axis_types(len(names))
    if names_types is None:
        return Mesh(grid, names)
    return Mesh(grid, names, axis_types=names_types)


def mesh_shape(mesh: Mesh) -> dict[str, int]:
    """{axis name: size} of a mesh, in mesh order."""
    return dict(zip(mesh.axis_names, mesh.devices.shape))


def init_distributed(coordinator_address: str, num_processes: int, process_id: int, **kwargs) -> None:
    """`jax.distributed.initialize` plus the CPU collectives needed for multi-process CPU runs (and,
    there, no persistent compilation cache: see below).

    Call once per process, before any other JAX call; afterwards `jax.devices()` is global.
    On TPU pods the arguments can be omitted by calling `jax.distributed.initialize()` directly
    (the TPU runtime supplies them).
    """
    if os.environ.get("JAX_PLATFORMS", "") == "cpu":
        try:  # cross-process collectives on CPU go through gloo
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        except Exception:  # noqa: BLE001 (option absent in some versions: default already works)
            pass
        # No persistent compilation cache across CPU processes: a two-process run whose programs an
        # earlier run cached (only process 0 writes the cache) failed at its first cross-process
        # collective, each process waiting for a gloo context the other did not create ("Gloo context
        # initialization failed: ... GetKeyValue() timed out with key: cpu:gloo/0,1,2,3,2048,...";
        # both exit 1 after 30 s; jax 0.10.2). Each process compiles instead.
        jax.config.update("jax_enable_compilation_cache", False)
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id, **kwargs)


def global_array(local: np.ndarray, mesh: Mesh, spec: PartitionSpec, global_shape: tuple[int, ...]) -> jax.Array:
    """A global array from each process's slice of the data (multi-host input feeding).

    Every process passes the rows it owns along the sharded leading axis; on one process this
    is plain `device_put`.
    """
    return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), np.asarray(local), global_shape)
