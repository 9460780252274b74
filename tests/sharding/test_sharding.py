"""Sharding: meshes, rule tables, expert-parallel MoE, sharded Engram, the memory plan, multi-process.

The oracle for every distributed computation is the same computation on one device. Model
runs compare in exact mode (float64 dots rounded once), where the result does not depend on
how a sum is split across devices, so sharded and single-device logits must agree bit for bit
and every top-k / expert choice must be identical; any dispatch, reduction or layout mistake
shows up as a large difference.
"""
from __future__ import annotations

import itertools
import json
import os
import pathlib
import socket
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from dsv41_jax.config import ModelConfig
from dsv41_jax.layers.engram import Engram
from dsv41_jax.layers.moe import MoE
from dsv41_jax.model.transformer import Transformer, init_cache, make_step
from dsv41_jax.runtime import Runtime
from dsv41_jax.model.param_names import flat_params
from sharding import engram_shard, plan as plan_mod
from sharding.mesh import MeshSpecError, make_mesh, mesh_shape, parse_mesh_spec, resolve_mesh_shape
from sharding.moe_ep import ExpertParallelMoE, expert_parallel_moe
from sharding.rules import (ShardingRuleError, batch_sharding, cache_logical_axes, param_logical_axes, param_specs,
                            shard_cache, shard_params)
from sharding.step import make_sharded_step

REPO = pathlib.Path(__file__).resolve().parents[2]
EXACT = Runtime(mode="exact")

# 2 layers: SWA, then a ratio-1 Full layer (compressor, indexer, candidate pool) with Engram;
# every dim divides 8 so any 8-device mesh shards it.
MODEL_CFG = ModelConfig.tiny(
    n_routed_experts=8, n_heads=8, o_groups=4, index_n_heads=8, n_layers=2, compress_ratios=(0, 1),
    kv_source_layers=(1,), index_source_layers=(1,), candidate_source_layer=1, engram_layer_ids=(1,),
    max_seq_len=32, max_batch_size=8)
B, T = 8, 12

MESHES = [f"data={d},expert={e},tensor={t}" for d, e, t in itertools.product((1, 2, 4, 8), repeat=3) if d * e * t == 8]


# ------------------------------------------------------------------------------------- meshes
def test_parse_mesh_spec_and_errors():
    assert parse_mesh_spec("data=1,expert=4,tensor=2") == {"data": 1, "expert": 4, "tensor": 2}
    assert resolve_mesh_shape("data=-1,tensor=2", 8) == {"data": 4, "tensor": 2}
    for bad, msg in [("", "empty"), ("data", "axis=size"), ("data=x", "not an integer"), ("data=0", "positive"),
                     ("data=2,data=2", "twice"), ("data=-1,expert=-1", "at most one")]:
        with pytest.raises(MeshSpecError, match=msg):
            parse_mesh_spec(bad)
    with pytest.raises(MeshSpecError, match=r"needs 12 devices but 8 are available"):
        resolve_mesh_shape("expert=4,tensor=3", 8)


def test_make_mesh_uses_all_devices():
    mesh = make_mesh("data=2,expert=2,tensor=2")
    assert mesh_shape(mesh) == {"data": 2, "expert": 2, "tensor": 2}
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in jax.devices())
    assert mesh_shape(make_mesh("expert=4", devices=jax.devices()[:4])) == {"expert": 4}
    with pytest.raises(MeshSpecError, match="needs 16 devices"):
        make_mesh("expert=16")


# ------------------------------------------------------------------------------------- rules
def test_every_parameter_and_cache_entry_has_logical_axes():
    cfg = ModelConfig.tiny()  # every layer role, Engram on two layers
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=0))
    for path, var in flat_params(abstract).items():
        assert len(param_logical_axes(path, len(var.shape))) == len(var.shape)
    assert param_logical_axes(("layers", 3, "ffn", "experts", "w2_scale"))[0] == "expert"
    assert param_logical_axes(("layers", 3, "attn", "wq_b", "weight"))[0] == "heads"
    assert param_logical_axes(("layers", 3, "attn", "wo_a", "weight"))[0] == "o_groups"
    assert param_logical_axes(("embed",))[0] == "vocab"
    assert param_logical_axes(("layers", 1, "engram", "embed_scale"))[0] == "table_rows"
    with pytest.raises(ShardingRuleError, match="no logical axes"):
        param_logical_axes(("layers", 0, "attn", "new_thing", "weight"))
    cache = jax.eval_shape(lambda: init_cache(cfg, 2))
    for jax_path, leaf in jax.tree_util.tree_flatten_with_path(cache)[0]:
        key = getattr(jax_path[0], "key")
        assert len(cache_logical_axes((key,), leaf.ndim)) == leaf.ndim


