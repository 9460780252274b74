"""The model's decode step compiled by XLA:TPU for a TPU slice, from a machine without a TPU.

The parameters are abstract (`nnx.eval_shape` of the Transformer: the stored FP8/FP4 formats,
Engram tables padded to the row shards), laid out by the preset's rules on a mesh of the
topology's devices (`jax.make_mesh`: the same device order a pod's `dsv41 serve` builds), and
the step is `make_sharded_step`'s, the one the engine runs. Nothing is allocated. The figures are
the compiler's: its buffer assignment per device, the collectives left in the optimized program
and the TPU cost model's estimate, not measurements on a TPU.

A whole-depth compile of the released model takes long on a small machine, so
`layers_per_kind` keeps `n` layers of each kind the released stack has (see `layer_kinds`) at
the released width: per-device argument bytes of the full depth are then the plan's exact
figure, and the compiled depth is stated beside every figure.
"""
from __future__ import annotations

import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.config import ModelConfig
from dsv41_jax.runtime import Runtime
from pallas_kernels.common import tpu_compile
from sharding.layer_compile import abstract_step_args, COLLECTIVES
from sharding.mesh import make_mesh
from sharding.plan import mesh_sizes, plan_context
from sharding.step import make_sharded_step
from sharding.tpu_memory import memory_figures

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2,
                "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def layer_kinds(cfg: ModelConfig) -> dict[str, list[int]]:
    """The released stack's layers grouped by what they compute (each kind compiles to the same body)."""
    kinds: dict[str, list[int]] = {}
    for layer in range(cfg.n_layers):
        r = cfg.compress_ratios[layer]
        role = ("kv-source" if layer in cfg.kv_source_layers else
                "index-source" if layer in cfg.index_source_layers else "reader") if r else "window"
        name = f"ratio{r}-{role}" + ("-candidates" if layer == cfg.candidate_source_layer else "") \
            + ("-engram" if layer in cfg.engram_layer_ids else "")
        kinds.setdefault(name, []).append(layer)
    return kinds


def subset_config(cfg: ModelConfig, per_kind: int) -> tuple[ModelConfig, dict[str, int]]:
    """The first `per_kind` layers of each kind, renumbered in order (sources keep preceding their readers)."""
    keep = sorted(layer for layers in layer_kinds(cfg).values() for layer in layers[:per_kind])
    new = {old: i for i, old in enumerate(keep)}
    sub = cfg.replace(
        n_layers=len(keep), compress_ratios=tuple(cfg.compress_ratios[i] for i in keep),
        kv_source_layers=tuple(new[s] for s in cfg.kv_source_layers if s in new),
        index_source_layers=tuple(new[s] for s in cfg.index_source_layers if s in new),
        candidate_source_layer=new.get(cfg.candidate_source_layer, -1),
        engram_layer_ids=tuple(new[s] for s in cfg.engram_layer_ids if s in new),
        engram_num_embeddings=tuple(n for s, n in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings) if s in new)
        if cfg.engram_num_embeddings else (),
        n_mtp_layers=0, dspark_target_layer_ids=_targets(cfg.dspark_target_layer_ids, new))
    return sub, {k: min(per_kind, len(v)) for k, v in layer_kinds(cfg).items()}


def _targets(targets: tuple[int, ...], new: dict[int, int]) -> tuple[int, ...]:
    """DSpark's tapped layers in the kept stack: their new numbers, or, when some are not kept, as many
    of its last layers (the released targets are the stack's last three)."""
    if all(t in new for t in targets):
        return tuple(new[t] for t in targets)
    return tuple(range(len(new) - len(targets), len(new)))


def collectives(hlo: str, hosts=None) -> dict[str, dict]:
    """Collectives of an optimized HLO text by kind: how many, and the bytes of their results.

    An asynchronous collective is counted at its `-done` op, whose result is the output alone (the
    `-start` op's tuple also holds the operands). hosts: the process index of each device of the
    program's device assignment (the mesh's devices, flattened); then "cross_host" counts the
    collectives one of whose device groups spans more than one host (the rest stay on a host's ICI)."""
    out: dict[str, dict] = {}
    starts: dict[str, str] = {}  # an async op's groups are on its -start line
    for line in hlo.splitlines():
        st = re.search(r"%(\S+)\s*=.*\b(?:" + "|".join(COLLECTIVES) + r")-start\(", line)
        if st:
            starts[st.group(1)] = line
        m = re.search(r"=\s*(\(.*?\)|\S+)\s+(" + "|".join(COLLECTIVES) + r")(-done)?\(([^)]*)\)", line)
        if m is None:
            continue
        nbytes = sum(_DTYPE_BYTES.get(dt, 4) * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                     for dt, dims in re.findall(r"(\w+)\[([\d,]*)\]", m.group(1)))
        entry = out.setdefault(m.group(2), {"count": 0, "bytes": 0})
        entry["count"] += 1
        entry["bytes"] += nbytes
        if hosts is not None:
            source = starts.get(m.group(4).strip().lstrip("%"), line) if m.group(3) else line
            groups = replica_groups(source, len(hosts))
            crosses = any(len({hosts[i] for i in g}) > 1 for g in groups)
            entry["cross_host"] = entry.get("cross_host", 0) + int(crosses)
    return out


