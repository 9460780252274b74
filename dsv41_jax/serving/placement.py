"""The engine's strategies for where its arrays live: the placement of params, caches and step
outputs, and where the Engram tables are read from. The engine holds one of each and never asks
which it has.

A placement answers:
- `load(model, plan, host_tables, taps)` -> (graphdef, params, stored): the graphdef the steps merge,
  the params as the steps read them (the kernels' word views, `kernel_params`, and each run of layers
  the steps scan held stacked, `stack_layers`; taps: the steps tap DSpark's layers, a speculating
  engine), and the params as stored (what the model's fingerprint hashes);
- `place(tree)`: a cache, buffer or stored conversation committed where the steps run (jit
  compiles a program once for an uncommitted and once for a committed input, so everything that
  enters a step is placed first: every piece of a prompt then runs one program per shape);
- `constrain(tree)`: inside a step, the layout a returned tree keeps;
- `replicated`: the sharding of inputs every device reads (the compact Engram tables);
- `trace()`: the context the steps are traced in (on a mesh: the kernels run per device).
`OneDevice` here; `sharding.serving.MeshPlacement` lays everything out on a mesh by a preset.

A table source answers `prepare(model)` -> (the model the placement loads, the params to
fingerprint or None) and `inputs(params, ids, replicated)` -> (params, device ids) for one step
over tokens whose host hash ids are `ids`. `DeviceTables` here (the tables in the params);
`sharding.serving.HostTables` keeps them in host memory and sends each step the rows it reads.
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.model.kernel_weights import kernel_params
from dsv41_jax.model.transformer import stack_layers


class OneDevice:
    """The engine's arrays where the model's params already are (one device, or as loaded)."""

    replicated = None

    def load(self, model, plan, host_tables: bool = False, taps: bool = False):
        graphdef, params = nnx.split(model)
        home = next(leaf.sharding for leaf in jax.tree.leaves(params) if isinstance(leaf, jax.Array))
        self.replicated = (jax.sharding.NamedSharding(home.mesh, jax.sharding.PartitionSpec())
                           if isinstance(home, jax.sharding.NamedSharding) else home)
        # the layers' weights as the decode plan's TPU kernels read them (32-bit word views), made
        # once here, replacing the stored bytes (every step shares the runtime, so its kernel
        # choice); unchanged for exact mode, impl "xla" and the GPU kernels. Then the scanned runs
        # stacked (new arrays: until the caller drops `model`, the runs' weights are held twice)
        return (*stack_layers(graphdef, kernel_params(graphdef, params, plan), plan, taps), params)

    def place(self, tree):
        return jax.device_put(tree, self.replicated)

    def constrain(self, tree):
        return tree

    def trace(self):
        return contextlib.nullcontext()


class DeviceTables:
    """The Engram tables in device memory, inside the params: a step reads its hash ids."""

    def prepare(self, model):
        return model, None

    def inputs(self, params, ids: np.ndarray, replicated):
        return params, jnp.asarray(ids.astype(np.int32))
