"""Per-device memory plan of a config on a mesh, from the real parameter tree (nothing allocated).

Weights: every leaf of the abstract model (`nnx.eval_shape` of the Transformer, Engram tables
padded to the row shards as a sharded deployment stores them), laid out by the preset's rules;
a device holds each leaf's shard shape x itemsize. Caches: `jax.eval_shape(init_cache)` of the
config sized to the batch and context, laid out by the same rules. Activations: the estimate
of `sharding.activations`. Every device holds the same amount (even shardings only).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Mapping

import jax
import numpy as np

from dsv41_jax.config import ModelConfig
from dsv41_jax.layers.moe import GROUPED_ROWS
from sharding.activations import activation_estimate
from sharding.devices import HBM_GIB
from sharding.mesh import MeshSpecError, format_mesh_spec, parse_mesh_spec
from sharding.rules import (ENGRAM_TABLE, ROUTED, VISION, cache_logical_axes, get_rules, param_bucket,
                            param_logical_axes, resolve, shard_shape)
from dsv41_jax.model.info import abstract_model
from dsv41_jax.model.param_names import flat_params
from dsv41_jax.model.transformer import engram_table_rows, init_cache

GiB = 2 ** 30
# kept free for the runtime, XLA scratch buffers and fragmentation
RESERVE = 0.10


def mesh_sizes(spec: str | Mapping[str, int]) -> dict[str, int]:
    sizes = parse_mesh_spec(spec)
    if -1 in sizes.values():
        raise MeshSpecError(f"the plan needs explicit axis sizes, got {format_mesh_spec(sizes)}")
    return sizes


def plan_context(cfg: ModelConfig, context: int) -> int:
    """The context rounded up to what the caches can be sized to (a multiple of every compress ratio)."""
    if context <= 0:
        raise ValueError(f"context must be positive, got {context}")
    m = math.lcm(*(cfg.compress_ratios[s] for s in cfg.kv_source_layers)) if cfg.kv_source_layers else 1
    return -(-context // m) * m


def table_shards(sizes: Mapping[str, int], preset) -> int:
    return math.prod(sizes.get(a, 1) for a in get_rules(preset).get("table_rows", ()))


def _nbytes(shape, dtype) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


@functools.lru_cache(maxsize=4)
def _abstract_params(cfg: ModelConfig):
    """(path, shape, dtype) of every parameter of `info.abstract_model(cfg)`."""
    return tuple((path, tuple(v.shape), np.dtype(v.dtype)) for path, v in flat_params(abstract_model(cfg)).items())


def weight_bytes(cfg: ModelConfig, sizes: Mapping[str, int], preset) -> dict:
    """Global and per-device parameter bytes by bucket, and the leaves the rules left replicated."""
    rules = get_rules(preset)
    n = table_shards(sizes, preset)
    rows = tuple(-(-r // n) * n for r in engram_table_rows(cfg))
    buckets = {ROUTED: [0, 0], ENGRAM_TABLE: [0, 0], "other_weights": [0, 0], VISION: [0, 0]}
    undivided = {}
    for path, shape, dtype in _abstract_params(cfg):
        if param_bucket(path) == ENGRAM_TABLE:  # stored padded to the row shards
            shape = (-(-shape[0] // n) * n,) + shape[1:]
        r = resolve(param_logical_axes(path, len(shape)), shape, rules, sizes)
        if r.dropped:
            undivided[".".join(map(str, path))] = r.dropped
        b = buckets[param_bucket(path)]
        b[0] += _nbytes(shape, dtype)
        b[1] += _nbytes(shard_shape(shape, r.spec, sizes), dtype)
    return {"global": {k: v[0] for k, v in buckets.items()}, "per_device": {k: v[1] for k, v in buckets.items()},
            "engram_rows": rows, "undivided": undivided}


def cache_bytes(cfg: ModelConfig, sizes: Mapping[str, int], preset, batch: int) -> dict:
    rules = get_rules(preset)
    abstract = jax.eval_shape(lambda: init_cache(cfg, batch))
    total = here = 0
    for jax_path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]:
        path = tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", None))) for k in jax_path)
        r = resolve(cache_logical_axes(path, leaf.ndim), tuple(leaf.shape), rules, sizes)
        total += _nbytes(leaf.shape, leaf.dtype)
        here += _nbytes(shard_shape(tuple(leaf.shape), r.spec, sizes), leaf.dtype)
    return {"global": total, "per_device": here}


def build_plan(cfg: ModelConfig, mesh: str | Mapping[str, int], *, batch: int, context: int, preset="inference",
               device: str | None = None, chunk: int = 512, engram: str = "hbm") -> dict:
    """The memory plan as a JSON-ready dict (bytes per device, and whether it fits `device`)."""
    sizes = mesh_sizes(mesh)
    if batch <= 0:
        raise ValueError(f"batch must be positive, got {batch}")
    if device is not None and device not in HBM_GIB:
        raise ValueError(f"unknown device {device!r}; choose one of {sorted(HBM_GIB)}")
    if engram not in ("hbm", "host"):
        raise ValueError(f"engram placement must be 'hbm' or 'host', got {engram!r}")
    n_dev = math.prod(sizes.values())
    T = plan_context(cfg, context)
    run_cfg = cfg.replace(max_seq_len=T, max_batch_size=batch)
    w = weight_bytes(cfg, sizes, preset)
    c = cache_bytes(run_cfg, sizes, preset, batch)
    acts = activation_estimate(run_cfg, sizes, preset, batch=batch, chunk=chunk)
    engram_here = w["per_device"][ENGRAM_TABLE]
    host_engram = 0
    if engram == "host":
        # only a step's compact rows live in HBM (replicated): decode rows of the whole batch
        cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        row = cfg.engram_head_dim + cfg.engram_head_dim // 32
        host_engram = w["global"][ENGRAM_TABLE]
        engram_here = len(cfg.engram_layer_ids) * max(batch, min(chunk, T)) * cols * row
    per_device = {"weights": w["per_device"][ROUTED] + w["per_device"]["other_weights"] + w["per_device"][VISION],
                  "routed_experts": w["per_device"][ROUTED], "other_weights": w["per_device"]["other_weights"],
                  "vision_weights": w["per_device"][VISION],
                  "engram": engram_here, "cache": c["per_device"], "activations": acts["bytes"]}
    total = per_device["weights"] + per_device["engram"] + per_device["cache"] + per_device["activations"]
    out = {
        "mesh": sizes, "devices": n_dev, "preset": preset if isinstance(preset, str) else "custom",
        "batch": batch, "context": T, "prefill_chunk": acts["chunk"], "engram_placement": engram,
        "per_device_bytes": {**per_device, "total": total},
        "global_bytes": {**w["global"], "cache": c["global"]},
        "engram_rows_padded": list(w["engram_rows"]),
        "host_bytes_per_process": host_engram,
        "activations_detail": {"decode": acts["decode"], "prefill": acts["prefill"]},
        "undivided": w["undivided"],
    }
    if device is not None:
        hbm = HBM_GIB[device] * GiB
        out.update(device=device, hbm_bytes=hbm, usable_bytes=int(hbm * (1 - RESERVE)),
                   fits=total <= hbm * (1 - RESERVE))
    return out


def max_batch(cfg: ModelConfig, mesh, *, context: int, device: str, preset="inference", chunk: int = 512,
              engram: str = "hbm", limit: int = 1 << 16) -> int:
    """The largest batch (a multiple of the batch shards) whose plan fits `device`; 0 if none.

    Memory grows with the batch, except where a decode step's MoE leaves the per-row path for the
    grouped one (more than `GROUPED_ROWS` routed rows; `activations._moe_bytes`): each regime is
    searched on its own, and the larger batch of the two is the answer."""
    sizes = mesh_sizes(mesh)
    step = math.prod(sizes.get(a, 1) for a in get_rules(preset).get("batch", ()))

    def fits(b):
        return build_plan(cfg, sizes, batch=b, context=context, preset=preset, device=device, chunk=chunk,
                          engram=engram)["fits"]

    grouped = (GROUPED_ROWS // cfg.n_activated_experts // step + 1) * step  # the first batch on the grouped path
    best = _largest(fits, grouped, limit, step) if grouped <= limit else 0
    return best or _largest(fits, step, min(grouped - step, limit), step)


def _largest(fits, lo: int, hi: int, step: int) -> int:
    """The largest multiple of `step` in [lo, hi] that fits, fits holding below it; 0 if lo does not fit."""
    if lo > hi or not fits(lo):
        return 0
    top = lo
    while top * 2 <= hi and fits(top * 2):
        top *= 2
    lo, hi = top, min(top * 2, hi + step)
    while hi - lo > step:  # invariant: lo fits, hi does not (or is past the range)
        mid = (lo + hi) // 2 // step * step
        if mid <= lo:
            break
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def format_plan(p: dict) -> str:
    def g(b):
        return f"{b / GiB:9.2f} GiB"

    d = p["per_device_bytes"]
    lines = [f"mesh {format_mesh_spec(p['mesh'])} ({p['devices']} devices), preset {p['preset']}, "
             f"batch {p['batch']}, context {p['context']} (prefill chunk {p['prefill_chunk']}), Engram in {p['engram_placement']}",
             "per device:",
             f"  weights        {g(d['weights'])}  (routed experts {g(d['routed_experts']).strip()}, other {g(d['other_weights']).strip()}, "
             f"vision {g(d['vision_weights']).strip()})",
             f"  engram         {g(d['engram'])}",
             f"  caches         {g(d['cache'])}",
             f"  activations    {g(d['activations'])}  (estimate: max of decode step and prefill chunk, XLA path)",
             f"  total          {g(d['total'])}"]
    gb = p["global_bytes"]
    lines.append(f"whole model: routed {g(gb[ROUTED]).strip()}, other {g(gb['other_weights']).strip()}, "
                 f"vision {g(gb[VISION]).strip()}, "
                 f"Engram {g(gb[ENGRAM_TABLE]).strip()}, caches {g(gb['cache']).strip()}")
    if p["host_bytes_per_process"]:
        lines.append(f"host memory per process: {g(p['host_bytes_per_process']).strip()} of Engram tables")
    if "device" in p:
        verdict = "fits" if p["fits"] else "does NOT fit"
        lines.append(f"{p['device']}: {HBM_GIB[p['device']]} GiB HBM, {g(p['usable_bytes']).strip()} usable "
                     f"({int(RESERVE * 100)}% reserve) -> {verdict}")
    if p["undivided"]:
        lines.append(f"{len(p['undivided'])} arrays could not take every axis their rule asks for (replicated along those axes), e.g. "
                     + "; ".join(f"{k}: {', '.join(v)}" for k, v in list(p["undivided"].items())[:3]))
    if "compile" in p:
        c = p["compile"]
        if c.get("ok"):
            lines.append(f"one-layer AOT compile on {c['devices']} fake CPU devices: ok in {c['seconds']:.1f} s; "
                         f"XLA temp {g(c['temp_bytes']).strip()}/device; collectives {c['collectives']}")
        else:
            lines.append(f"one-layer AOT compile FAILED: {c.get('error')}")
    return "\n".join(lines)
