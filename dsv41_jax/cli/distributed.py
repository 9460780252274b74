"""Joining JAX's distributed runtime from command-line flags (`dsv41 train`, one call per CLI).

Every host of a pod slice or cluster runs the same command; they differ only in the process id:

    dsv41 train ... --coordinator HOST0:PORT --num-processes N --process-id I

With none of the three flags, a cluster environment that JAX detects by itself (Cloud TPU pod
slices, SLURM or Open MPI jobs of more than one task) is joined with `jax.distributed.initialize()`
and no arguments (JAX reads coordinator, count and id from the environment); anywhere else the
command runs as one process. Joining must happen before any other JAX call (afterwards
`jax.devices()` lists every process's devices), so `join` runs first in each command.
"""
from __future__ import annotations

import os
import sys

FLAGS = ("--coordinator", "--num-processes", "--process-id")


class DistributedFlagError(ValueError):
    """Inconsistent or malformed --coordinator / --num-processes / --process-id."""


def add_arguments(parser) -> None:
    g = parser.add_argument_group(
        "across processes", "run one program over the devices of several processes (hosts): the same command on "
        "every host with its own --process-id. Without these flags, TPU pod slices and multi-task SLURM / Open MPI "
        "jobs are joined automatically")
    g.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0's coordination service "
                   "(the same on every process; process 0 listens on PORT)")
    g.add_argument("--num-processes", type=int, metavar="N", help="how many processes take part")
    g.add_argument("--process-id", type=int, metavar="I", help="this process's id, 0 .. N-1 (0 is the coordinator)")


def check_flags(coordinator: str | None, num_processes: int | None, process_id: int | None) -> tuple | None:
    """(host:port, N, I) when the flags ask for an explicit join, None when none is given.
    Raises DistributedFlagError naming the flag and its value."""
    given = {"--coordinator": coordinator, "--num-processes": num_processes, "--process-id": process_id}
    if all(v is None for v in given.values()):
        return None
    missing = [k for k, v in given.items() if v is None]
    if missing:
        have = ", ".join(f"{k} {v}" for k, v in given.items() if v is not None)
        raise DistributedFlagError(f"{have} given without {' and '.join(missing)}: pass all three of "
                                   f"{', '.join(FLAGS)} (or none, to run as one process)")
    host, sep, port = coordinator.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DistributedFlagError(f"--coordinator {coordinator!r} is not HOST:PORT with a port in 1..65535 "
                                   "(e.g. 10.0.0.1:8476, the address of process 0)")
    if num_processes < 1:
        raise DistributedFlagError(f"--num-processes {num_processes}: must be at least 1")
    if not 0 <= process_id < num_processes:
        raise DistributedFlagError(f"--process-id {process_id}: must be in 0..{num_processes - 1} "
                                   f"(--num-processes {num_processes})")
    return coordinator, num_processes, process_id


def detected_cluster() -> str | None:
    """The name of a multi-process cluster environment JAX would join by itself, else None.

    JAX's detectors (jax._src.clusters, private: read defensively) say whether a TPU pod, SLURM or
    Open MPI environment is present; a one-task SLURM / MPI job runs as one process, so those need
    more than one task here.
    """
    try:
        from jax._src.clusters import ClusterEnv
    except ImportError:  # noqa: BLE001 (moved in another JAX version: no auto-detection)
        return None
    single = {"slurm": "SLURM_NTASKS", "ompi": "OMPI_COMM_WORLD_SIZE"}
    for env in getattr(ClusterEnv, "_cluster_types", ()):
        name = getattr(env, "name", "") or env.__name__
        # Kubernetes is detected by any pod (also a one-pod run): join it with the flags instead
        if getattr(env, "opt_in_only_method", False) or env.__name__ == "K8sCluster":
            continue
        try:
            present = env.is_env_present()
        except Exception:  # noqa: BLE001 (a detector that fails detects nothing)
            present = False
        if not present:
            continue
        if name in single and int(os.environ.get(single[name], "1") or 1) <= 1:
            continue
        return name
    return None


def join(args, prog: str) -> int | None:
    """Join the distributed runtime as the flags (or the cluster) say. Returns None to go on, or the
    exit code 2 after printing what is wrong with the flags. Call before any other JAX call."""
    try:
        explicit = check_flags(getattr(args, "coordinator", None), getattr(args, "num_processes", None),
                               getattr(args, "process_id", None))
    except DistributedFlagError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
    from sharding.mesh import init_distributed

    if explicit is not None:
        init_distributed(*explicit)
    elif detected_cluster() is not None:
        init_distributed(None, None, None)  # JAX reads the cluster's coordinator, count and id
    return None
