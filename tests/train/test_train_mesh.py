"""Training on 8 fake CPU devices: a sharded step equals the single-device step, and a
checkpoint saved on one mesh layout restores onto another and continues the same run."""
from __future__ import annotations

import jax
import numpy as np
import pytest

from dsv41_jax.train.checkpoint import Checkpointer
from dsv41_jax.train.loop import prepare, train
from dsv41_jax.train.optim import OptimConfig
from dsv41_jax.train.step import TrainConfig

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


@pytest.mark.slow
def test_sharded_step_equals_single_device_step():
    assert jax.device_count() == 8, "conftest sets 8 fake CPU devices"
    cfg, data = micro_config(T), packed_data(T, 8)
    single = prepare(cfg, TCFG, mesh_spec="data=1")
    before = jax.device_get(single.state)
    sharded = prepare(cfg, TCFG, mesh_spec="data=2,tensor=4")
    assert _sharded_over(sharded.state, "tensor") and len(sharded.state["master"]["embed"].sharding.device_set) == 8
    h1 = train(single, data, progress=False, log_every=0)
    h8 = train(sharded, data, progress=False, log_every=0)
    for a, b in zip(h1, h8):
        for k in ("loss", "ce", "balance", "indexer_kl"):
            np.testing.assert_allclose(a[k], b[k], rtol=1e-5, err_msg=k)
        # a reordered fp32 sum occasionally rounds a bf16 activation the other way
        np.testing.assert_allclose(a["grad_norm"], b["grad_norm"], rtol=1e-4)
    _assert_same_updates(before, single.state, sharded.state)


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
    np.testing.assert_allclose(ha[-1]["loss"], hb[-1]["loss"], rtol=1e-5)
    _assert_same_updates(before, a.state, b.state)
