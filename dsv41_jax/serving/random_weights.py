"""A model with random weights filled on the host, for tests and benchmarks.

Eager construction of `Transformer` compiles hundreds of small XLA ops (tens of seconds on a
busy CPU, all of it before any step runs); filling the abstract model's parameters with numpy
values costs a fraction of that. The values only need to be valid in their formats: E4M3
weights, packed E2M1 bytes, E8M0 exponents near 2^0, norm gains near 1.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from dsv41_jax.config import ModelConfig
from dsv41_jax.model.transformer import Transformer


def random_model(cfg: ModelConfig, seed: int = 0):
    """A Transformer of `cfg` with seeded random weights (not the module's own init)."""
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=0))
    graphdef, state = nnx.split(abstract)
    rng = np.random.default_rng(seed)

    def fill(path, leaf):
        shape, dt = leaf.shape, np.dtype(leaf.dtype)
        name = jax.tree_util.keystr(path)
        if dt == np.uint8:
            if "scale" in name:
                return jnp.asarray(rng.integers(121, 128, shape, dtype=np.uint8))
            return jnp.asarray(rng.integers(0, 256, shape, dtype=np.uint8))
        if dt == np.dtype(ml_dtypes.float8_e4m3fn):
            return jnp.asarray((rng.normal(size=shape) * 8).astype(dt))
        if "norm" in name or "q_weight" in name or "k_weight" in name:
            return jnp.asarray((1.0 + 0.1 * rng.normal(size=shape)).astype(dt))
        std = 1.0 / np.sqrt(shape[-1]) if len(shape) >= 2 else 0.5
        return jnp.asarray((rng.normal(size=shape) * std).astype(dt))

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(fill, state))