def test_preset_specs():
    sizes = {"data": 2, "expert": 2, "tensor": 2}
    abstract = nnx.eval_shape(lambda: Transformer(MODEL_CFG, rngs=0))
    spec = {p: s for p, s in flat_params(param_specs(abstract, sizes, "inference")).items()}
    assert spec[("layers", 0, "ffn", "experts", "w1")] == P("expert")
    assert spec[("layers", 0, "ffn", "experts", "w1_scale")] == P("expert")
    assert spec[("layers", 0, "attn", "wq_b", "weight")] == P("tensor")
    assert spec[("layers", 0, "attn", "wo_b", "weight")] == P(None, "tensor")
    assert spec[("layers", 1, "attn", "indexer", "wq_b", "weight")] == P("tensor")
    assert spec[("layers", 1, "engram", "embed")] == P(("data", "expert", "tensor"))
    assert spec[("embed",)] == P("tensor")
    rep = {p: s for p, s in flat_params(param_specs(abstract, sizes, "inference-indexer-replicated")).items()}
    assert rep[("layers", 1, "attn", "indexer", "wq_b", "weight")] == P()
    train = {p: s for p, s in flat_params(param_specs(abstract, sizes, "training")).items()}
    assert train[("layers", 0, "ffn", "experts", "w1")] == P("expert", None, "data")  # EP + FSDP
    # FSDP over both batch axes; an expert weight's expert dimension already takes the expert axis
    assert train[("layers", 0, "attn", "wq_a", "weight")] == P(("data", "expert"))
    assert train[("layers", 0, "attn", "wo_a", "weight")] == P("tensor", "expert")
    # where the forward multiplies them, training's weights are whole over the FSDP axes (gathered), split
    # only as served; a looked-up table keeps its split; the serving presets' weights are used as stored
    compute = {p: s for p, s in flat_params(param_specs(abstract, sizes, "training", compute=True)).items()}
    assert compute[("layers", 0, "attn", "wq_b", "weight")] == P("tensor")
    assert compute[("layers", 1, "attn", "indexer", "wq_b", "weight")] == P("tensor")
    assert compute[("layers", 0, "attn", "wq_a", "weight")] == P()
    assert compute[("layers", 0, "attn", "wo_a", "weight")] == P("tensor")
    assert compute[("layers", 0, "ffn", "experts", "w1")] == P("expert")
    assert compute[("embed",)] == train[("embed",)] == P("tensor", ("data", "expert"))
    assert compute[("layers", 1, "engram", "embed")] == train[("layers", 1, "engram", "embed")]
    assert all(not {"data", "expert"} & set(jax.tree.leaves(tuple(s))) for p, s in compute.items()
               if p[-1] not in ("embed", "embed_scale") and "experts" not in p)
    for preset, stored in (("inference", spec), ("inference-indexer-replicated", rep)):
        assert {p: s for p, s in flat_params(param_specs(abstract, sizes, preset, compute=True)).items()} == stored


# ------------------------------------------------------------------------------ expert-parallel MoE
@pytest.fixture(scope="module")
def moe():
    cfg = ModelConfig.tiny(engram_layer_ids=(), n_routed_experts=8, n_activated_experts=2)
    return cfg, MoE(cfg, rngs=nnx.Rngs(0))


def _dense_moe(m, x, forced):
    """The unsharded MoE on its gate's choice, or on `forced` expert ids (a probe's decision)."""
    scores, _, own = m.route(x, "exact")
    return m.apply(x, scores, own if forced is None else forced, "exact")


@pytest.mark.parametrize("spec,dispatch", [("data=2,expert=4", "dense"), ("expert=8", "ragged-emulated"),
                                           pytest.param("expert=2,tensor=4", "dense", marks=pytest.mark.slow)])
