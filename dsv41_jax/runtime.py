"""Runtime switches that change how the model computes, not what it is."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import jax

# Every jit of the model compiles with these: XLA's excess precision would keep bf16 intermediates in
# f32 and so move the rounding points that decide FP4 roundings and the indexer's top-k, which are
# model semantics (docs/ARCHITECTURE.md "Where each number format applies").
COMPILER_OPTIONS = {"xla_allow_excess_precision": False}
# Exact mode (float64: CPU or GPU) also takes XLA CPU's memory-minimizing schedule. The default one, which
# favours concurrency, runs every parameter-only operation at the program's start, so the float64 copies of
# every layer's weights that exact mode's GEMMs read are made before layer 0 runs and held until used: a
# 1040-token prefill of five released-width layers needs 12.2 GB of temporaries, 3.6 GB with this (docs/NUMERICS.md
# "At the released width"). A schedule orders the same operations, so no rounding moves.
EXACT_COMPILER_OPTIONS = {**COMPILER_OPTIONS, "xla_cpu_enable_concurrency_optimized_scheduler": False}


def compiler_options(mode: str) -> dict:
    """The jit compiler options of a model step in numerics `mode` ("fast" or "exact")."""
    return EXACT_COMPILER_OPTIONS if mode == "exact" else COMPILER_OPTIONS


@dataclass(frozen=True)
class Runtime:
    """Static (hashable) options threaded through every forward.

    mode: "fast" accumulates dots in fp32 (production); "exact" computes every dot in float64
      and rounds once, mirroring the golden oracle (needs `jax.enable_x64(True)`).
    impl: "xla" plain jnp, "pallas" the kernels in `pallas_kernels/` (sparse sink attention, the
      indexer scores and the routed-expert GEMMs), "auto" the kernels on TPU/GPU and plain jnp on CPU.
    index_k_quirk: reproduce the reference's index-key publishing bug (docs/REFERENCE.md §6); False = intended.
    interpret: run the Pallas kernels in the Pallas interpreter. None (default): exactly when the
      default backend is the CPU, so impl="pallas" works everywhere.
    check_finite: the runtime NaN/inf guard. The attention then zeroes only rows that have no
      valid key (masked), not rows whose scores are NaN/inf, so those reach the logits, and
      `Generator` raises naming the position. Off (default) the graph is exactly the unguarded
      one; on the Pallas attention kernels the guard is the logits check alone.
    fp8_kernel: with impl="pallas" in fast mode, the dense FP8 linears run the FP8 block GEMM kernel
      (it reads the stored E4M3 tiles; the XLA math dequantizes each whole weight per call). None
      (default): when the kernels are compiled, not interpreted: interpreted, the kernel dequantizes
      in software as the XLA math does and only adds compile time (55 kernels in the tiny model).
    scan_layers: run each run of consecutive layers that compile to the same body (`model.block.layer_runs`)
      as one `jax.lax.scan`, so a program's compile time grows with the layer kinds, not the layers;
      False unrolls every layer. The same body and the same numbers either way (held bitwise by
      tests/model/test_layer_scan.py).

    Exact mode with impl="pallas": the interpreted kernels accumulate in float64 at the oracle's
    rounding points (pallas_kernels/README.md, "Exact mode"); compiled kernels (interpret False)
    cannot compute in float64, so exact mode then runs the attention and indexer references.
    """

    mode: Literal["fast", "exact"] = "fast"
    impl: Literal["xla", "pallas", "auto"] = "xla"
    index_k_quirk: bool = False
    interpret: bool | None = None
    check_finite: bool = False
    fp8_kernel: bool | None = None
    scan_layers: bool = True

    def __post_init__(self):
        if self.mode not in ("fast", "exact"):
            raise ValueError(f"Runtime.mode must be 'fast' or 'exact', got {self.mode!r}")
        if self.impl not in ("xla", "pallas", "auto"):
            raise ValueError(f"Runtime.impl must be 'xla', 'pallas' or 'auto', got {self.impl!r}")
        if self.check_finite not in (True, False):
            raise ValueError(f"Runtime.check_finite must be True or False, got {self.check_finite!r}")
        if self.interpret not in (None, True, False):
            raise ValueError(f"Runtime.interpret must be None, True or False, got {self.interpret!r}")
        if self.fp8_kernel not in (None, True, False):
            raise ValueError(f"Runtime.fp8_kernel must be None, True or False, got {self.fp8_kernel!r}")
        if self.scan_layers not in (True, False):
            raise ValueError(f"Runtime.scan_layers must be True or False, got {self.scan_layers!r}")

    def resolved(self) -> "Runtime":
        """This runtime with what depends on the backend decided: impl "xla" or "pallas", interpret and
        fp8_kernel True or False (what `model.plan.Plan` holds)."""
        return Runtime(mode=self.mode, impl=self.resolved_impl(), index_k_quirk=self.index_k_quirk,
                       interpret=self.resolved_interpret(), check_finite=self.check_finite,
                       fp8_kernel=self.resolved_fp8_kernel(), scan_layers=self.scan_layers)

    def resolved_fp8_kernel(self) -> bool:
        """Whether the dense FP8 linears run the FP8 block GEMM kernel (see `fp8_kernel`)."""
        if self.resolved_impl() != "pallas" or self.mode != "fast":
            return False
        return not self.resolved_interpret() if self.fp8_kernel is None else self.fp8_kernel

    def resolved_impl(self) -> str:
        """"xla" or "pallas": what impl="auto" means on this backend."""
        if self.impl == "auto":
            return "pallas" if jax.default_backend() in ("tpu", "gpu") else "xla"
        return self.impl

    def resolved_interpret(self) -> bool:
        """Whether the kernels run interpreted (None: on the CPU backend)."""
        return jax.default_backend() == "cpu" if self.interpret is None else bool(self.interpret)

    def kernel_mode(self) -> str | None:
        """The numerics a Pallas kernel of the attention/indexer path should run, or None when that
        path must use its jnp reference (exact mode needs the interpreter's float64)."""
        if self.resolved_impl() != "pallas":
            return None
        if self.mode == "exact" and not self.resolved_interpret():
            return None
        return self.mode

    def kv_words(self) -> bool:
        """Whether a cache this runtime serves holds its KV rows as the TPU kernels' 32-bit word view
        (`model.cache.cache_form`): when the attention and indexer kernels run and they are the TPU
        kernels (compiled, or interpreted on the CPU), which read words; the GPU kernels read bytes."""
        return self.kernel_mode() is not None and jax.default_backend() not in ("gpu", "cuda", "rocm")
