"""Each Pallas TPU kernel compiled through Mosaic for a TPU generation, on a machine without a TPU.

`compile_kernel(name, target, **dims)` lowers one kernel at the given dims (V4.1-Flash head
sizes by default, small batches and caches) for one chip of `target` and compiles it with
libtpu; a refusal (Mosaic's VMEM, tiling or layout checks, or XLA:TPU around the kernel) is a
`KernelRefused` naming the kernel, the dims and the target.

`python -m pallas_kernels.common.mosaic_check [TARGET ...]` compiles every kernel for each target
in this process and prints one JSON line per kernel as it finishes; `--mesh TOPOLOGY ...` compiles
the kernels a sharded step calls per device (`partition.per_device`, inside a `shard_map`) on a
mesh of the topology's chips. The tests run it as a child
process: a compiler that aborts (libtpu stops the process on a failed internal check) then costs
the child, and the last line says which kernel was compiling.
"""
from __future__ import annotations

import json
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from pallas_kernels.common import partition, tpu_compile

sds = jax.ShapeDtypeStruct


class KernelRefused(ValueError):
    """The TPU compiler refused a kernel at these dims for this target."""


def _sparse_attention(B=2, S=1, H=64, D=512, W=128, G=1024, K=512):
    # deferred: each check loads only the kernel it compiles
    from dsv41_jax.numerics import kv_layout
    from pallas_kernels import sparse_sink_attention

    def fn(q, wv, ws, cp, cs, widx, cidx, sink):
        return sparse_sink_attention(q, kv_layout.WindowKV(wv, ws), kv_layout.CompressedKV(cp, cs), widx, cidx, sink,
                                     D ** -0.5, impl="pallas", interpret=False, platform="tpu")

    return fn, (sds((B, S, H, D), jnp.bfloat16), sds((B, W, D), jnp.float8_e4m3fn), sds((B, W, D // 32), jnp.uint8),
                sds((B, G, D // 2), jnp.uint8), sds((B, G, D // 16), jnp.float8_e4m3fn), sds((B, S, W), jnp.int32),
                sds((B, S, K), jnp.int32), sds((H,), jnp.float32))


def _indexer(B=2, S=1, Hi=32, Di=128, G=1024):
    # deferred: each check loads only the kernel it compiles
    from dsv41_jax.numerics import kv_layout
    from pallas_kernels import indexer_scores

    def fn(qp, qs, kp, ks, w, clen):
        return indexer_scores(qp, qs, kv_layout.IndexKeys(kp, ks), w, clen, None, bf16_rounding=True,
                              impl="pallas", interpret=False, platform="tpu")

    return fn, (sds((B, S, Hi, Di // 2), jnp.uint8), sds((B, S, Hi, Di // 32), jnp.uint8),
                sds((B, G, Di // 2), jnp.uint8), sds((B, G, Di // 32), jnp.uint8), sds((B, S, Hi), jnp.float32),
                sds((B, S), jnp.int32))


def _grouped_fp4_gemm(M=48, E=8, N=256, K=512):
    # deferred: each check loads only the kernel it compiles
    from pallas_kernels import grouped_fp4_gemm

    def fn(x, gs, wp, ws):
        return grouped_fp4_gemm(x, gs, wp, ws, impl="pallas", interpret=False, platform="tpu")

    return fn, (sds((M, K), jnp.bfloat16), sds((E,), jnp.int32), sds((E, N, K // 2), jnp.uint8),
                sds((E, N, K // 32), jnp.uint8))


# N=1024, K=4096: the scale grid [32, 128] whose bare u8 -> s32 convert XLA:TPU for v5p aborts on (the kernel pads it)
def _fp8_block_gemm(M=8, N=1024, K=4096):
    # deferred: each check loads only the kernel it compiles
    from pallas_kernels import fp8_block_gemm

    def fn(x, w, s):
        return fp8_block_gemm(x, w, s, impl="pallas", interpret=False, platform="tpu")

    return fn, (sds((M, K), jnp.bfloat16), sds((N, K), jnp.float8_e4m3fn), sds((-(-N // 32), -(-K // 32)), jnp.uint8))


KERNELS = {"sparse_sink_attention": _sparse_attention, "indexer_scores": _indexer,
           "grouped_fp4_gemm": _grouped_fp4_gemm, "fp8_block_gemm": _fp8_block_gemm}


def compile_kernel(name: str, target: str, **dims) -> dict:
    """Compile one kernel for one chip of `target`; the compiler's figures, or KernelRefused."""
    if name not in KERNELS:
        raise ValueError(f"unknown kernel {name!r}; choose one of {sorted(KERNELS)}")
    fn, shapes = KERNELS[name](**dims)
    what = f"{name} with {', '.join(f'{k}={v}' for k, v in dims.items()) or 'its default dims'} " \
           f"(arguments {[f'{s.dtype}{list(s.shape)}' for s in shapes]})"
    t0 = time.perf_counter()
    try:
        compiled = tpu_compile.compile_on_one_chip(fn, *shapes, target=target)
    except Exception as e:  # noqa: BLE001 (re-raised with the kernel, its dims and the target)
        first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise KernelRefused(f"{what} does not compile for {target}: {first[:600]}") from e
    cost = compiled.cost_analysis() or {}
    return {"kernel": name, "target": target, "seconds": round(time.perf_counter() - t0, 2),
            "mosaic_calls": tpu_compile.mosaic_kernels(compiled.as_text()),
            "flops": float(cost.get("flops", 0.0)), "bytes_accessed": float(cost.get("bytes accessed", 0.0))}


# the kernels a model step calls on a mesh through `partition.per_device` (the grouped FP4 GEMM runs per
# device inside the expert-parallel MoE's own shard_map)
MESH_KERNELS = ("sparse_sink_attention", "indexer_scores", "fp8_block_gemm")


def compile_kernel_on_mesh(name: str, target: str = "v6e:2x2", **dims) -> dict:
    """One kernel as a sharded step runs it: per device (`partition.per_device`) on a 2 x (chips/2) mesh
    of `target`'s chips, batch over "data", heads over "tensor" (B=4 rows by default). The compiler's
    figures, or KernelRefused."""
    if name not in MESH_KERNELS:
        raise ValueError(f"unknown mesh kernel {name!r}; choose one of {list(MESH_KERNELS)}")
    devices = tpu_compile.topology(target).devices
    mesh = Mesh(np.array(devices).reshape(2, -1), ("data", "tensor"), axis_types=(AxisType.Auto,) * 2)
    fn, shapes = KERNELS[name](**({"M": 8} if name == "fp8_block_gemm" else {"B": 4}) | dims)

    def on_mesh(*args):
        with partition.kernel_mesh(mesh, batch=("data",), heads=("tensor",)):
            return fn(*args)

    args = [sds(s.shape, s.dtype, sharding=NamedSharding(mesh, PartitionSpec())) for s in shapes]
    t0 = time.perf_counter()
    try:
        compiled = jax.jit(on_mesh).lower(*args).compile()
    except Exception as e:  # noqa: BLE001 (re-raised with the kernel and the target)
        first = next((ln for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise KernelRefused(f"{name} per device on a mesh of {target} does not compile: {first[:600]}") from e
    return {"kernel": name, "target": target, "mesh": dict(zip(mesh.axis_names, mesh.devices.shape)),
            "seconds": round(time.perf_counter() - t0, 2), "mosaic_calls": tpu_compile.mosaic_kernels(compiled.as_text()),
            "kernel_results": _kernel_results(compiled.as_text())}


def _kernel_results(hlo: str) -> list[str]:
    """The result types of a program's Mosaic calls (per device: what each device's kernel computes)."""
    return [m.group(1) for line in hlo.splitlines() if 'custom_call_target="tpu_custom_call"' in line
            for m in [re.search(r"=\s*(\S+?)(?:\{[^}]*\})?\s+custom-call\(", line)] if m]


def main(argv=None) -> int:
    """TARGET ... : every kernel on one chip of each; --mesh TOPOLOGY ... : the mesh kernels per device on each."""
    argv = list(argv if argv is not None else sys.argv[1:])
    on_mesh = bool(argv) and argv[0] == "--mesh"
    targets = argv[1:] if on_mesh else (argv or list(tpu_compile.KERNEL_TARGETS))
    ok = True
    for target in targets:
        for name in (MESH_KERNELS if on_mesh else KERNELS):
            print(json.dumps({"compiling": name, "target": target}), flush=True)
            try:
                print(json.dumps(compile_kernel_on_mesh(name, target) if on_mesh else compile_kernel(name, target)),
                      flush=True)
            except KernelRefused as e:
                ok = False
                print(json.dumps({"kernel": name, "target": target, "refused": str(e)}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
