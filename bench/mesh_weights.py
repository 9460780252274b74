"""Weight traffic per device of the engine's decode step on a mesh, kernel path (`bench/decode.py
--stored-weights --mesh SPEC`): traced on fake CPU devices, nothing compiled or allocated.

The step is the serving engine's own (`serving.steps.build_steps` with `sharding.serving.MeshPlacement`'s
layout and trace context), on abstract params laid out by the preset. Three versions:
- "stored": the params as stored and the steps traced outside the mesh's kernel context (the engine
  on a mesh before it made the kernels' word views at load and traced its steps per device): the
  kernels' wrappers relayout every FP8 weight into 32-bit words on each call, from a byte cache;
- "layers": `kernel_params`' word views, made once at load and split like the stored bytes, each
  scanned run of layers' weights stacked at load (`stack_layers`), the steps traced inside the
  placement's kernel context (each kernel per device), the cache's KV rows as the kernels' word views
  (`Runtime.kv_words`), but one window ring per layer: each scanned run stacks its rings per call;
- "engine": what `MeshPlacement` and the engine hold now: as "layers", with each scanned run's
  window rings held stacked in the cache (`model.cache.RingStack`), read and written in place.
Bytes per device: a weight's use counts its shard (its sharding's shard shape); a relayout is
counted at the kernel's operand, which inside `shard_map` is the device's own.
"""
from __future__ import annotations

import contextlib


def rows(cfg, context: int, mesh_spec: str, preset: str = "inference", batches=(1, 64)) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dsv41_jax.model import stack
    from dsv41_jax.model.kernel_weights import kernel_params
    from dsv41_jax.model.transformer import stack_layers
    from dsv41_jax.runtime import Runtime
    from dsv41_jax.serving import cost, split_prefill, weight_traffic
    from dsv41_jax.serving.steps import build_steps
    from sharding.engram_shard import pad_tables
    from sharding.load import table_row_shards
    from sharding.mesh import make_mesh
    from sharding.rules import batch_sharding, cache_shardings, param_shardings
    from sharding.serving import MeshPlacement
    from sharding.step import distribute

    mesh = make_mesh(mesh_spec)
    placement = MeshPlacement(mesh, preset)
    rt = Runtime(mode="fast", impl="pallas", interpret=False)  # the kernels as compiled for a TPU
    plan = split_prefill.decode_plan(rt)
    gd, stored = cost.abstract_params(cfg)
    # Engram tables padded to equal row shards, as `MeshPlacement` stores them
    stored = jax.eval_shape(lambda p: pad_tables(p, table_row_shards(mesh, preset)), stored)
    sds = lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)  # noqa: E731
    out = []
    for version in ("stored", "layers", "engine"):
        gd_v, held, runs = gd, stored, ()
        if version != "stored":  # as `MeshPlacement.load` holds them
            gd_v, held = stack_layers(gd, jax.eval_shape(lambda p: kernel_params(gd, p, plan), stored), plan)
        if version == "engine":
            runs = stack.held_runs(nnx.merge(gd_v, held))
        params = jax.tree.map(sds, held, param_shardings(held, mesh, preset))
        graphdef, _ = nnx.split(distribute(nnx.merge(gd_v, params), mesh, preset))
        trace = placement.trace if version != "stored" else contextlib.nullcontext
        steps = build_steps(graphdef, rt, plan, cfg.window_size, placement.constrain, 0, trace)
        fraction = [int(np.prod(s.sharding.shard_shape(s.shape))) / max(1, int(np.prod(s.shape)))
                    for s in jax.tree_util.tree_leaves(params)]
        for batch in batches:
            cache = cost.abstract_cache(cfg, batch, context, version != "stored" and rt.kv_words(), runs)
            cache = jax.tree.map(sds, cache, cache_shardings(cache, mesh, preset))
            tokens = jax.ShapeDtypeStruct((batch, 1), jnp.int32, sharding=batch_sharding(mesh, (batch, 1), preset))
            active = jax.ShapeDtypeStruct((batch,), jnp.bool_, sharding=batch_sharding(mesh, (batch,), preset))
            ids = cost.engram_spec(cfg, batch, 1)
            if ids is not None:
                ids = sds(ids, batch_sharding(mesh, ids.shape, preset))
            closed = steps.decode.trace(params, tokens, cache, None, active, ids).jaxpr
            uses = weight_traffic.uses_in(closed, params)
            for i, u in zip(weight_traffic.stored_weights(params), uses):  # the device's share of each weight
                u.stored_bytes = int(u.stored_bytes * fraction[i])
                u.elements = int(u.elements * fraction[i])
                u.gathered_bytes = int(u.gathered_bytes * fraction[i])
            t = weight_traffic.traffic(uses, rows=batch * cfg.n_activated_experts)
            out.append({"mesh": mesh_spec, "params": version, "batch": batch, "context": context, "per_device": t,
                        "relaid_out_weights": sum(1 for u in uses if u.relayout_bytes),
                        "dequantized_weights": sum(1 for u in uses if u.dequantized),
                        "cache_relayout": _cache_relayout(closed, params, cache)})
    return out


def _cache_relayout(closed, params, cache) -> int:
    """Bytes per device the step writes and reads again relaying the KV caches out for the kernels
    (e.g. into their 32-bit word views, made per call inside the kernels' `shard_map`)."""
    import jax

    from dsv41_jax.serving import weight_traffic

    first = len(jax.tree_util.tree_leaves(params)) + 1  # the caches follow the params and the tokens
    return sum(2 * u.relayout_bytes for u in weight_traffic.kv_cache_uses(closed, first, cache))


def print_rows(rows) -> None:
    print(f"decode step on mesh {rows[0]['mesh']}, kernel path, weight traffic per device per step (GB), from the trace")
    print(f"{'params':>7} {'batch':>5} {'read':>8} {'deq w+r':>8} {'relayout':>8} {'total':>8}  weights relaid out / "
          "dequantized; KV caches relaid out (GB, written and read)")
    for r in rows:
        t = r["per_device"]
        print(f"{r['params']:>7} {r['batch']:>5} {t['read'] / 1e9:8.2f} {t['dequantized'] / 1e9:8.2f} "
              f"{t['relayout'] / 1e9:8.2f} {t['total'] / 1e9:8.2f}  {r['relaid_out_weights']} / {r['dequantized_weights']}; "
              f"{r['cache_relayout'] / 1e9:.3f}")
