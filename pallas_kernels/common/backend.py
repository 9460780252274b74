"""Which implementation a kernel call runs: the XLA reference, the Mosaic TPU kernel or the GPU one.

Every public kernel takes `impl` ("auto" | "xla" | "pallas") and `interpret` (None = interpret
exactly when the default backend is the CPU). `platform` ("tpu" | "gpu") picks which Pallas
lowering to build; it defaults to the backend's own, and on CPU to the TPU kernel (interpreted).
Naming the platform with interpret=False on a CPU machine is how the export tests lower the TPU
and GPU kernels without the hardware.
"""
from __future__ import annotations

from typing import NamedTuple

import jax

IMPLS = ("auto", "xla", "pallas")
PLATFORMS = ("tpu", "gpu")


class Choice(NamedTuple):
    """The resolved implementation: kind is "xla", "tpu" or "gpu"."""

    kind: str
    interpret: bool


def _backend_platform() -> str:
    backend = jax.default_backend()
    if backend == "tpu":
        return "tpu"
    if backend in ("gpu", "cuda", "rocm"):
        return "gpu"
    return "cpu"


def resolve(impl: str, interpret: bool | None, platform: str | None = None) -> Choice:
    """Resolve the switches of a kernel call; raise a clear error for unknown values."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if platform is not None and platform not in PLATFORMS:
        raise ValueError(f"platform must be one of {PLATFORMS} or None, got {platform!r}")
    here = _backend_platform()
    if impl == "xla" or (impl == "auto" and here == "cpu" and not interpret):
        return Choice("xla", False)
    kind = platform or (here if here != "cpu" else "tpu")
    if interpret is None:
        interpret = here == "cpu"
    return Choice(kind, bool(interpret))
