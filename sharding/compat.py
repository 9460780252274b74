"""The few JAX APIs whose spelling moved between the versions we support (0.10 .. 0.11)."""
from __future__ import annotations

import jax


def shard_map(f, *, mesh, in_specs, out_specs):
    """`jax.shard_map` where it exists, else `jax.experimental.shard_map.shard_map`.

    Replication checking is off: our bodies end in explicit collectives whose outputs are
    replicated by construction, and the checker's rules differ between versions.
    """
    if hasattr(jax, "shard_map"):
        try:
            return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
        except TypeError:  # older keyword
            return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)
    from jax.experimental.shard_map import shard_map as _legacy

    return _legacy(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=False)


def has_ragged_all_to_all(platform: str | None = None) -> bool:
    """Whether `jax.lax.ragged_all_to_all` exists and the backend compiles it.

    XLA:CPU has no ragged-all-to-all thunk (as of jax 0.10), so CPU uses the fixed-capacity path.
    """
    if not hasattr(jax.lax, "ragged_all_to_all"):
        return False
    platform = platform or jax.default_backend()
    return platform in ("tpu", "gpu", "cuda", "rocm")