def test_expert_parallel_moe_equals_dense(moe, spec, dispatch):
    cfg, m = moe
    mesh = make_mesh(spec)
    x = jax.random.normal(jax.random.key(1), (3, 5, cfg.dim)).astype(jnp.bfloat16)  # 15 rows: padded to 16
    # tokens whose experts all live on device 0 (experts 0 and 1), and experts nobody picks
    one_device = jnp.broadcast_to(jnp.array([0, 1], jnp.int32), (3, 5, 2))
    with jax.enable_x64(True):
        for forced in (None, one_device):
            ref, info = jax.jit(lambda x, f: _dense_moe(m, x, f))(x, forced)
            out, info_ep = jax.jit(lambda x, f: expert_parallel_moe(m, x, mesh, mode="exact", forced=f,
                                                                     dispatch=dispatch))(x, forced)
            np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
            np.testing.assert_array_equal(info_ep["experts"], info["experts"])
    assert set(np.unique(info["experts"])) == {0, 1}


def test_expert_parallel_moe_decode_row_computes_its_pairs_only(moe):
    """One token (decode at B=1) on expert=8: each device's receive buffer holds 8 owners x 1 slot, of which the
    whole mesh fills 2; only those 2 rows go through the experts' math (it gathers 2 rows' experts, not 8)."""
    import re

    cfg, m = moe
    mesh = make_mesh("expert=8")
    x = jax.random.normal(jax.random.key(4), (1, 1, cfg.dim)).astype(jnp.bfloat16)
    with jax.enable_x64(True):
        ref, _ = jax.jit(lambda x: _dense_moe(m, x, None))(x)
        run = jax.jit(lambda x: expert_parallel_moe(m, x, mesh, mode="exact", dispatch="dense"))
        out, _ = run(x)
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
        hlo = run.lower(x).as_text()
    _, f, d = m.experts.w1.get_value().shape
    gathered = {int(n) for n in re.findall(rf"gather.*-> tensor<(\d+)x1x{f}x{d}xui8>", hlo)}  # rows x [1, f, d]
    assert gathered == {2}, gathered



def test_expert_parallel_moe_grouped_path(moe):
    """Prefill-sized batches go through the grouped GEMM on each device (fast mode)."""
    cfg, m = moe
    mesh = make_mesh("data=2,expert=4")
    x = jax.random.normal(jax.random.key(2), (4, 40, cfg.dim)).astype(jnp.bfloat16)  # 320 pairs > 256
    ref, info = jax.jit(lambda x: m(x, "fast"))(x)
    out, info_ep = jax.jit(lambda x: expert_parallel_moe(m, x, mesh, mode="fast", dispatch="ragged-emulated"))(x)
    np.testing.assert_array_equal(info_ep["experts"], info["experts"])
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), atol=2e-2, rtol=2e-2)


