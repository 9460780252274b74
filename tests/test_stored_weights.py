"""Stored FP8/FP4 weights are read in their stored format (issue 23, item 1), checked on the traced
decode step of the engine (`split_prefill.decode_step` on `decode_plan`), no weights needed:

- XLA path: no routed expert is dequantized unless a row chose it. Every float value derived from
  the stacked expert weights [E, ...] comes through a gather (the active experts, or one row's
  expert), never from the whole stack: at batch 1 (the per-row path) and at a batch whose routed
  rows take the grouped path.
- pallas path (fast numerics): no whole weight is dequantized outside a kernel: the dense FP8
  linears run the FP8 block GEMM and the routed experts the grouped expert GEMM.

The tracker follows each weight parameter through the jaxpr: ops that keep the whole weight
(converts, reshapes, bit operations) carry it on; gathers and slices (rows picked by routing) and
kernel calls (`pallas_call`) stop it. A floating-point value the size of the weight reached that
way is a whole-weight dequantization.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax.config import ModelConfig
from dsv41_jax.runtime import Runtime
from dsv41_jax.serving import cost
from dsv41_jax.serving import split_prefill as sp

_SELECTS = {"gather", "dynamic_slice", "slice"}
_KERNELS = {"pallas_call"}


def _sub_jaxprs(eqn):
    for v in eqn.params.values():
        for j in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(j, jax.extend.core.ClosedJaxpr):
                yield j.jaxpr
            elif isinstance(j, jax.extend.core.Jaxpr):
                yield j


def whole_weight_dequants(jaxpr, tainted: dict) -> list[tuple[str, tuple, str]]:
    """(weight name, shape, primitive) of every floating value derived from a whole weight outside a
    kernel. tainted: {var: (name, weight element count)}."""
    found = []
    for eqn in jaxpr.eqns:
        hits = [tainted[v] for v in eqn.invars if isinstance(v, jax.extend.core.Var) and v in tainted]
        if not hits or eqn.primitive.name in _KERNELS:
            continue
        if eqn.primitive.name in _SELECTS and eqn.invars[0] in tainted and all(
                v not in tainted for v in eqn.invars[1:] if isinstance(v, jax.extend.core.Var)):
            continue  # rows picked out of the weight; a weight used as indices (a decode table) carries on
        subs = list(_sub_jaxprs(eqn))
        if subs:
            for sub in subs:
                n = min(len(sub.invars), len(eqn.invars))
                # call-like primitives pass operands in order (pjit, custom_jvp/vjp, remat, closed_call)
                inner = {sub.invars[i]: tainted[eqn.invars[i]] for i in range(n)
                         if isinstance(eqn.invars[i], jax.extend.core.Var) and eqn.invars[i] in tainted}
                found += whole_weight_dequants(sub, inner)
                for i, o in enumerate(sub.outvars):
                    if isinstance(o, jax.extend.core.Var) and o in inner and i < len(eqn.outvars):
                        tainted[eqn.outvars[i]] = inner[o]
            continue
        name, size = hits[0]
        for o in eqn.outvars:
            aval = o.aval
            if not hasattr(aval, "shape") or int(np.prod(aval.shape)) < size:
                continue
            tainted[o] = (name, size)
            if jnp.issubdtype(aval.dtype, jnp.floating) and aval.dtype != jnp.float8_e4m3fn:
                found.append((name, tuple(aval.shape), eqn.primitive.name))
    return found


def _weights(params) -> dict[int, tuple[str, int]]:
    """{leaf index: (path, stored element count)} of the stored quantized weights."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    out = {}
    for i, (path, leaf) in enumerate(leaves):
        name = jax.tree_util.keystr(path)
        if leaf.dtype == jnp.float8_e4m3fn and leaf.ndim >= 2:
            out[i] = (name, int(np.prod(leaf.shape)))
        elif leaf.dtype == jnp.uint8 and leaf.ndim == 3 and "scale" not in name:  # packed FP4 experts
            out[i] = (name, int(np.prod(leaf.shape)))  # packed: the decoded values are twice as many
    return out


def _traced(cfg, batch: int, impl: str):
    gd, params = cost.abstract_params(cfg)
    cache = cost.abstract_cache(cfg, batch, 64)
    toks = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
    leaves, tree = jax.tree_util.tree_flatten(params)
    plan = sp.decode_plan(Runtime(mode="fast", impl=impl))

    def step(leaves, tokens, cache, ids):
        p = jax.tree_util.tree_unflatten(tree, leaves)
        return sp.decode_step(nnx.merge(gd, p), tokens, cache, plan, engram_ids=ids)[0]

    closed = jax.make_jaxpr(step)(leaves, toks, cache, cost.engram_spec(cfg, batch, 1))
    weights = _weights(params)
    tainted = {closed.jaxpr.invars[i]: w for i, w in weights.items()}
    return whole_weight_dequants(closed.jaxpr, tainted), weights


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.tiny()  # FP8 dense linears, FP4 routed experts, as the checkpoint


@pytest.mark.parametrize("batch", [1, 160])
def test_xla_decode_dequantizes_no_inactive_expert(cfg, batch):
    # batch 160: 320 routed rows, past the grouped path's threshold (256); batch 1: the per-row path
    found, weights = _traced(cfg, batch, "xla")
    assert any("['experts']" in n for n, _ in weights.values())
    experts = [f for f in found if "['experts']" in f[0]]
    assert experts == [], f"whole expert stacks dequantized: {experts[:4]}"
    # the tracker sees the dense FP8 linears' dequantization on the XLA path (it cannot pass vacuously)
    assert any("['experts']" not in f[0] for f in found)


def test_pallas_decode_dequantizes_no_whole_weight_outside_a_kernel(cfg):
    found, weights = _traced(cfg, 1, "pallas")
    assert len(weights) > 10
    assert found == [], f"whole weights dequantized outside a kernel: {found[:4]}"
