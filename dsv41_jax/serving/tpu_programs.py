"""The serving engine's prefill and speculative programs compiled by XLA:TPU for a TPU slice, from a
machine without a TPU (`dsv41 compile --what prefill|verify`; the decode step is `sharding.tpu_step`'s).

The programs are the engine's own (`serving.steps.build_steps`) on the mesh's layout and trace
context (`sharding.serving.MeshPlacement`), with the abstract, sharded arguments the engine passes
them (`sharding.layer_compile.abstract_step_args`: the stored formats, the kernels' word views for
impl "pallas"); nothing is allocated. A prompt of `context` tokens runs, in the engine:
- Graph A (`encode`) over each `chunk`-token piece into a one-row cache of `context` positions;
- Graph B (`finish`) once over the tail (the newest window + `tail_slack` positions);
- the bounded replay (`replay`) of a stored conversation's last window, on a resumed turn.
A speculating engine runs `verify`: the batch's K drafts and the token before them through the
target model ([batch, K + 1] tokens), its cache writes kept pending for the commit.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from dsv41_jax.config import ModelConfig
from dsv41_jax.runtime import Runtime
from dsv41_jax.serving.split_prefill import decode_plan
from dsv41_jax.serving.steps import build_steps
from sharding.layer_compile import abstract_step_args
from sharding.plan import plan_context
from sharding.serving import MeshPlacement
from sharding.step import distribute
from sharding.tpu_step import compile_report, slice_mesh

WHAT = {"prefill": ("graph_a", "graph_b", "replay"), "verify": ("verify",)}


def compile_programs(cfg: ModelConfig, topology: str, mesh_spec, *, what: str, batch: int, context: int,
                     preset: str = "inference", impl: str = "xla", chunk: int = 512, k: int | None = None) -> list[dict]:
    """One report per program of `what` (`WHAT`), as `sharding.tpu_step.compile_report` gives it.
    prefill: a `context`-token prompt in `chunk`-token pieces (batch 1, as the engine prefills);
    verify: `batch` sequences with k drafts each (default the drafter's block, as `dsv41 serve
    --speculative dspark` drafts)."""
    if what not in WHAT:
        raise ValueError(f"--what {what!r}: the engine programs compiled here are {sorted(WHAT)} (and decode)")
    if what == "verify" and not all(0 <= t < cfg.n_layers for t in cfg.dspark_target_layer_ids):
        raise ValueError(f"--what verify needs a config with the DSpark drafter: its tapped layers "
                         f"{cfg.dspark_target_layer_ids} are not among the {cfg.n_layers} layers of this config")
    topo, mesh = slice_mesh(topology, mesh_spec)
    run_cfg = cfg.replace(max_seq_len=plan_context(cfg, context), max_batch_size=batch)
    runtime = Runtime(impl=impl, interpret=False)
    placement = MeshPlacement(mesh, preset)
    k = cfg.dspark_block_size if k is None else k
    tail = cfg.window_size
    rows, tokens = (1, min(chunk, run_cfg.max_seq_len)) if what == "prefill" else (batch, k + 1)
    abstract, args = abstract_step_args(run_cfg, mesh, preset, batch=rows, tokens=tokens, runtime=runtime,
                                        taps=what == "verify")
    params, toks, cache, ids = (*args, None)[:4]
    graphdef, _ = nnx.split(distribute(abstract, mesh, preset))
    steps = build_steps(graphdef, runtime, decode_plan(runtime), tail, placement.constrain, k if what == "verify" else 0,
                        placement.trace)
    base = {"preset": preset, "impl": impl, "batch": rows, "context": run_cfg.max_seq_len, "layers": cfg.n_layers}
    if what == "verify":
        return [compile_report(steps.drafting.verify, [params, toks, cache, ids], topology, topo, mesh,
                               {**base, "program": "verify", "tokens": tokens, "drafts": k})]
    replicated = NamedSharding(mesh, PartitionSpec())
    sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=replicated)  # noqa: E731
    buffers = {"h": sds((1, tail, cfg.hc_mult, cfg.dim), jnp.bfloat16), "pre": sds((1, tail, cfg.hc_mult), jnp.float32)}
    one = sds((1,), jnp.int32)
    window = lambda n: None if ids is None else sds(ids.shape[:1] + (n,) + ids.shape[2:], ids.dtype)  # noqa: E731
    programs = {
        "graph_a": (steps.encode, [params, toks, cache, buffers, ids, None, one], tokens),
        "graph_b": (steps.finish, [params, buffers, cache, None, one, window(tail), None], tail),
        "replay": (steps.replay, [params, sds((1, cfg.window_size), jnp.int32), cache, window(cfg.window_size), None,
                                  one], cfg.window_size),
    }
    return [compile_report(fn, fn_args, topology, topo, mesh, {**base, "program": name, "tokens": n})
            for name, (fn, fn_args, n) in programs.items()]