@pytest.mark.slow  # 18 s here (two gradient compiles over 8 devices)
def test_expert_parallel_moe_in_chunks_equals_one_exchange(moe):
    """A device's rows through the exchange a few at a time (chunk_rows, under jax.checkpoint, as a
    training step runs them): the outputs and the rows' gradients are those of one exchange of all
    rows bit for bit, the gate's (bf16) to one bf16 rounding (measured: 1 of 1,024 elements). The experts' weight gradients are sums over the
    rows: with bf16 weights (the training model's views) each chunk's part is rounded to bf16 and the
    parts are added in bf16, the same kind of difference as the data axis's sum of per-device parts
    (measured: 0.82% of the largest element for 4 chunks, 1.04% for 7; one exchange on this mesh vs one
    device: 0.55%); a lost or repeated chunk moves them by tens of percent. 160 rows over 8 devices
    are 20 per device: 4 chunks of 5. Dense bf16 experts, as the training model's."""
    cfg, _ = moe
    m = MoE(cfg.replace(dtype="bf16", expert_dtype=None), rngs=nnx.Rngs(0))
    mesh = make_mesh("data=2,expert=4")
    x = jax.random.normal(jax.random.key(5), (4, 40, cfg.dim)).astype(jnp.bfloat16)  # 320 pairs: grouped path
    ct = jax.random.normal(jax.random.key(6), x.shape, jnp.float32)
    graphdef, state = nnx.split(m)

    def loss(state, x, chunk_rows):
        ep = ExpertParallelMoE(nnx.merge(graphdef, state), mesh, dispatch="dense", chunk_rows=chunk_rows)
        y, _ = ep(x, "fast")
        return jnp.sum(y.astype(jnp.float32) * ct), y

    (_, y1), (g1, dx1) = jax.jit(jax.value_and_grad(lambda s, x: loss(s, x, None), (0, 1), has_aux=True))(state, x)
    (_, y2), (g2, dx2) = jax.jit(jax.value_and_grad(lambda s, x: loss(s, x, 5), (0, 1), has_aux=True))(state, x)
    np.testing.assert_array_equal(np.asarray(y2, np.float32), np.asarray(y1, np.float32))
    np.testing.assert_array_equal(np.asarray(dx2, np.float32), np.asarray(dx1, np.float32))
    assert float(jnp.max(jnp.abs(dx1.astype(jnp.float32)))) > 0
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g1), jax.tree.leaves(g2)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        if "experts" in jax.tree_util.keystr(path) and "shared" not in jax.tree_util.keystr(path):
            assert np.abs(a).max() > 0, path
            np.testing.assert_allclose(b, a, rtol=0, atol=2**-6 * np.abs(a).max(), err_msg=jax.tree_util.keystr(path))
        else:
            np.testing.assert_allclose(b, a, rtol=2**-7, atol=0, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("words", [False, True])
def test_expert_parallel_moe_with_the_fp4_kernel_equals_the_unsharded_kernel(moe, words):
    """impl "pallas": each device runs the FP4 expert kernel (interpreted) on the rows it receives, on its own
    experts' stacks (the stored bytes, or the word views `kernel_params` makes, split over the expert axis)."""
    from pallas_kernels.expert_gemm import layout

    cfg, m = moe
    if words:
        m = nnx.merge(*nnx.split(m))  # a copy: the fixture keeps its bytes
        for w, s in ((m.experts.w1, m.experts.w1_scale), (m.experts.w2, m.experts.w2_scale),
                     (m.experts.w3, m.experts.w3_scale)):
            ww, sw = layout.fp4_weight_words(w.get_value(), s.get_value())
            w.set_value(ww)
            s.set_value(sw)
    mesh = make_mesh("data=2,expert=4")
    x = jax.random.normal(jax.random.key(3), (3, 5, cfg.dim)).astype(jnp.bfloat16)

    def unsharded(x):
        scores, _, experts = m.route(x, "fast")
        return m.apply(x, scores, experts, "fast", impl="pallas", interpret=True)

    ref, info = jax.jit(unsharded)(x)
    graphdef, state = nnx.split(m)
    on_mesh = lambda spec: jax.sharding.NamedSharding(mesh, spec)  # noqa: E731
    state = jax.tree_util.tree_map_with_path(
        lambda path, a: jax.device_put(a, on_mesh(P("expert") if getattr(path[0], "key", None) == "experts" else P())), state)

    def sharded(state, x):
        ep = ExpertParallelMoE(nnx.merge(graphdef, state), mesh, dispatch="dense")
        scores, _, experts = ep.route(x, "fast")
        return ep.apply(x, scores, experts, "fast", impl="pallas", interpret=True)

    out, info_ep = jax.jit(sharded)(state, x)
    np.testing.assert_array_equal(info_ep["experts"], info["experts"])
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
    assert float(jnp.max(jnp.abs(out.astype(jnp.float32)))) > 0
    if words:  # each device holds a quarter of the experts' words
        w1 = state["experts"]["w1"].get_value()
        assert w1.dtype == jnp.int32 and w1.addressable_shards[0].data.shape[0] == cfg.n_routed_experts // 4


def test_expert_parallel_moe_rejects_uneven_split(moe):
    cfg, m = moe
    mesh = make_mesh("expert=8", devices=jax.devices()[:8])
    small = nnx.eval_shape(lambda: MoE(cfg.replace(n_routed_experts=12), rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match="cannot be split evenly"):
        expert_parallel_moe(small, jnp.zeros((1, 2, cfg.dim), jnp.bfloat16), mesh)
    with pytest.raises(ValueError, match="dispatch must be"):
        expert_parallel_moe(m, jnp.zeros((1, 2, cfg.dim), jnp.bfloat16), mesh, dispatch="magic")


# ------------------------------------------------------------------------------ attention / indexer
def test_indexer_heads_sharded_select_the_same_topk():
    """Index heads split over 8 devices: the partitioner all-reduces the per-head scores, so every
    shard (and the single-device run) picks the same positions."""
    from dsv41_jax.layers.indexer import Indexer, select_topk
    from dsv41_jax.layers.rope import cos_sin, layer_rope

    cfg = MODEL_CFG
    ix = Indexer(cfg, True, rngs=nnx.Rngs(3))
    graphdef, state = nnx.split(ix)
    k = jax.random.split(jax.random.key(4), 3)
    x = jax.random.normal(k[0], (2, 6, cfg.dim)).astype(jnp.bfloat16)
    qr = jax.random.normal(k[1], (2, 6, cfg.q_lora_rank)).astype(jnp.bfloat16)
    keys = jax.random.normal(k[2], (2, 24, cfg.index_head_dim)).astype(jnp.bfloat16)
    pos = jnp.arange(6)[None] + jnp.array([[10], [18]])
    cos, sin = cos_sin(pos, layer_rope(cfg, 1))
    visible = pos + 1

    def topk(state, x, qr):
        s = nnx.merge(graphdef, state).scores(x, qr, keys, cos, sin, visible, "exact")
        return select_topk(s, visible, cfg.index_topk), s

    mesh = make_mesh("tensor=8")
    heads = jax.sharding.NamedSharding(mesh, P("tensor"))  # what the inference preset gives index heads
    sharded = jax.tree_util.tree_map_with_path(
        lambda path, a: jax.device_put(a, heads) if any(getattr(k, "key", None) in ("wq_b", "weights_proj") for k in path)
        else a, state)
    with jax.enable_x64(True):
        ref_idx, ref_s = jax.jit(topk)(state, x, qr)
        fn = jax.jit(topk)
        idx, s = fn(sharded, x, qr)
        hlo = fn.lower(sharded, x, qr).compile().as_text()
    assert "all-reduce" in hlo
    np.testing.assert_array_equal(idx, ref_idx)
    np.testing.assert_array_equal(s, ref_s)


# ------------------------------------------------------------------------------ Engram
def test_row_sharded_engram_lookup_equals_unsharded():
    cfg = MODEL_CFG
    e = Engram(cfg, 3688, rngs=nnx.Rngs(5))  # 3688 = 8 * 461 rows
    mesh = make_mesh("data=2,expert=2,tensor=2")
    axes = engram_shard.table_axes(mesh)
    assert axes == ("data", "expert", "tensor")
    ids = jax.random.randint(jax.random.key(6), (2, 5, 6), 0, 3688)
    ids = ids.at[0, 0].set(jnp.array([0, 460, 461, 3687, 1844, 2000]))  # shard edges
    table = jax.device_put(e.embed[...], jax.sharding.NamedSharding(mesh, P(axes)))
    scale = jax.device_put(e.embed_scale[...], jax.sharding.NamedSharding(mesh, P(axes)))
    got = jax.jit(lambda t, s, i: engram_shard.sharded_lookup(t, s, i, mesh, axes))(table, scale, ids)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(e.lookup(ids), np.float32))
    with pytest.raises(ValueError, match="pad it"):
        engram_shard.sharded_lookup(e.embed[...][:3687], e.embed_scale[...][:3687], ids, mesh, axes)
    padded = engram_shard.pad_tables({"layers": {1: {"engram": {"embed": e.embed[...][:3687]}}}}, 8)
    assert padded["layers"][1]["engram"]["embed"].shape[0] == 3688


@pytest.mark.parametrize("storage", ["numpy", "pinned_host"])
def test_host_tables_prefetch_equals_full_table(storage):
    if storage == "pinned_host" and not engram_shard.supports_pinned_host():
        pytest.skip("no pinned_host memory space on this backend")
    cfg = MODEL_CFG
    e = Engram(cfg, 3688, rngs=nnx.Rngs(7))
    tables = {1: (np.asarray(e.embed[...]), np.asarray(e.embed_scale[...]))}
    host = engram_shard.HostEngramTables(tables, storage=storage)
    ids = np.random.default_rng(8).integers(0, 3688, (2, 4, 1, 6)).astype(np.int64)
    ids[1, 3, 0] = ids[0, 0, 0]  # repeated rows are fetched once
    compact, remapped = host.prefetch(ids)
    assert compact[1][0].shape == (2 * 4 * 6, cfg.engram_head_dim)
    params = {"layers": {1: {"engram": {"embed": e.embed[...], "embed_scale": e.embed_scale[...]}}}}
    swapped = engram_shard.compact_params(params, compact)["layers"][1]["engram"]
    graphdef, state = nnx.split(e)
    e_compact = nnx.merge(graphdef, state)
    e_compact.embed, e_compact.embed_scale = nnx.Param(swapped["embed"]), nnx.Param(swapped["embed_scale"])
    h = jax.random.normal(jax.random.key(9), (2, 4, cfg.hc_mult, cfg.dim)).astype(jnp.bfloat16)
    want, _ = e(h, jnp.asarray(ids[:, :, 0].astype(np.int32)), "fast")
    got, _ = e_compact(h, remapped[:, :, 0], "fast")
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


# ------------------------------------------------------------------------------ whole model
@pytest.fixture(scope="module")
def tiny_model():
    """The tiny model, its tokens and Engram ids."""
    model = Transformer(MODEL_CFG, rngs=0)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, MODEL_CFG.vocab_size, (B, T + 1)), jnp.int32)
    rows = model.layers[1].engram.embed.shape[0]
    ids = jnp.asarray(rng.integers(0, rows, (B, T + 1, 1, 6)), jnp.int32)
    return model, tokens, ids


