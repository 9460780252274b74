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


def on_host(f, n_outputs: int):
    """`f` computed by XLA on the host (`compute_on("device_host")`), outputs left in host memory.

    jax 0.10 spells it as a context manager; jax >= 0.11 as a function transform that also
    names the outputs' memory spaces.
    """
    import inspect

    from jax.experimental.compute_on import compute_on

    if "out_memory_spaces" in inspect.signature(compute_on).parameters:
        return compute_on(f, compute_type="device_host", out_memory_spaces=(jax.memory.Space.Host,) * n_outputs)

    def wrapped(*args):
        with compute_on("device_host"):
            return f(*args)

    return wrapped
