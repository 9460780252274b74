"""What a driver gives the layer body: how to run it (`Plan`, static) and which chunk (`Span`, traced)."""
from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import jax
import jax.numpy as jnp

from dsv41_jax.runtime import Runtime


@dataclasses.dataclass(frozen=True)
class Plan:
    """How a driver runs the body (static, hashable: part of every jit key).

    runtime: the settings of how the model computes (`Runtime`), resolved on this backend once by
      `Plan.resolve` (impl "xla" or "pallas", interpret and fp8_kernel decided), so the body and the
      layers' kernel entry points read one object; `Runtime` is its user-facing constructor.
    writes: "all" (KV sources write compressed entries, index keys, compressor state), "window"
      (only the window rings: Graph B of the split prefill and the replay read the globals) or
      "pending" (a speculative verify: the chunk reads its own writes as with "all", and the store
      also returns them, `QuantStore.pending`, so that `commit` applies only an accepted prefix).
    pool_scoring: in-pool Reindex layers score only the pool's index keys, and the compressed rows
      the attention reads are gathered when that is smaller (decode; intended index keys only).
    packed_scoring: with pool_scoring in fast mode, score the packed keys with
      `fast_index.scores_packed` (a second, deliberately different fast numerics).
    """

    runtime: Runtime = Runtime(interpret=False, fp8_kernel=False)
    writes: Literal["all", "window", "pending"] = "all"
    pool_scoring: bool = False
    packed_scoring: bool = False

    def __post_init__(self):
        if self.writes not in ("all", "window", "pending"):
            raise ValueError(f"Plan.writes must be 'all', 'window' or 'pending', got {self.writes!r}")
        if self.runtime != self.runtime.resolved():
            raise ValueError(f"Plan.runtime must be resolved (impl 'xla' or 'pallas', interpret and fp8_kernel "
                             f"decided), got {self.runtime}; build the plan with Plan.resolve(runtime)")

    @classmethod
    def resolve(cls, runtime: Runtime, **kw) -> "Plan":
        """The plan for `runtime`, with impl and interpret decided here (on this backend) once."""
        return cls(runtime.resolved(), **kw)

    @property
    def kernel_mode(self) -> str | None:
        """The numerics the attention/indexer kernels run, or None when they run their XLA math."""
        return self.runtime.kernel_mode()


class Span(NamedTuple):
    """The chunk a driver runs (traced)."""

    positions: jax.Array  # [B, T] RoPE positions
    start: jax.Array  # [B] absolute position of the chunk's first token (ring slots, group ids)
    engram_ids: jax.Array | None = None  # [B, T, n_engram_layers, cols]
    floor: jax.Array | None = None  # [B]: window slots at positions below it are empty
    vl: jax.Array | None = None  # [B, T] bool: image-span positions

    @classmethod
    def at(cls, start: jax.Array, T: int, **kw) -> "Span":
        return cls(positions=start[:, None] + jnp.arange(T)[None], start=start, **kw)
