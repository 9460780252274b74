"""Training on 8 fake CPU devices: a sharded step (tensor-parallel, expert-parallel) equals the
single-device step, and a checkpoint saved on one mesh layout restores onto another and continues
the same run."""
from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from dsv41_jax.model.stack import blocks
from dsv41_jax.train import mesh as meshlib
from dsv41_jax.train.checkpoint import Checkpointer
from dsv41_jax.train.loop import prepare, train
from dsv41_jax.train.optim import OptimConfig
from dsv41_jax.train.params import flatten_state, merge_model, serving_formats, serving_graph
from dsv41_jax.train.qat_modules import build_training_model
from dsv41_jax.train.step import TrainConfig
from sharding import rules
from sharding.moe_ep import ExpertParallelMoE

from tests.support.train_fixtures import micro_config, packed_data

T = 32
# Adam's eps is raised from 1e-8: for near-zero gradients m/(sqrt(v)+eps) is ~sign(g), which
# turns last-bit differences of the reduction order into lr-sized parameter differences; with
# eps = 1e-4 the update is a smooth function of the gradient, so fp32 tolerances apply.
TCFG = TrainConfig(seq_len=T, batch_size=8, steps=2, seed=0, fast_compile=True,
                   optim=OptimConfig(lr=3e-3, warmup_steps=1, total_steps=10, weight_decay=0.01, eps=1e-4))


def _assert_same_updates(before, a, b, tol=1e-2):
    """The parameter updates of two runs (a - before, b - before) agree to `tol` in relative L2
    over all masters together. Why not tighter or elementwise: activations and most backward
    cotangents are bf16 (2^-8 relative), and a reordered fp32 sum rounds some of them the
    other way: the gradients of two layouts differ by ~2e-3 relative, evenly over tensors
    (measured), and small cancelling gradients (e.g. an mHC scale's) by percents. A wrong
    reduction or a lost shard gives O(1) differences."""
    before, a, b = (jax.device_get(s) for s in (before, a, b))
    num = den = 0.0
    for group in ("master", "bias"):
        for k in before[group]:
            da = np.asarray(a[group][k], np.float64) - np.asarray(before[group][k], np.float64)
            db = np.asarray(b[group][k], np.float64) - np.asarray(before[group][k], np.float64)
            n, d = np.sum((da - db) ** 2), np.sum(da ** 2)
            num, den = num + n, den + d
    assert den > 0 and np.sqrt(num / den) < tol, np.sqrt(num / den)


def _sharded_over(state, axis: str) -> bool:
    return any(axis in str(v.sharding.spec) for v in state["master"].values())


# On data=2,tensor=4 the partitioner splits fp32 contractions over the tensor axis even where no
# parameter is split over it: the mHC mixes (x [.., hc*dim] @ fn.T, an f32 all-reduce over tensor).
# Another fp32 order there moves the step's metrics far more than a last bit: the mixes go through
# the Sinkhorn normalisations, then bf16 and FP8 (QAT) roundings and the indexer's top-k. Measured
# (2026-12-04): one device with only that contraction summed as 4 (2) partial dots gives loss 3.5e-5
# (3.6e-5) relative, as the mesh does; mesh vs one device: loss 3.5e-5 / 9.1e-5, ce 2.7e-5 / 3.0e-5,
# indexer_kl 1.4e-4 / 8.2e-4, balance 2.7e-6 / 2.4e-6, grad_norm 9.5e-5 / 5.4e-5 (steps 1 / 2).
# A lost shard or wrong rows move the loss by ~1e-2. data=8 and data=2,expert=4 split no contraction.
SPLIT_RTOL = {"loss": 3e-4, "ce": 3e-4, "balance": 1e-5, "indexer_kl": 3e-3, "grad_norm": 3e-4}


def _single_vs_mesh(spec: str, axis: str, rtol: dict | None = None):
    """Two steps on one device and on `spec` (laid out over `axis`) from the same init: the same
    metrics within fp32 tolerance and the same parameter updates (`_assert_same_updates`)."""
    assert jax.device_count() == 8, "conftest sets 8 fake CPU devices"
    cfg, data = micro_config(T), packed_data(T, 8)
    single = prepare(cfg, TCFG, mesh_spec="data=1")
    before = jax.device_get(single.state)
    sharded = prepare(cfg, TCFG, mesh_spec=spec)
    assert _sharded_over(sharded.state, axis) and len(sharded.state["master"]["embed"].sharding.device_set) == 8
    h1 = train(single, data, progress=False, log_every=0)
    h8 = train(sharded, data, progress=False, log_every=0)
    rel = [{k: f"{abs(b[k] - a[k]) / abs(a[k]):.1e}" for k in ("loss", "ce", "balance", "indexer_kl", "grad_norm")}
           for a, b in zip(h1, h8)]
    print(f"{spec} vs one device, relative per step:", rel)
    for a, b in zip(h1, h8):
        for k in ("loss", "ce", "balance", "indexer_kl"):
            np.testing.assert_allclose(a[k], b[k], rtol=(rtol or {}).get(k, 1e-5), err_msg=k)
        # a reordered fp32 sum occasionally rounds a bf16 activation the other way
        np.testing.assert_allclose(a["grad_norm"], b["grad_norm"], rtol=(rtol or {}).get("grad_norm", 1e-4))
    _assert_same_updates(before, single.state, sharded.state)


