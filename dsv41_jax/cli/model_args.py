"""The flags and the loading shared by the subcommands that run a checkpoint (`dsv41 generate`,
`dsv41 serve`): the mesh and Engram placement flags, the mesh they name, the checkpoint loaded
onto it, and `InputError`, the bad input every subcommand reports with exit code 2.
"""
from __future__ import annotations

from dsv41_jax.cli.argtypes import positive_int


class InputError(ValueError):
    """A bad command-line input; reported as `dsv41 <command>: ...` with exit code 2."""


def mesh_of(args):
    """The mesh `--mesh SPEC` (or its short form `--devices N` = `--mesh data=N`) names; None for one device.

    The devices are the first ones the spec needs, so `--devices 2` works on a host with 8."""
    import math

    import jax

    # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
    from sharding.mesh import MeshSpecError, make_mesh, parse_mesh_spec
    from sharding.rules import ShardingRuleError, get_rules

    if args.mesh is not None and args.devices is not None:
        raise InputError(f"give --mesh or --devices, not both (--devices {args.devices} is short for --mesh data={args.devices})")
    try:
        get_rules(args.preset)
    except ShardingRuleError as e:
        raise InputError(f"--preset: {e}") from None
    spec = args.mesh if args.mesh is not None else (f"data={args.devices}" if (args.devices or 1) > 1 else None)
    if spec is None:
        return None
    flag = "--mesh" if args.mesh is not None else "--devices"
    try:
        sizes = parse_mesh_spec(spec)
        devices = jax.devices()
        n = len(devices) if -1 in sizes.values() else math.prod(sizes.values())
        if n > len(devices):
            raise MeshSpecError(f"asked for {n} devices but {len(devices)} are visible ({jax.default_backend()}); "
                                f"use a mesh of at most {len(devices)} devices")
        return make_mesh(sizes, devices=devices[:n])
    except MeshSpecError as e:
        raise InputError(f"{flag} {spec}: {e}") from None


def load_on(folder, mesh, preset: str, engram: str = "hbm", **kwargs):
    """(cfg, model, report) of a checkpoint on one device (mesh None) or laid out on `mesh` by
    `preset`, each device reading only its slices (`sharding.load`). engram "host": the Engram
    tables go to host memory instead (`engram_shard.host_table_sharding`), unpadded, for an engine
    with `engram_host=True`; the devices never hold them."""
    # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
    from dsv41_jax.checkpoint import checkpoint_format, load
    from dsv41_jax.checkpoint.placement import first_device

    if mesh is not None:
        # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
        from sharding.load import load_sharded, preset_sharding
    where = first_device if mesh is None else preset_sharding(mesh, preset)
    if engram == "host":
        # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
        from sharding.engram_shard import is_table, host_table_sharding

        def where(path, shape, dtype, device=where):  # noqa: F811 (the tables' placement over the other one)
            return (is_table(tuple(path)) and host_table_sharding(path, shape, dtype)) or device(path, shape, dtype)

        return load(folder, shardings=where, **kwargs)
    if mesh is None:
        return load(folder, **kwargs)
    if checkpoint_format(folder) == "hf":
        return load_sharded(folder, mesh, preset, **kwargs)
    return load(folder, shardings=where, **kwargs)  # orbax: tables padded by the engine


def add_mesh_args(s) -> None:
    s.add_argument("--mesh", metavar="SPEC", default=None,
                   help="run on a device mesh laid out by --preset, e.g. expert=4,tensor=2 (the vocabulary of "
                        "`dsv41 plan`); default: the first device")
    s.add_argument("--preset", default="inference",
                   help="sharding preset for --mesh (inference, inference-indexer-replicated, training; default inference)")
    s.add_argument("--devices", type=positive_int, default=None, metavar="N",
                   help="short for --mesh data=N (the first N devices)")
    add_engram_arg(s)


def add_engram_arg(s) -> None:
    s.add_argument("--engram", choices=("hbm", "host"), default="hbm",
                   help="where the Engram tables live: hbm (on the devices, row-sharded over --mesh; the default) or "
                        "host (host memory: each step sends the devices only the rows it reads; as `dsv41 plan "
                        "--engram host` counts it, for a model whose tables do not fit in HBM)")
