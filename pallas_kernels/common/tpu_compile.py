"""Compile for a TPU on a machine without one: libtpu's XLA:TPU and Mosaic, for a named topology.

`jax.experimental.topologies` describes a slice (its chips, hosts and process ids) from libtpu
alone; a program lowered with shardings over those devices compiles with the TPU compiler, the
kernels inside it through Mosaic (which checks VMEM, tilings and layouts, the checks
`jax.export` stops before). Nothing runs and nothing is allocated. This works in a process
whose JAX backend is the CPU (JAX_PLATFORMS=cpu, the tests' setting).

Two settings must be in the environment before libtpu loads (the first topology asked for):
TPU_SKIP_MDS_QUERY (no cloud-metadata query that waits on a machine that is not a TPU VM) and
ALLOW_MULTIPLE_LIBTPU_LOAD (libtpu otherwise holds /tmp/libtpu_lockfile, and a second process
compiling at the same time, an xdist worker or another user, is refused).
"""
from __future__ import annotations

import functools
import os

# the smallest one-host slice of each generation this libtpu knows (v5p counts a third dimension)
CHIP_TOPOLOGY = {"v5e": "v5e:2x2", "v6e": "v6e:2x2", "v5p": "v5p:2x2x1", "v7x": "tpu7x:2x2x1"}
KERNEL_TARGETS = ("v5e", "v6e", "v5p")  # what the kernels are checked for; v7x where libtpu knows it
# per-chip HBM (GiB), keyed by the device_kind libtpu reports
HBM_GIB_BY_KIND = {"TPU v5 lite": 16, "TPU v6 lite": 32, "TPU v5": 95, "TPU v4": 32, "TPU7x": 192}
ENV = {"TPU_SKIP_MDS_QUERY": "1", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


def libtpu_missing() -> str | None:
    """Why this machine cannot compile for a TPU (libtpu not importable), or None when it can."""
    try:
        import libtpu  # noqa: F401
    except ImportError as e:
        return (f"libtpu is not installed ({e}); `pip install -e \".[dev]\"` brings it on x86-64 Linux "
                "(or `pip install \"jax[tpu]\"` matching the installed jax)")
    return None


def prepare_environment() -> None:
    for k, v in ENV.items():
        os.environ.setdefault(k, v)


def topology_name(target: str) -> str:
    """A generation ("v6e") to its one-host slice; a full name ("v6e:4x4", "v5p:4x4x4") as given."""
    return CHIP_TOPOLOGY.get(target, target)


@functools.lru_cache(maxsize=16)
def topology(target: str):
    """The `TopologyDescription` of a generation or slice name; ValueError naming the target when libtpu refuses."""
    missing = libtpu_missing()
    if missing:
        raise RuntimeError(missing)
    prepare_environment()
    from jax.experimental import topologies

    name = topology_name(target)
    try:
        return topologies.get_topology_desc(platform="tpu", topology_name=name)
    except Exception as e:  # noqa: BLE001 (libtpu's XlaRuntimeError: re-raised with what to fix)
        raise ValueError(f"TPU topology {name!r} is not one libtpu can build ({str(e).splitlines()[0]}); write "
                         "GENERATION:AxB (v5e, v6e: 2-D, e.g. v6e:4x4) or GENERATION:AxBxC (v4, v5p, tpu7x: "
                         "3-D, e.g. v5p:4x4x4), sizes a multiple of one host's chips (2x2 or 2x2x1)") from None


def hbm_bytes(device) -> int | None:
    gib = HBM_GIB_BY_KIND.get(getattr(device, "device_kind", ""))
    return None if gib is None else gib * 2 ** 30


def compile_on_one_chip(fn, *shapes, target: str = "v6e"):
    """jit(fn) compiled for one chip of `target` from abstract arguments (a `jax.stages.Compiled`)."""
    import jax

    device = topology(target).devices[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    args = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), shapes)
    return jax.jit(fn).lower(*args).compile()


def mosaic_kernels(hlo_text: str) -> list[str]:
    """Names of the Pallas kernels that reached Mosaic in a compiled program's HLO, in order, with repeats."""
    import re

    names = []
    for line in hlo_text.splitlines():
        if 'custom_call_target="tpu_custom_call"' in line:
            m = re.search(r'op_name="[^"]*?(\w+_tpu)\b', line) or re.search(r"\b(\w+_tpu)\b", line)
            names.append(m.group(1) if m else "?")
    return names
