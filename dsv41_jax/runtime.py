"""Runtime switches that change how the model computes, not what it is."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Runtime:
    """Static (hashable) options threaded through every forward.

    mode: "fast" accumulates dots in fp32 (production); "exact" computes every dot in float64
      and rounds once, mirroring the golden oracle (needs `jax.enable_x64(True)`).
    impl: "xla" plain jnp, "pallas" the kernels in `pallas_kernels/`, "auto" picks per backend.
    index_k_quirk: reproduce the reference's index-key publishing bug (SPEC §6); False = intended.
    """

    mode: Literal["fast", "exact"] = "fast"
    impl: Literal["xla", "pallas", "auto"] = "xla"
    index_k_quirk: bool = False
    interpret: bool = False  # run Pallas kernels in interpret mode (CPU)

    def __post_init__(self):
        if self.mode not in ("fast", "exact"):
            raise ValueError(f"Runtime.mode must be 'fast' or 'exact', got {self.mode!r}")
        if self.impl not in ("xla", "pallas", "auto"):
            raise ValueError(f"Runtime.impl must be 'xla', 'pallas' or 'auto', got {self.impl!r}")