@pytest.fixture(scope="module")
def exact_step(tiny_model):
    """One jitted single-device step: the slow tests' prefill reuses the default test's program."""
    return make_step(nnx.split(tiny_model[0])[0], EXACT)


def _reference(tiny_model, step, decode: bool):
    model, tokens, ids = tiny_model
    with jax.enable_x64(True):
        ref = _prefill_decode(step, nnx.split(model)[1], init_cache(MODEL_CFG, B), tokens, ids, decode=decode)
    return model, tokens, ids, ref


@pytest.fixture(scope="module")
def reference_prefill(tiny_model, exact_step):
    """The single-device exact-mode prefill (the oracle of the default suite's sharded check)."""
    return _reference(tiny_model, exact_step, decode=False)


@pytest.fixture(scope="module")
def model_and_reference(tiny_model, exact_step):
    """The single-device exact-mode prefill + decode (the oracle)."""
    return _reference(tiny_model, exact_step, decode=True)


def _prefill_decode(step, params, cache, tokens, ids, place=lambda a: a, decode=True):
    """[(logits, top-k, experts)] of the prefill of T tokens and, with `decode`, of one decode step."""
    out = []
    for part in (slice(None, T), slice(T, None))[:1 + decode]:
        logits, cache, aux = step(params, place(tokens[:, part]), cache, place(ids[:, part]))
        out.append((np.asarray(logits), {l: np.asarray(v) for l, v in aux["topk"].items()},
                    {l: np.asarray(v) for l, v in aux["experts"].items()}))
    return out


