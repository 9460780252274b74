"""The QAT training step compiled by XLA:TPU for a TPU slice, from a machine without a TPU
(`dsv41 compile --what train`).

The step is `dsv41 train`'s own (`train.step.make_train_step`: fake-quantized forward, loss,
gradients, optimizer update) on the training mesh's layout (`train.mesh.state_shardings`: the
`training` preset's rules, FSDP over `data` and `expert`, experts over `expert`), with abstract state (fp32
masters and the optimizer's moments, `jax.eval_shape`) and an abstract packed batch of `batch` rows
of `seq_len` tokens; nothing is allocated. The figures are the compiler's, not measurements on a TPU.

The Engram tables' rows are padded to a multiple of their shards, as the served layout pads them
(`sharding.layer_compile`): the released tables' row counts (384,006,168 and 384,016,682) do not
divide 64 devices, and the training rules would otherwise split the first over `data` only and
replicate the second (a 366 GiB fp32 master, and its two moments, on every chip).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.config import ModelConfig
from dsv41_jax.train import mesh as meshlib
from dsv41_jax.train.params import serving_formats, serving_graph
from dsv41_jax.train.qat_modules import build_training_model
from dsv41_jax.train.step import TrainConfig, init_state, make_train_step
from dsv41_jax.model.transformer import engram_table_rows
from sharding.plan import table_shards
from sharding.tpu_step import compile_report, slice_mesh


def compile_train(cfg: ModelConfig, topology: str, mesh_spec, *, batch: int, seq_len: int, impl: str = "xla") -> dict:
    """Compile one QAT training step for the slice: `sharding.tpu_step.compile_report`'s report."""
    topo, mesh = slice_mesh(topology, mesh_spec)
    meshlib.check_batch(mesh, batch)
    tcfg = TrainConfig(seq_len=seq_len, batch_size=batch, impl=impl)
    formats = serving_formats(cfg, serving_graph(cfg)[1])
    shards = table_shards(dict(zip(mesh.axis_names, mesh.devices.shape)), "training")
    table_rows = tuple(-(-r // shards) * shards for r in engram_table_rows(cfg)) if cfg.engram_layer_ids else None
    graphdef, master_shapes = build_training_model(cfg, formats, seed=0, abstract=True, engram_rows=table_rows)
    abstract = jax.eval_shape(lambda m: init_state(m, tcfg), master_shapes)
    shardings = meshlib.state_shardings(mesh, abstract, meshlib.param_shapes_of(abstract))
    rows = meshlib.batch_sharding(mesh)
    step = make_train_step(meshlib.step_graph(graphdef, master_shapes, mesh), formats, cfg, tcfg,
                           state_shardings=shardings, batch_sharding=rows)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rows)  # noqa: E731
    data = {k: sds((batch, seq_len), jnp.int32) for k in ("tokens", "targets", "positions")}
    data.update({k: sds((batch, seq_len), jnp.float32) for k in ("loss_mask", "valid")})
    if cfg.engram_layer_ids:
        cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        data["engram_ids"] = sds((batch, seq_len, len(cfg.engram_layer_ids), cols), jnp.int32)
    return compile_report(step, [state, data], topology, topo, mesh,
                          {"program": "train", "preset": "training", "impl": impl, "batch": batch, "context": seq_len,
                           "layers": cfg.n_layers, "tokens": batch * seq_len})
