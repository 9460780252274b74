"""The engine's decode step on a mesh with the kernels (impl "pallas"), as traced: the weights are
read where the kernels read them, on each device.

Oracle: the jaxpr of the engine's own jitted decode step (`Engine.steps.decode`, the program the
engine runs), followed by the weight-traffic tracker (`serving.weight_traffic`, as bench/decode.py
--stored-weights reports it): every stored FP8/FP4 weight enters a kernel as the params hold it (the
word views `kernel_params` made at load, placed like the stored bytes), none is dequantized or
relaid out outside a kernel; every kernel call runs inside a `shard_map` (GSPMD cannot split a
Mosaic call: on a TPU mesh a kernel outside one does not compile); and every KV cache (window rings,
compressed KV, index keys) enters its kernel as the step holds it (`weight_traffic.kv_cache_uses`:
rows written into it, no copy, no regrouping into the kernels' 32-bit words). Nothing is compiled or run.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.config import ModelConfig
from dsv41_jax.runtime import Runtime
from dsv41_jax.serving import weight_traffic as wt
from dsv41_jax.serving.engine import Engine
from dsv41_jax.serving.random_weights import random_model
from sharding.mesh import make_mesh
from sharding.serving import engine_strategies

CFG = ModelConfig.tiny(max_seq_len=64, n_layers=2, compress_ratios=(0, 1), kv_source_layers=(1,),
                       index_source_layers=(1,), candidate_source_layer=1, n_routed_experts=8, vocab_size=256,
                       engram_layer_ids=())


def _kernel_calls(jaxpr, inside=False):
    """(kernel name, inside a shard_map) of every pallas_call in a jaxpr, nested ones included."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            out.append((wt.kernel_name(eqn), inside))
        for sub in wt.sub_jaxprs(eqn):
            out += _kernel_calls(sub, inside or eqn.primitive.name == "shard_map")
    return out


def test_mesh_decode_reads_each_weight_in_its_kernel_per_device():
    # the TPU kernels (interpreted on CPU), the FP8 block GEMM on as when they are compiled
    runtime = Runtime(mode="fast", impl="pallas", interpret=True, fp8_kernel=True)
    eng = Engine(random_model(CFG, seed=3), slots=4, min_capacity=64, prefill_chunk=8, runtime=runtime,
                 **engine_strategies(make_mesh("expert=4,tensor=2"), "inference"))
    tokens, active = jax.ShapeDtypeStruct((4, 1), jnp.int32), jax.ShapeDtypeStruct((4,), jnp.bool_)
    traced = eng.steps.decode.trace(eng.params, tokens, eng.cache, None, active, None).jaxpr
    uses = wt.uses_in(traced, eng.params)
    assert len(uses) > 10  # the dense FP8 linears and the expert stacks of both layers
    outside = [(u.name, u.dequantized[:1], u.relayout_bytes) for u in uses if u.dequantized or u.relayout_bytes]
    assert outside == [], f"weights dequantized or relaid out outside a kernel on every step: {outside[:4]}"
    assert all(u.kernels for u in uses if "embed" not in u.name), [u.name for u in uses if not u.kernels][:4]
    calls = _kernel_calls(traced.jaxpr)
    assert {name for name, _ in calls} >= {"fp8_block_gemm_tpu", "grouped_fp4_gemm_tpu", "sparse_sink_attention_tpu"}
    assert all(inside for _, inside in calls), sorted({name for name, inside in calls if not inside})
    kv = wt.kv_cache_uses(traced, len(jax.tree_util.tree_leaves(eng.params)) + 1, eng.cache)
    # the window rings of both layers, the compressed KV and index keys of the source (two arrays each at least)
    assert len(kv) >= 8 and all(u.kernels for u in kv), [u.name for u in kv if not u.kernels]
    copied = [(u.name, u.relayout_bytes) for u in kv if u.relayout_bytes]
    assert copied == [], f"KV caches relaid out for a kernel on every step: {copied[:4]}"