def _check_sharded(model_and_reference, spec, preset):
    model, tokens, ids, ref = model_and_reference
    mesh = make_mesh(spec)
    params = shard_params(model, mesh, preset)
    cache = shard_cache(init_cache(MODEL_CFG, B), mesh, preset)
    with jax.enable_x64(True):
        got = _prefill_decode(make_sharded_step(model, mesh, preset, EXACT), params, cache, tokens, ids,
                              lambda a: jax.device_put(a, batch_sharding(mesh, a.shape, preset)), decode=len(ref) > 1)
    assert len(got) == len(ref)
    for (lg, topk, experts), (rlg, rtopk, rexperts) in zip(got, ref):
        np.testing.assert_allclose(lg, rlg, rtol=1e-6, atol=1e-6)
        assert topk.keys() == rtopk.keys() and all(np.array_equal(topk[l], rtopk[l]) for l in topk)
        assert all(np.array_equal(experts[l], rexperts[l]) for l in experts)


def test_sharded_prefill_equal_single_device(reference_prefill):
    """data x expert x tensor = 2x2x2: EP MoE, tensor-parallel heads and indexer, row-sharded Engram.
    The default suite's share: the prefill (a decode step's program is another ~25 s of compiling on 2
    cores; the sharded decode runs here with -m slow, on every mesh, and in the default suite through the
    engine on a mesh, tests/http/test_serve_mesh.py)."""
    _check_sharded(reference_prefill, "data=2,expert=2,tensor=2", "inference")


# prefill + decode on every 8-device mesh with the inference preset; FSDP (training) where there is a data
# axis; the replicated indexer where there is a tensor axis to replicate it over
SLOW_CASES = ([(m, "inference") for m in MESHES]
              + [(m, "training") for m in MESHES if not m.startswith("data=1,")]
              + [("data=1,expert=1,tensor=8", "inference-indexer-replicated"),
                 ("data=2,expert=2,tensor=2", "inference-indexer-replicated")])


@pytest.mark.slow
@pytest.mark.parametrize("spec,preset", SLOW_CASES)
def test_sharded_prefill_decode_every_mesh(model_and_reference, spec, preset):
    _check_sharded(model_and_reference, spec, preset)


