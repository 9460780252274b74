"""Every Pallas TPU kernel compiles through Mosaic (libtpu's compiler, no TPU needed) for v5e, v6e and v5p.

`jax.export` (test_lowering.py) stops before Mosaic; this compiles for real chips of each generation,
so Mosaic's VMEM, tiling and layout checks run. The compiles run in one child process: libtpu aborts
its process on a failed internal check, and the child's last line then names the kernel.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from pallas_kernels.common import tpu_compile

pytestmark = pytest.mark.skipif(tpu_compile.libtpu_missing() is not None,
                                reason=str(tpu_compile.libtpu_missing()))
ROOT = pathlib.Path(__file__).resolve().parents[1]
# the flops each kernel's CostEstimate declares at mosaic_check's default dims, written out here:
# without the estimate XLA's cost model counts a Mosaic call as free
DECLARED_FLOPS = {
    "sparse_sink_attention": 4 * 2 * 64 * (128 + 512) * 512,  # B*S rows x H x keys x D, scores and values
    "indexer_scores": 2 * 1 * 1024 * (2 * 32 * 128 + 2 * 32),  # B x S queries x G keys
    "grouped_fp4_gemm": None,  # a work-list bound that depends on the routing: checked below as > 0
    "fp8_block_gemm": 2 * 16 * 1024 * 4096,  # rows padded to 16
}


def _child(*targets) -> list[dict]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), *sys.path]),
               **tpu_compile.ENV)
    proc = subprocess.run([sys.executable, "-m", "pallas_kernels.common.mosaic_check", *targets], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    lines = [json.loads(ln) for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode not in (0, 1):
        last = lines[-1] if lines else {}
        pytest.fail(f"the TPU compiler stopped its process (exit {proc.returncode}) compiling {last}: "
                    f"{proc.stderr[-1500:]}")
    return [ln for ln in lines if "compiling" not in ln]


def test_every_kernel_compiles_for_v5e_v6e_v5p():
    results = _child(*tpu_compile.KERNEL_TARGETS)
    refused = [r["refused"] for r in results if "refused" in r]
    assert not refused, "\n".join(refused)
    done = {(r["kernel"], r["target"]): r for r in results}
    from pallas_kernels.common.mosaic_check import KERNELS

    assert set(done) == {(k, t) for k in KERNELS for t in tpu_compile.KERNEL_TARGETS}
    for (kernel, target), r in done.items():
        assert r["mosaic_calls"] == [f"{kernel}_tpu"], (kernel, target, r["mosaic_calls"])
        declared = DECLARED_FLOPS[kernel]
        assert r["flops"] >= (declared or 1), (kernel, target, r["flops"], declared)


def test_kernels_per_device_on_a_mesh_compile_as_mosaic_calls_of_their_shard():
    """What a sharded step runs (`partition.per_device`): each kernel inside a shard_map on a 2x2 v6e mesh, batch
    4 over "data", the 64 attention heads over "tensor": one Mosaic call per program, computing a device's share."""
    results = _child("--mesh", "v6e:2x2")
    refused = [r["refused"] for r in results if "refused" in r]
    assert not refused, "\n".join(refused)
    got = {r["kernel"]: r for r in results}
    from pallas_kernels.common.mosaic_check import MESH_KERNELS

    assert set(got) == set(MESH_KERNELS)
    for name, r in got.items():
        assert r["mosaic_calls"] == [f"{name}_tpu"], r
    # B=4 over data=2: 2 rows per device; the attention's 64 heads over tensor=2: 32 (its output planes [B, 8, H, D/8])
    assert got["sparse_sink_attention"]["kernel_results"] == ["bf16[2,8,32,64]"]
    assert got["indexer_scores"]["kernel_results"] == ["f32[2,1,1024]"]  # [B/2, S, G]: the heads summed in the kernel
    assert got["fp8_block_gemm"]["kernel_results"] == ["f32[16,1024]"]  # 8 rows over data=2, padded to 16


@pytest.mark.slow  # ~100 s on 2 cores: the compiler works through the 32768-slot gather before it refuses
def test_a_shape_mosaic_must_refuse_is_refused_naming_the_kernel():
    """top-k 32768 of 512-dim rows: the kernel's double-buffered gather needs 2 x 32768 x 512 B = 32 MiB of
    VMEM for the compressed rows alone, more than a v5e core has (16 MiB scoped, 128 MiB physical on v6e)."""
    code = ("from pallas_kernels.common.mosaic_check import compile_kernel, KernelRefused\n"
            "try:\n compile_kernel('sparse_sink_attention', 'v5e', B=1, G=32768, K=32768)\n"
            "except KernelRefused as e:\n print('REFUSED', e)\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), *sys.path]),
               **tpu_compile.ENV)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout
    assert out.startswith("REFUSED"), (proc.returncode, out, proc.stderr[-1500:])
    assert "sparse_sink_attention with B=1, G=32768, K=32768" in out and "for v5e" in out, out
