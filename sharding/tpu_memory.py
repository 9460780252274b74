"""What a compiled program needs of a TPU chip's HBM, and which of the compiler's figures says so.

`memory_analysis()` of an XLA:TPU executable gives two kinds of figure per device:

- the sizes of its buffer assignment: arguments, outputs, the part of the outputs aliased to
  (donated) arguments, temporaries and generated code. XLA's header
  (xla/pjrt/compiled_memory_stats.h) states that a device needs at least their sum, code +
  arguments + outputs - aliased + temporaries: the "summed" figure here. Open-source XLA fills
  `temp_size_in_bytes` with the size of the one preallocated temporary buffer (every temporary
  packed into it by the heap simulator, `PopulateBufferStatsFromAllocations` in
  xla/pjrt/pjrt_executable.cc); libtpu's is larger than that buffer on the training step (see
  `python -m sharding.tpu_memory`);
- `peak_memory_in_bytes`: the most bytes live at once, arguments included, by the heap
  simulation of that buffer assignment (`ComputePeakMemory` of the buffer assignment in the
  open-source backends), without the generated code.

Which one the TPU compiler enforces is settled by experiment (`probe`, `main`): small programs on
one v5p chip whose arguments and temporaries are known, brought to either side of the limit the
compiler refuses at ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for
HLO temporaries (...G) exceeds available HBM (95.74G)").
"""
from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.common import tpu_compile

GiB = 2 ** 30


def memory_figures(compiled) -> dict:
    """Per-device bytes of a compiled program: memory_analysis()'s sizes, the summed figure, the
    compiler's own peak and `fit` (the figure a verdict compares with the chip's HBM: the
    compiler's peak plus the generated code, which the peak leaves out)."""
    mem = compiled.memory_analysis()
    d = {k: int(getattr(mem, f"{k}_size_in_bytes", 0) or 0)
         for k in ("argument", "output", "alias", "temp", "generated_code")}
    d["summed"] = d["argument"] + d["output"] - d["alias"] + d["temp"] + d["generated_code"]
    d["compiler_peak"] = int(getattr(mem, "peak_memory_in_bytes", 0) or 0)
    d["fit"] = d["compiler_peak"] + d["generated_code"]
    return d


def _held_at_once(k: int):
    """A program whose `k` temporaries, each the size of its second argument, are live at once
    (an optimization barrier takes them together), beside its first argument."""
    def fn(x, s):
        ts = lax.optimization_barrier([s * (i + 2.0) for i in range(k)])
        return x.sum() + sum(t.sum() for t in ts)
    return fn


def probe(arg_bytes: int, temp_bytes: int, k: int = 4, target: str = "v5p") -> dict:
    """Compile `_held_at_once(k)` for one chip of `target` with an argument of `arg_bytes` and a
    seed of `temp_bytes` (an argument too) whose k copies are the temporaries: the compiler's
    figures, or its refusal (`refused`: the message)."""
    sharding = jax.sharding.SingleDeviceSharding(tpu_compile.topology(target).devices[0])
    args = [jax.ShapeDtypeStruct((n // 4,), jnp.float32, sharding=sharding) for n in (arg_bytes, temp_bytes)]
    out = {"arguments": arg_bytes + temp_bytes, "temporaries": k * temp_bytes}
    try:
        compiled = jax.jit(_held_at_once(k)).lower(*args).compile()
    except Exception as e:  # noqa: BLE001 (XLA:TPU's RESOURCE_EXHAUSTED: what the experiment looks for)
        return {**out, "refused": str(e).splitlines()[0]}
    return {**out, "refused": None, **memory_figures(compiled)}


# live arguments + temporaries (GiB) on either side of the limit XLA:TPU (libtpu 0.0.42) refuses at
# on one v5p chip: "exceeds available HBM (95.74G)", G = GiB (95.74 GiB = 102.80 GB)
BRACKET_GIB = (95.70, 95.78)
PIECE = GiB // 4  # the seed, and each of the 3 temporaries made from it


def main(argv=None) -> int:
    """One JSON line per probe: live arguments + temporaries just under and just over the limit."""
    argv = sys.argv[1:] if argv is None else argv
    target = argv[0] if argv else "v5p"
    for total in BRACKET_GIB:
        arg = int(round((total * GiB - 4 * PIECE) / 2 ** 22)) * 2 ** 22
        print(json.dumps({"probe": f"live {total} GiB", **probe(arg, PIECE, k=3, target=target)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