# ------------------------------------------------------------------------------ plan
def test_plan_matches_placed_bytes(tiny_model):
    """The plan's per-device arithmetic equals the bytes JAX actually places on each device."""
    model = tiny_model[0]
    for spec, preset in [("data=2,expert=2,tensor=2", "inference"), ("data=4,expert=2,tensor=1", "training")]:
        mesh = make_mesh(spec)
        placed = shard_params(model, mesh, preset)
        per_dev = {}
        for leaf in jax.tree.leaves(placed):
            for shard in leaf.addressable_shards:
                per_dev[shard.device.id] = per_dev.get(shard.device.id, 0) + shard.data.nbytes
        w = plan_mod.weight_bytes(MODEL_CFG, mesh_shape(mesh), preset)
        assert set(per_dev.values()) == {sum(w["per_device"].values())}
        cache = shard_cache(init_cache(MODEL_CFG, B), mesh, preset)
        cache_dev = sum(s.data.nbytes for leaf in jax.tree.leaves(cache) for s in leaf.addressable_shards
                        if s.device.id == 0)
        assert cache_dev == plan_mod.cache_bytes(MODEL_CFG, mesh_shape(mesh), preset, B)["per_device"]


@pytest.mark.parametrize("spec,experts", [("data=1,expert=16,tensor=4", 16), ("data=1,expert=8,tensor=1", 8),
                                          ("data=2,expert=32,tensor=1", 32)])
def test_plan_full_model_covers_and_splits_experts(spec, experts):
    cfg = ModelConfig.v41_flash()
    p = plan_mod.build_plan(cfg, spec, batch=64, context=65536, device="v5p")
    n, here, whole = p["devices"], p["per_device_bytes"], p["global_bytes"]
    assert here["routed_experts"] * n >= whole["routed_experts"]
    assert here["other_weights"] * n >= whole["other_weights"]
    assert here["engram"] * n >= whole["engram_tables"]
    assert here["cache"] * n >= whole["cache"]
    assert abs(here["routed_experts"] / (whole["routed_experts"] / experts) - 1) < 0.10
    # the Engram rows are split over every device
    assert abs(here["engram"] * n / whole["engram_tables"] - 1) < 1e-6


def test_plan_without_expert_axis_replicates_experts():
    """The 1/E check can fail: a tensor-only mesh leaves every expert on every device."""
    p = plan_mod.build_plan(ModelConfig.v41_flash(), "tensor=8", batch=8, context=4096)
    assert p["per_device_bytes"]["routed_experts"] == p["global_bytes"]["routed_experts"]


