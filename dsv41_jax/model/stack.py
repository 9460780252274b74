"""Runs of same-kind layers held stacked: `LayerStack`, and the questions the layer loop asks of a
model whose layers may be held that way (`layer`, `layer_shapes`, `run_params`, `blocks`).

A scanned run (`block.scan_run`) reads its layers' parameters on a leading layer axis. Stacked
inside each program, that is a copy of the run's weights per call (temporaries the size of the
runs' weights, and the weights read twice per step). The engine instead holds each run stacked,
made once at load (`transformer.stack_layers`, called by `serving.placement`): the program then
slices its argument. The stacked tree is a view the engine builds; checkpoints, the loaders, the
exporters and every other driver keep one Block per layer under its own name.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class LayerStack(nnx.Module):
    """The consecutive layers `run` (one kind: a run of `block.layer_runs`) as one `Block` whose
    parameters carry a leading layer axis. The model's `layers[l]` is this same module for each l
    of the run (a shared reference: its parameters appear once, under the run's first layer, at
    `layers.{first}.stacked`)."""

    def __init__(self, stacked, run):
        self.stacked, self.run = stacked, tuple(run)


def layer(model, l: int):
    """Layer l's Block: the model's own, or layer l's slice of the `LayerStack` holding it (for a
    layer a program runs on its own, e.g. one a probe follows)."""
    b = model.layers[l]
    if not isinstance(b, LayerStack):
        return b
    graphdef, params = nnx.split(b.stacked)
    i = b.run.index(l)
    return at_layer(graphdef, jax.tree.map(lambda a: jax.lax.index_in_dim(a, i, keepdims=False), params), l, model.cfg)


def at_layer(graphdef, params, l: int, cfg):
    """The Block of `graphdef` with `params` as layer l (its number and role: a run's layers share
    one graphdef, the first layer's)."""
    block = nnx.merge(graphdef, params)
    block.layer, block.role = l, cfg.roles[l]
    return block


def layer_shapes(model, l: int):
    """Layer l's parameters as (shape, dtype) leaves, without slicing a stack."""
    b = model.layers[l]
    if isinstance(b, LayerStack):
        return jax.tree.map(lambda a: (tuple(a.shape[1:]), a.dtype), nnx.state(b.stacked))
    return jax.tree.map(lambda a: (tuple(a.shape), a.dtype), nnx.state(b))


def run_params(model, run):
    """(graphdef, the run's parameters on a leading layer axis): a slice of the `LayerStack` holding
    the run (the whole of it: the argument itself), else the layers' parameters stacked here."""
    s = model.layers[run[0]]
    if isinstance(s, LayerStack) and set(run) <= set(s.run):
        graphdef, params = nnx.split(s.stacked)
        if tuple(run) == s.run:
            return graphdef, params
        i = s.run.index(run[0])
        return graphdef, jax.tree.map(lambda a: jax.lax.slice_in_dim(a, i, i + len(run)), params)
    graphdef, _ = nnx.split(layer(model, run[0]))
    return graphdef, jax.tree.map(lambda *a: jnp.stack(a), *(nnx.state(layer(model, l)) for l in run))


def held_runs(model) -> tuple:
    """The runs of layers the model holds stacked, in order (the engine's cache holds the same
    runs' window rings stacked: `model.cache.RingStack`)."""
    out: list = []
    for b in model.layers:
        if isinstance(b, LayerStack) and b.run not in out:
            out.append(b.run)
    return tuple(out)


def blocks(model) -> list:
    """Each Block module of the model once (a stack's stacked Block once): what a pass that swaps
    a layer's sub-modules (expert-parallel MoE, row-sharded Engram) walks."""
    out: list = []
    for b in model.layers:
        b = b.stacked if isinstance(b, LayerStack) else b
        if not any(b is o for o in out):
            out.append(b)
    return out


def stack_leaves(*leaves):
    """One parameter of a run's layers on a new leading axis, where the leaves are: abstract
    (`jax.ShapeDtypeStruct`), host arrays (stacked on the host, before placement), or device arrays."""
    a = leaves[0]
    if isinstance(a, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(leaves), *a.shape), a.dtype)
    if isinstance(a, np.ndarray):
        return np.stack(leaves)
    return jnp.stack(leaves)
