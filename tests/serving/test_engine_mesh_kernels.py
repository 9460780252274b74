"""The engine's decode step on a mesh with the kernels (impl "pallas"), as traced: the weights are
read where the kernels read them, on each device.

Oracle: the jaxpr of the engine's own jitted decode step (`Engine.steps.decode`, the program the
engine runs), followed by the weight-traffic tracker (`serving.weight_traffic`, as bench/decode.py
--stored-weights reports it): every stored FP8/FP4 weight enters a kernel as the params hold it (the
word views `kernel_params` made at load, placed like the stored bytes), none is dequantized or
relaid out outside a kernel; every kernel call runs inside a `shard_map` (GSPMD cannot split a
Mosaic call: on a TPU mesh a kernel outside one does not compile); and every KV cache (window rings,
compressed KV, index keys) enters its kernel as the step holds it (`weight_traffic.kv_cache_uses`:
rows written into it, no copy, no regrouping into the kernels' 32-bit words). The same holds for a
model with a scanned run of layers: its weights and its window rings are held stacked (at load, and
in the cache: `model.cache.RingStack`), the scan reading and writing them in place. Nothing is
compiled or run.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.config import ModelConfig
from dsv41_jax.model.cache import RingStack
from dsv41_jax.runtime import Runtime
from dsv41_jax.serving import weight_traffic as wt
from dsv41_jax.serving.engine import Engine
from dsv41_jax.serving.random_weights import random_model
from sharding.mesh import make_mesh
from sharding.serving import engine_strategies

CFG = ModelConfig.tiny(max_seq_len=64, n_layers=2, compress_ratios=(0, 1), kv_source_layers=(1,),
                       index_source_layers=(1,), candidate_source_layer=1, n_routed_experts=8, vocab_size=256,
                       engram_layer_ids=())
# layers 0-2 (SWA) are one scanned run
SCANNED = CFG.replace(n_layers=4, compress_ratios=(0, 0, 0, 1), kv_source_layers=(3,), index_source_layers=(3,),
                      candidate_source_layer=3)


def _kernel_calls(jaxpr, inside=False):
    """(kernel name, inside a shard_map) of every pallas_call in a jaxpr, nested ones included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            out.append((wt.kernel_name(eqn), inside))
        for sub in wt.sub_jaxprs(eqn):
            out += _kernel_calls(sub, inside or eqn.primitive.name == "shard_map")
    return out


def _traced_decode(cfg):
    """(engine, its decode step's jaxpr) on expert=4,tensor=2 with the TPU kernels (interpreted on
    CPU) and the FP8 block GEMM on, as when they are compiled."""
    runtime = Runtime(mode="fast", impl="pallas", interpret=True, fp8_kernel=True)
    eng = Engine(random_model(cfg, seed=3), slots=4, min_capacity=64, prefill_chunk=8, runtime=runtime,
                 **engine_strategies(make_mesh("expert=4,tensor=2"), "inference"))
    tokens, active = jax.ShapeDtypeStruct((4, 1), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.bool_)
    return eng, eng.steps.decode.trace(eng.params, tokens, eng.cache, None, active, None).jaxpr


def _relaid_out(eng, traced):
    """(weights dequantized or relaid out outside a kernel, KV caches relaid out for a kernel, KV
    caches that enter no kernel)."""
    uses = wt.uses_in(traced, eng.params)
    assert len(uses) > 10  # the dense FP8 linears and the expert stacks of every layer
    weights = [(u.name, u.dequantized[:1], u.relayout_bytes) for u in uses if u.dequantized or u.relayout_bytes]
    assert all(u.kernels for u in uses if "embed" not in u.name), [u.name for u in uses if not u.kernels][:4]
    kv = wt.kv_cache_uses(traced, len(jax.tree_util.tree_leaves(eng.params)) + 1, eng.cache)
    # the window rings of every layer, the compressed KV and index keys of the source (two arrays each at least)
    assert len(kv) >= 8
    return weights, [(u.name, u.relayout_bytes) for u in kv if u.relayout_bytes], [u.name for u in kv if not u.kernels]


def test_mesh_decode_reads_each_weight_in_its_kernel_per_device():
    eng, traced = _traced_decode(CFG)
    weights, kv, no_kernel = _relaid_out(eng, traced)
    assert weights == [], f"weights dequantized or relaid out outside a kernel on every step: {weights[:4]}"
    calls = _kernel_calls(traced.jaxpr)
    assert {name for name, _ in calls} >= {"fp8_block_gemm_tpu", "grouped_fp4_gemm_tpu", "sparse_sink_attention_tpu"}
    assert all(inside for _, inside in calls), sorted({name for name, inside in calls if not inside})
    assert no_kernel == [], no_kernel
    assert kv == [], f"KV caches relaid out for a kernel on every step: {kv[:4]}"


def test_mesh_decode_over_a_scanned_run_copies_no_weight_and_no_ring():
    eng, traced = _traced_decode(SCANNED)
    assert eng.ring_runs == ((0, 1, 2),)  # the run is scanned, its weights held stacked
    assert isinstance(eng.cache["window"][0], RingStack) and eng.cache["window"][1:3] == [None, None]
    assert any(eqn.primitive.name == "scan" for eqn in traced.jaxpr.eqns)
    weights, kv, no_kernel = _relaid_out(eng, traced)
    assert weights == [], f"weights dequantized or relaid out outside a kernel on every step: {weights[:4]}"
    assert no_kernel == [], no_kernel
    assert kv == [], f"KV caches relaid out for a kernel on every step (the run's rings stacked per call?): {kv[:4]}"