def replica_groups(line: str, n_devices: int) -> list[list[int]]:
    """The device groups of one collective's HLO line: {{0,1},{2,3}}, the iota form [2,2]<=[4] (or
    [2,2]<=[2,2]T(1,0)), or, for a collective-permute, its source_target_pairs; [] is every device."""
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        shape, dims = [int(x) for x in m.group(1).split(",")], [int(x) for x in m.group(2).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(shape).tolist()
    m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
    if m:
        groups = [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}", m.group(1))]
        return [g for g in groups if g] or [list(range(n_devices))]
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line)
    if m:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)\}", m.group(1))]
    return [list(range(n_devices))]


def slice_mesh(topology: str, mesh_spec):
    """(the slice's `TopologyDescription`, a mesh over its first chips as `jax.make_mesh` orders them)."""
    topo = tpu_compile.topology(topology)
    sizes = mesh_sizes(mesh_spec)
    n = int(np.prod(list(sizes.values())))
    if n > len(topo.devices):
        raise ValueError(f"mesh {mesh_spec} has {n} devices but topology {topology} has {len(topo.devices)} chips; "
                         "make the axis sizes multiply to the chip count (or fewer)")
    return topo, make_mesh(sizes, devices=topo.devices[:n])


def compile_decode(cfg: ModelConfig, topology: str, mesh_spec, *, batch: int, context: int, preset="inference",
                   impl: str = "xla") -> dict:
    """Compile one decode step for the slice; a JSON-ready report (ok False with the compiler's reason)."""
    topo, mesh = slice_mesh(topology, mesh_spec)
    run_cfg = cfg.replace(max_seq_len=plan_context(cfg, context), max_batch_size=batch)
    runtime = Runtime(impl=impl, interpret=False)
    abstract, args = abstract_step_args(run_cfg, mesh, preset, batch=batch, tokens=1, runtime=runtime)
    step = make_sharded_step(abstract, mesh, preset, runtime)
    return compile_report(step, args, topology, topo, mesh, {"program": "decode", "preset": preset, "impl": impl,
                                                             "batch": batch, "context": run_cfg.max_seq_len,
                                                             "layers": cfg.n_layers})


def compile_report(step, args, topology: str, topo, mesh, report: dict) -> dict:
    """Compile the jitted `step` on `args` (abstract, laid out on `mesh`) with XLA:TPU: the report of the
    compiler's buffer assignment, collectives, Mosaic calls and cost model (ok False with its reason)."""
    device = topo.devices[0]
    report = {"topology": topology, "chips": mesh.devices.size, "hosts": len({d.process_index for d in topo.devices}),
              "device_kind": device.device_kind, "hbm_bytes": tpu_compile.hbm_bytes(device),
              "mesh": dict(zip(mesh.axis_names, mesh.devices.shape)), **report}
    t0 = time.perf_counter()
    try:
        compiled = step.lower(*args).compile()
    except Exception as e:  # noqa: BLE001 (reported: the command says which program and why, exit 1)
        return {**report, "ok": False, "seconds": time.perf_counter() - t0,
                "error": f"{type(e).__name__}: {str(e)[:3000]}"}
    seconds = time.perf_counter() - t0
    cost = compiled.cost_analysis() or {}
    hlo = compiled.as_text()
    per_device = memory_figures(compiled)
    markers = sum(hlo.count(f'custom_call_target="{name}"') for name in MINUS_ONE_SECOND)
    kernels = tpu_compile.mosaic_kernels(hlo)
    return {**report, "ok": True, "seconds": seconds, "per_device_bytes": per_device,
            "fits": report["hbm_bytes"] is None or per_device["fit"] <= report["hbm_bytes"],
            "collectives": collectives(hlo, [d.process_index for d in mesh.devices.flat]),
            "mosaic_kernels": sorted(set(kernels)), "mosaic_calls": len(kernels),
            "flops": float(cost.get("flops", 0.0)), "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
            "cost_model_seconds": cost_model_seconds(float(cost.get("optimal_seconds", 0.0)), markers),
            "minus_one_second_calls": markers}


# custom calls XLA:TPU (libtpu 0.0.42) inserts itself, which do no work of their own and which its
# cost model counts as -1 s each: PrepareAsyncCallStart/Done wrap a Mosaic call it overlaps with a
# collective (the tiny model's expert-parallel MoE with its 3 kernel calls gave -1.99999 s with 2
# markers, its 7-layer decode step -13.99995 s with 14); ConcatBitcast joins bitcast operands (the
# released decode step on v6e:4x4 has 72 and a total of -71.98775 s: 12.25 ms once added back)
MINUS_ONE_SECOND = ("PrepareAsyncCallStart", "PrepareAsyncCallDone", "ConcatBitcast")


def cost_model_seconds(optimal_seconds: float, markers: int) -> float:
    """The cost model's time with the -1 s of each `MINUS_ONE_SECOND` custom call added back."""
    return optimal_seconds + markers