@pytest.mark.slow
def test_sharded_step_equals_single_device_step():
    _single_vs_mesh("data=2,tensor=4", "tensor", rtol=SPLIT_RTOL)


@pytest.mark.slow
def test_expert_parallel_step_equals_single_device_step():
    """The MoE runs expert-parallel on an expert axis (`train.mesh.step_graph`: each device its own
    experts, the routed rows exchanged; its backward sends the rows' cotangents back the same way)."""
    _single_vs_mesh("data=2,expert=4", "expert")


@pytest.mark.slow
def test_restore_onto_a_different_mesh(tmp_path):
    """Saved on data=8 (FSDP-style), restored on data=2 x tensor=4: the next step agrees
    within fp32 tolerance with the uninterrupted run, and the state has the new layout."""
    cfg, data = micro_config(T), packed_data(T, 8)
    ck = Checkpointer(tmp_path / "ck")
    a = prepare(cfg, TCFG, mesh_spec="data=8", checkpointer=ck)
    train(a, data, steps=1, checkpointer=ck, progress=False, log_every=0)
    before = jax.device_get(a.state)
    ha = train(a, data, steps=2, progress=False, log_every=0)

    b = prepare(cfg, TCFG, mesh_spec="data=2,tensor=4", checkpointer=Checkpointer(tmp_path / "ck"), restore_step=1)
    assert b.step == 1 and _sharded_over(b.state, "tensor")
    assert all(tuple(v.sharding.mesh.shape.values()) == (2, 4) for v in b.state["master"].values())
    hb = train(b, data, steps=2, progress=False, log_every=0)
    np.testing.assert_allclose(ha[-1]["loss"], hb[-1]["loss"], rtol=SPLIT_RTOL["loss"])  # measured 9.1e-5
    _assert_same_updates(before, a.state, b.state)


def test_step_graph_runs_the_moe_expert_parallel_on_an_expert_axis():
    """On a mesh with an expert axis the step's MoE layers are serving's expert-parallel ones, with the
    same parameter paths; without one the graph is the plain model's."""
    cfg = micro_config(T)
    formats = serving_formats(cfg, serving_graph(cfg)[1])
    graphdef, shapes = build_training_model(cfg, formats, abstract=True)
    assert meshlib.step_graph(graphdef, shapes, meshlib.make_mesh("data=2,tensor=4")) is graphdef
    ep = meshlib.step_graph(graphdef, shapes, meshlib.make_mesh("data=2,expert=4"))
    model = merge_model(ep, shapes)
    assert all(isinstance(b.ffn, ExpertParallelMoE) and b.ffn.mesh.shape["expert"] == 4 for b in blocks(model))
    assert set(flatten_state(model)) == set(shapes)


def test_a_layers_weights_are_whole_over_the_fsdp_axes_where_it_runs():
    """`layer_layout` (what the training forward applies to each layer inside its checkpoint): a
    product's weight, stored split over data x expert, is gathered whole over them (split over tensor
    as served); the experts keep their expert split, the Engram table its rows' split; values
    unchanged; on one device there is no layout."""
    cfg = micro_config(T)
    formats = serving_formats(cfg, serving_graph(cfg)[1])
    graphdef, shapes = build_training_model(cfg, formats, abstract=True)
    rng = np.random.default_rng(0)
    master = {k: rng.standard_normal(a.shape).astype(a.dtype) for k, a in shapes.items()}
    block = merge_model(graphdef, master).layers[1]  # attention with indexer, MoE, Engram
    gd, state = nnx.split(block)
    mesh = meshlib.make_mesh("data=2,expert=2,tensor=2")
    stored = rules.param_shardings(state, mesh, "training")
    out = jax.jit(lambda st: nnx.split(meshlib.layer_layout(mesh)(nnx.merge(gd, st)))[1],
                  in_shardings=(stored,))(jax.device_put(state, stored))
    specs = {".".join(map(str, p)): v.get_value().sharding.spec for p, v in nnx.to_flat_state(out)}
    was = {".".join(map(str, p)): v.get_value().sharding.spec for p, v in nnx.to_flat_state(jax.device_put(state, stored))}
    assert was["attn.wq_b.weight"] == P("tensor", ("data", "expert")) and specs["attn.wq_b.weight"] == P("tensor")
    assert was["attn.wq_a.weight"] == P(("data", "expert")) and specs["attn.wq_a.weight"] == P()
    assert specs["ffn.experts.w1"] == P("expert") and specs["engram.embed"] == was["engram.embed"]
    for (_, a), (_, b) in zip(nnx.to_flat_state(out), nnx.to_flat_state(state)):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()))
    assert meshlib.layer_layout(meshlib.make_mesh("data=1")) is None and meshlib.layer_layout(None) is None
    # where the views are made (outside the checkpoints) they stay as stored: each layer gathers its own
    keys = ("layers.1.attn.wq_b.weight", "layers.1.ffn.experts.w1")
    pinned = jax.jit(lambda v: meshlib.stored_layout(mesh, v))({k: master[k] for k in keys})
    assert [pinned[k].sharding.spec for k in keys] == [P("tensor", ("data", "expert")), P("expert", None, "data")]
    assert meshlib.stored_layout(meshlib.make_mesh("data=1"), master) is master
