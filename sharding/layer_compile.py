"""Ahead-of-time compile of one full-width layer on a mesh, to catch sharding mistakes early.

The layer is the widest kind the model has: a ratio-1 Full layer (compressor, indexer with
the candidate pool) with Engram when the config has it, at the real dims, batch and context.
It is lowered with abstract, sharded arguments (`jax.ShapeDtypeStruct(..., sharding=...)`) and
compiled for the mesh's devices, which on a workstation are fake CPU devices
(`--xla_force_host_platform_device_count`). Nothing is allocated. A layout that the
partitioner cannot honour, a shard_map spec that does not divide, or a collective over a
missing axis fails here instead of on the pod.

`abstract_step_args` (a step's abstract, sharded arguments) is shared with the TPU compile of the
whole stack (`sharding.tpu_step`), which lays the arguments out the same way for a TPU slice.
"""
from __future__ import annotations

import math
import re
import time

import jax
import jax.numpy as jnp

from dsv41_jax.config import ModelConfig
from dsv41_jax.model.kernel_weights import kernel_params
from dsv41_jax.model.plan import Plan
from dsv41_jax.model.stack import held_runs
from dsv41_jax.model.transformer import engram_table_rows, init_cache, stack_layers, Transformer
from dsv41_jax.runtime import Runtime
from sharding.mesh import format_mesh_spec, make_mesh
from sharding.plan import mesh_sizes, plan_context, table_shards
from sharding.rules import batch_sharding, cache_shardings, param_shardings
from sharding.step import make_sharded_step

COLLECTIVES = ("all-to-all", "all-reduce", "all-gather", "reduce-scatter", "collective-permute")


def one_layer_config(cfg: ModelConfig, *, batch: int, context: int, engram_rows: int | None = None) -> ModelConfig:
    """A valid 1-layer config at full width: layer 0 is its own KV, index and candidate source."""
    engram = bool(cfg.engram_layer_ids)
    return cfg.replace(
        n_layers=1, compress_ratios=(1,), kv_source_layers=(0,), index_source_layers=(0,),
        candidate_source_layer=0 if cfg.candidate_source_layer >= 0 else -1,
        engram_layer_ids=(0,) if engram else (), engram_num_embeddings=(engram_rows,) if engram and engram_rows else (),
        n_mtp_layers=0, max_seq_len=context, max_batch_size=batch)


def compile_one_layer(cfg: ModelConfig, mesh_spec, *, batch: int, context: int, preset="inference",
                      tokens: int = 1, runtime: Runtime = Runtime()) -> dict:
    """Lower and compile one step (`tokens` new tokens per sequence) of a 1-layer model; a report dict."""
    sizes = mesh_sizes(mesh_spec)
    n = math.prod(sizes.values())
    if jax.device_count() < n:
        raise RuntimeError(f"compiling for mesh {format_mesh_spec(sizes)} needs {n} devices, this process has "
                           f"{jax.device_count()}; start it with XLA_FLAGS=--xla_force_host_platform_device_count={n}")
    mesh = make_mesh(sizes, devices=jax.devices()[:n])
    rows = None
    if cfg.engram_layer_ids:
        rows = -(-max(engram_table_rows(cfg)) // table_shards(sizes, preset)) * table_shards(sizes, preset)
    cfg1 = one_layer_config(cfg, batch=batch, context=plan_context(cfg, context), engram_rows=rows)
    abstract, args = abstract_step_args(cfg1, mesh, preset, batch=batch, tokens=tokens, runtime=runtime)
    step = make_sharded_step(abstract, mesh, preset, runtime)
    t0 = time.perf_counter()
    try:
        compiled = step.lower(*args).compile()
    except Exception as e:  # noqa: BLE001 (reported, not swallowed: the plan prints it and fails)
        return {"ok": False, "devices": n, "error": f"{type(e).__name__}: {str(e)[:2000]}"}
    seconds = time.perf_counter() - t0
    hlo = compiled.as_text()
    counts = {c: len(re.findall(rf"\b{c}(?:-start)?\(", hlo)) for c in COLLECTIVES}
    mem = compiled.memory_analysis()
    return {"ok": True, "devices": n, "seconds": seconds, "tokens": tokens,
            "temp_bytes": int(getattr(mem, "temp_size_in_bytes", 0) or 0),
            "argument_bytes": int(getattr(mem, "argument_size_in_bytes", 0) or 0),
            "collectives": {k: v for k, v in counts.items() if v}}


def abstract_step_args(cfg: ModelConfig, mesh, preset, *, batch: int, tokens: int, runtime: Runtime = Runtime(),
                       taps: bool | None = None):
    """(abstract model, [params, tokens, cache(, engram ids)]) as sharded ShapeDtypeStructs. The params
    are those `runtime`'s plan reads, as the engine holds them: for the TPU kernels the word views made
    at load (`kernel_params`), laid out like the stored weights (each device holds its own experts'
    views), and each scanned run of layers stacked (`stack_layers`; taps: the steps tap DSpark's
    layers, default `forward`'s: when the config has the drafter); the abstract model is the stacked one."""
    from flax import nnx

    shards = table_shards(dict(zip(mesh.axis_names, mesh.devices.shape)), preset)
    rows = tuple(-(-r // shards) * shards for r in engram_table_rows(cfg)) if cfg.engram_layer_ids else None
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=0, engram_rows=rows))
    graphdef, state = nnx.split(abstract)
    plan = Plan.resolve(runtime)
    state = jax.eval_shape(lambda s: kernel_params(graphdef, s, plan), state)
    graphdef, state = stack_layers(graphdef, state, plan, cfg.has_dspark if taps is None else taps)
    abstract = nnx.merge(graphdef, state)

    def sds(a, s):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)

    params = jax.tree.map(sds, state, param_shardings(state, mesh, preset))
    # as the engine keeps it: the kernels' words, the scanned runs' window rings stacked
    cache_abs = jax.eval_shape(lambda: init_cache(cfg, batch, runtime.kv_words(), held_runs(abstract)))
    cache = jax.tree.map(sds, cache_abs, cache_shardings(cache_abs, mesh, preset))
    args = [params, jax.ShapeDtypeStruct((batch, tokens), jnp.int32,
                                         sharding=batch_sharding(mesh, (batch, tokens), preset)), cache]
    if cfg.engram_layer_ids:
        shape = (batch, tokens, len(cfg.engram_layer_ids), (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads)
        args.append(jax.ShapeDtypeStruct(shape, jnp.int32, sharding=batch_sharding(mesh, shape, preset)))
    return abstract, args


def main(argv=None) -> int:
    """`python -m sharding.layer_compile --config C --mesh SPEC --batch B --context T`: the report as JSON.

    The plan runs this in a child process when its own JAX backend already started with too
    few devices (the fake-device count is fixed when the backend starts).
    """
    import argparse
    import json

    p = argparse.ArgumentParser(prog="python -m sharding.layer_compile")
    p.add_argument("--config", default="v41-flash")
    p.add_argument("--mesh", required=True)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--preset", default="inference")
    p.add_argument("--tokens", type=int, default=1)
    a = p.parse_args(argv)
    report = compile_one_layer(ModelConfig.load(a.config), a.mesh, batch=a.batch, context=a.context,
                               preset=a.preset, tokens=a.tokens)
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    import sys

    sys.exit(main())