def test_plan_cli_with_compile(capsys):
    from dsv41_jax.cli.main import main

    rc = main(["plan", "--config", "tiny", "--mesh", "data=2,expert=2,tensor=2", "--batch", "4", "--context", "64",
               "--device", "v6e", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["fits"] and out["compile"]["ok"], out.get("compile")
    assert out["compile"]["collectives"].get("all-to-all", 0) > 0  # the EP dispatch is in the program
    assert out["per_device_bytes"]["total"] == sum(out["per_device_bytes"][k] for k in
                                                   ("weights", "engram", "cache", "activations"))
    assert main(["plan", "--config", "tiny", "--mesh", "expert=3,tensor=0", "--no-compile"]) == 2
    assert "positive" in capsys.readouterr().err


def test_plan_context_defaults_to_the_checkpoint_limit(tmp_path, capsys):
    """Without --context the plan (and the serve command it prints) stays within the config's max_seq_len: a
    checkpoint exported for 8192 tokens is not told to serve --max-model-len 65536."""
    from dsv41_jax.cli.main import main
    from dsv41_jax.config import ModelConfig

    path = tmp_path / "config.json"
    path.write_text(json.dumps(ModelConfig.tiny(max_seq_len=8192).to_hf_dict()))
    assert main(["plan", "--config", str(path), "--mesh", "data=1", "--no-compile", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["context"] == 8192 and "--max-model-len 8192 " in out["serve_command"]
    assert main(["plan", "--config", str(path), "--mesh", "data=1", "--no-compile", "--json", "--context", "64"]) == 0
    assert json.loads(capsys.readouterr().out)["context"] == 64


def test_one_layer_config_is_valid_for_the_release():
    from sharding.layer_compile import one_layer_config

    c = one_layer_config(ModelConfig.v41_flash(), batch=4, context=65536, engram_rows=384016688)
    assert c.n_layers == 1 and c.roles[0].kind == "full" and c.roles[0].is_candidate_source and c.roles[0].has_engram


# ------------------------------------------------------------------------------ multi-process
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_distributed_on_loopback():
    """Two processes x 2 CPU devices join one 4-device mesh; the EP MoE all-to-all crosses processes."""
    port = _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=2",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = [subprocess.Popen([sys.executable, "-m", "sharding.multihost_check", "--coordinator", f"127.0.0.1:{port}",
                               "--num-processes", "2", "--process-id", str(i)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sorted(r["process"] for r in results) == [0, 1]
    assert all(r["ok"] and r["devices"] == 4 and r["local_devices"] == 2 for r in results)


def _runs_config() -> ModelConfig:
    """SWA x2, Full r2 (the KV and index source), Reuse r2 x3: two runs, (0, 1) and (3, 4, 5)."""
    return ModelConfig.tiny(n_layers=6, compress_ratios=(0, 0, 2, 2, 2, 2), kv_source_layers=(2,),
                            index_source_layers=(2,), candidate_source_layer=-1, engram_layer_ids=(),
                            n_routed_experts=8, max_seq_len=32)


def test_stacked_runs_split_like_their_layers():
    """The engine's stacked runs (`stack_layers`) on a mesh: each stacked parameter is split like
    one layer's, its layer axis whole; the expert-parallel MoE goes on a stack's Block once, and
    every layer of the run sees it."""
    from dsv41_jax.model import block as body
    from dsv41_jax.model.stack import LayerStack
    from dsv41_jax.model.transformer import stack_layers
    from sharding.step import distribute

    cfg = _runs_config()
    gd, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=0)))
    sgd, stacked = stack_layers(gd, state, body.Plan.resolve(Runtime()))
    sizes = {"expert": 4, "tensor": 2}
    per_layer, held = nnx.to_flat_state(param_specs(state, sizes)), dict(nnx.to_flat_state(param_specs(stacked, sizes)))
    assert {p[:3] for p in held if p[2:3] == ("stacked",)} == {("layers", 0, "stacked"), ("layers", 3, "stacked")}
    for path, spec in per_layer:
        if path[:2] in (("layers", 0), ("layers", 3)):
            assert held[(*path[:2], "stacked", *path[2:])] == P(None, *spec), path
        elif path[:2] not in (("layers", 1), ("layers", 4), ("layers", 5)):
            assert held[path] == spec, path
    assert any(s[1:] for s in held.values() if s and s[0] is None)  # splits the stacks keep
    model = distribute(nnx.merge(sgd, stacked), make_mesh("expert=4,tensor=2"))
    for run in ((0, 1), (3, 4, 5)):
        held_run = model.layers[run[0]]
        assert isinstance(held_run, LayerStack) and held_run.run == run
        assert all(model.layers[l] is held_run for l in run)
        assert isinstance(held_run.stacked.ffn, ExpertParallelMoE)
    assert isinstance(model.layers[2].ffn, ExpertParallelMoE)


@pytest.mark.slow
def test_stacked_runs_on_a_mesh_equal_one_device():
    """A prefill and a decode step over the stacked runs, placed by the preset on expert=4,tensor=2
    (`param_shardings` of the stacked tree), the runs' window rings held stacked too (`RingStack`,
    split like one layer's ring), equal the per-layer model on one device bit for bit (exact
    numerics): logits and cache (one ring per layer again)."""
    from dsv41_jax.model import block as body
    from dsv41_jax.model.cache import RingStack, cache_form
    from dsv41_jax.model.stack import held_runs
    from dsv41_jax.model.transformer import stack_layers
    from sharding.rules import param_shardings

    cfg = _runs_config()
    with jax.enable_x64(True):
        gd, state = nnx.split(Transformer(cfg, rngs=0))
        sgd, stacked = stack_layers(gd, state, body.Plan.resolve(EXACT))
        mesh = make_mesh("expert=4,tensor=2")
        step = make_sharded_step(nnx.merge(sgd, stacked), mesh, "inference", EXACT)
        params = jax.device_put(stacked, param_shardings(stacked, mesh))
        one = make_step(gd, EXACT)
        tokens = jnp.asarray(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 6)), jnp.int32)
        runs = held_runs(nnx.merge(sgd, stacked))
        cache, ref = shard_cache(init_cache(cfg, 2, runs=runs), mesh), init_cache(cfg, 2)
        assert runs and all(isinstance(cache["window"][run[0]], RingStack) for run in runs)
        for t in (tokens, tokens[:, :1]):
            logits, cache, _ = step(params, t, cache)
            want, ref, _ = one(state, t, ref)
            np.testing.assert_array_equal(np.asarray(logits), np.asarray(want))
            for a, b in zip(jax.tree.leaves(cache_form(cache, False)), jax.tree.leaves(ref)):
                np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
