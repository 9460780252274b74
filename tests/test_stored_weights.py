"""Stored FP8/FP4 weights are read in their stored format (issue 23, item 1), checked on the traced
decode step of the engine (`split_prefill.decode_step` on `decode_plan`), no weights needed:

- XLA path: no routed expert is dequantized unless a row chose it. Every float value derived from
  the stacked expert weights [E, ...] comes through a gather (the active experts, or one row's
  expert), never from the whole stack: at batch 1 (the per-row path) and at a batch whose routed
  rows take the grouped path.
- pallas path (fast numerics): no whole weight is dequantized outside a kernel: the dense FP8
  linears run the FP8 block GEMM and the routed experts the grouped expert GEMM.

The tracker (`dsv41_jax.serving.weight_traffic`, which bench/decode.py --stored-weights also uses)
follows each weight parameter through the jaxpr: ops that keep the whole weight (converts, reshapes,
static slices, bit packing) carry it on; gathers (rows picked by routing), dots and kernel calls
(`pallas_call`) stop it. A floating-point value the size of the weight reached that way is a
whole-weight dequantization.
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
from dsv41_jax.serving import weight_traffic as wt

def _traced(cfg, batch: int, impl: str):
    """The stored weights' uses (`weight_traffic.WeightUse`) in the engine's decode step."""
    gd, params = cost.abstract_params(cfg)
    tree = jax.tree_util.tree_structure(params)
    # the kernels as compiled on TPU (the trace needs no compilation): the FP8 GEMM kernel is on
    plan = sp.decode_plan(Runtime(mode="fast", impl=impl, interpret=False if impl == "pallas" else None))

    def step(leaves, tokens, cache, ids):
        p = jax.tree_util.tree_unflatten(tree, leaves)
        return sp.decode_step(nnx.merge(gd, p), tokens, cache, plan, engram_ids=ids)[0]

    return wt.trace_uses(step, params, jax.ShapeDtypeStruct((batch, 1), jnp.int32), cost.abstract_cache(cfg, batch, 64),
                         cost.engram_spec(cfg, batch, 1))


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.tiny()  # FP8 dense linears, FP4 routed experts, as the checkpoint


@pytest.mark.parametrize("batch", [1, 160])
def test_xla_decode_dequantizes_no_inactive_expert(cfg, batch):
    # batch 160: 320 routed rows, past the grouped path's threshold (256); batch 1: the per-row path
    uses = _traced(cfg, batch, "xla")
    experts = [u for u in uses if "['experts']" in u.name]
    assert len(experts) == 3 * cfg.n_layers
    whole = [(u.name, u.dequantized[:1]) for u in experts if u.dequantized]
    assert whole == [], f"whole expert stacks dequantized: {whole[:4]}"
    assert all(u.gathered_bytes > 0 for u in experts)  # the active experts' rows are read
    # the tracker sees the dense FP8 linears' whole-weight dequantization (it cannot pass vacuously)
    assert any(u.dequantized for u in uses if "['experts']" not in u.name)


def test_pallas_decode_dequantizes_no_whole_weight_outside_a_kernel(cfg):
    uses = _traced(cfg, 1, "pallas")
    assert len(uses) > 10
    whole = [(u.name, u.dequantized[:1]) for u in uses if u.dequantized]
    assert whole == [], f"whole weights dequantized outside a kernel: {whole[:4]}"
    linears = [u for u in uses if "['experts']" not in u.name and "embed" not in u.name]
    assert linears and all(u.kernels == {"fp8_block_gemm_tpu"} for u in linears), linears[:2]
    assert all(u.kernels == {"grouped_fp4_gemm_tpu"} for u in uses if "['experts']" in u.name)
