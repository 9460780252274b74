#!/usr/bin/env python3
"""One prepared accelerator run: kernel checks, the kernel roofline table and model-level timings.

    python bench/device_suite.py --json suite.json            # on the device (sized for < 4 min on an H200)
    python bench/device_suite.py --only decode --json s.json  # one section
    python bench/device_suite.py --tiny --json s.json         # end to end on CPU, tiny shapes (CI)

Sections (in order; `--only` repeats):
- `kernels`: the compiled Pallas kernels against their XLA references (`pallas_kernels/common/
  device_checks.py`, the checks pallas_kernels/common/test_gpu_kernels.py runs). With --tiny they run interpreted at small shapes.
- `roofline`: `bench/kernels.py`'s table (kernel time, bytes moved, fraction of the copy roof).
- `prefill`: on a reduced-depth, full-width model (4 layers of the v41-flash shapes, random weights
  in the stored formats), split vs exact prefill wall time at 16K and 64K prompts.
- `decode`: decode step time at B=1 and B=64, at 4K and 1M context; the caches are filled with
  random entries (not prefilled).
- `layer`: one layer's decode latency against its HBM floor: the bytes the layer must read
  (its weights plus the cache rows it attends to) over the measured device-to-device copy
  bandwidth.

The JSON is rewritten after every section, so a crash keeps what was measured. A section that
fails (a kernel that does not compile, an out-of-memory) is recorded with its error, the run
goes on to the next section, and the exit status is 1: nothing is skipped silently.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import pathlib
import sys
import time
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

SECTIONS = ("kernels", "roofline", "prefill", "decode", "layer")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", action="append", choices=SECTIONS, help="run only this section (repeatable)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on whatever backend (CPU: kernels interpreted)")
    p.add_argument("--json", metavar="PATH", help="write the results here (after every section)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per measurement (default 5, tiny 1)")
    return p.parse_args(argv)


def _time(fn, *args, steps: int) -> float:
    out = fn(*args)
    jax.block_until_ready(out)
    t = time.perf_counter()
    for _ in range(steps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t) / steps


def suite_config(tiny: bool):
    """4 layers with every compressed role at the v41-flash widths (or the tiny preset's)."""
    from dsv41_jax.config import ModelConfig

    base = ModelConfig.tiny(engram_layer_ids=()) if tiny else ModelConfig.preset("v41-flash")
    return base.replace(n_layers=4, compress_ratios=(0, 4, 1, 1), kv_source_layers=(1, 2),
                        index_source_layers=(1, 2, 3), candidate_source_layer=2, engram_layer_ids=(),
                        n_mtp_layers=0, max_seq_len=(256 if tiny else 1 << 20))


def random_cache(cfg, batch: int, context: int, seed: int = 0) -> dict:
    """A cache at `context` positions whose rows are random bytes in the stored formats."""
    from dsv41_jax.serving.buckets import empty_cache

    cache = empty_cache(cfg, batch, context)
    rng = np.random.default_rng(seed)

    def fill(a):
        if a.dtype == jnp.uint8:
            return jnp.asarray(rng.integers(0, 256, a.shape, dtype=np.uint8) & 0x77 | 0x08 * (a.ndim > 2))
        if a.dtype == jnp.int32:
            return a
        return jnp.asarray(rng.standard_normal(a.shape) * 0.1, a.dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a

    cache = jax.tree.map(fill, cache)
    cache["length"] = jnp.full((batch,), context - 2, jnp.int32)
    cache["published"] = jnp.full((batch,), -1, jnp.int32)
    return cache


def section_kernels(tiny: bool, steps: int) -> dict:
    from pallas_kernels.common import device_checks

    backend = jax.default_backend()
    platform = "gpu" if backend == "gpu" else "tpu"
    small = dict(sparse_attention=dict(B=1, S=1, H=2, D=64, W=8, G=32, K=8), indexer=dict(B=1, S=2, Hi=4, Di=64, G=40),
                 grouped_gemm=dict(E=4, N=64, K=128, M=16), fp8_gemm=dict(M=8, N=128, K=128))
    out = {}
    for name, check in device_checks.CHECKS.items():
        t = time.perf_counter()
        check(platform, interpret=(backend == "cpu"), **(small[name] if tiny else {}))  # raises on mismatch
        out[name] = {"ok": True, "seconds": time.perf_counter() - t}
    return out


def section_roofline(tiny: bool, steps: int) -> dict:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import kernels as kernel_bench

    res = kernel_bench.run(kernel_bench.KERNELS, quick=tiny, interpret=False, reps=steps)
    errors = [(r["kernel"], impl, r[impl]["error"]) for r in res["results"] for impl in ("xla", "pallas")
              if isinstance(r.get(impl), dict) and "error" in r[impl]]
    if errors:
        raise RuntimeError(f"roofline: {len(errors)} case(s) failed, first: {errors[0]}")
    return res


@functools.lru_cache(maxsize=2)
def _model(cfg):
    """(graphdef, params) with random weights in the stored formats, shared by the model sections."""
    from flax import nnx

    from dsv41_jax.serving.random_weights import random_model

    return nnx.split(random_model(cfg, 0))


def section_prefill(tiny: bool, steps: int) -> dict:
    from dsv41_jax.runtime import Runtime
    from dsv41_jax.serving import split_prefill as sp
    from dsv41_jax.serving.buckets import empty_cache

    cfg = suite_config(tiny)
    gd, params = _model(cfg)
    rt = Runtime(impl="auto")
    split, exact = sp.make_split_prefill(gd, rt), sp.make_exact_prefill(gd, rt)
    out = []
    for n in ((64, 128) if tiny else (16384, 65536)):
        toks = jnp.ones((1, n), jnp.int32)
        cache = empty_cache(cfg, 1, n)
        row = {"prompt": n}
        for name, fn in (("split_s", split), ("exact_s", exact)):
            row[name] = _time(lambda: fn(params, toks, cache)[0], steps=steps)
        row["speedup"] = row["exact_s"] / row["split_s"]
        out.append(row)
        print(f"prefill {n}: split {row['split_s'] * 1e3:.1f} ms, exact {row['exact_s'] * 1e3:.1f} ms", flush=True)
    return {"rows": out}


def _decode_step(gd, rt):
    from flax import nnx

    from dsv41_jax.runtime import COMPILER_OPTIONS
    from dsv41_jax.serving.split_prefill import decode_plan, decode_step

    @functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS)
    def step(params, tokens, cache):
        logits, cache, _ = decode_step(nnx.merge(gd, params), tokens, cache, decode_plan(rt))
        return logits[:, -1], cache

    return step


def section_decode(tiny: bool, steps: int) -> dict:
    from dsv41_jax.runtime import Runtime

    cfg = suite_config(tiny)
    gd, params = _model(cfg)
    step = _decode_step(gd, Runtime(impl="auto"))
    out = []
    for ctx in ((64, 256) if tiny else (4096, 1 << 20)):
        for B in ((1, 2) if tiny else (1, 64)):
            cache = random_cache(cfg, B, ctx)
            toks = jnp.ones((B, 1), jnp.int32)
            t = _time(lambda: step(params, toks, cache)[0], steps=steps)
            out.append({"context": ctx, "batch": B, "step_s": t, "tokens_per_s": B / t})
            print(f"decode ctx {ctx} B {B}: {t * 1e3:.2f} ms/step", flush=True)
    return {"rows": out}


def section_layer(tiny: bool, steps: int) -> dict:
    """Layer 2 (Full ratio 1, the densest read) alone, at the longest decode context, B=1."""
    from flax import nnx

    from dsv41_jax.runtime import Runtime
    from dsv41_jax.model import block as body
    from dsv41_jax.serving.split_prefill import decode_plan

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import kernels as kernel_bench

    cfg = suite_config(tiny)
    gd, params = _model(cfg)
    rt = Runtime(impl="auto")
    ctx, layer = (256 if tiny else 1 << 20), 2
    cache = random_cache(cfg, 1, ctx)
    h = jnp.ones((1, 1, cfg.hc_mult, cfg.dim), jnp.bfloat16)
    pre = jnp.full((1, 1, cfg.hc_mult), 1.0 / cfg.hc_mult, jnp.float32)

    @jax.jit
    def one(params, h, pre, cache):
        model = nnx.merge(gd, params)
        plan = dataclasses.replace(decode_plan(rt), writes="window")
        span = body.Span.at(cache["length"], 1)
        return body.run_layers(model, body.LayerState.first(h, pre, body.QuantStore(cfg, cache)), span, plan,
                               range(layer, layer + 1))[0].h

    t = _time(lambda: one(params, h, pre, cache), steps=steps)
    weights = sum(int(a.nbytes) for a in jax.tree.leaves(nnx.state(nnx.merge(gd, params).layers[layer])))
    k = min(cfg.index_topk, ctx)
    row = lambda c: sum(int(a.nbytes) // int(a.shape[1]) for a in c)  # bytes per cached row (batch 1)
    cache_bytes = (cfg.window_size * row(cache["window"][layer]) + k * row(cache["compressed"][f"layer{layer}"])
                   + ctx * row(cache["index_keys"][f"layer{layer}"]))
    roof = kernel_bench.copy_roof(tiny, steps)
    floor = (weights + cache_bytes) / roof
    print(f"layer {layer} decode: {t * 1e6:.1f} us; HBM floor {floor * 1e6:.1f} us ({(weights + cache_bytes) / 1e6:.1f} MB"
          f" at {roof / 1e9:.0f} GB/s)", flush=True)
    return {"layer": layer, "context": ctx, "seconds": t, "bytes": weights + cache_bytes, "weight_bytes": weights,
            "cache_bytes": cache_bytes, "copy_GBps": roof / 1e9, "floor_s": floor, "fraction_of_floor": floor / t}


def main(argv=None) -> int:
    args = parse_args(argv)
    steps = args.steps or (1 if args.tiny else 5)
    result = {"backend": jax.default_backend(), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "tiny": args.tiny, "sections": {}}
    failed = []
    for name in SECTIONS:
        if args.only and name not in args.only:
            continue
        print(f"[suite] {name}", flush=True)
        t = time.perf_counter()
        try:
            result["sections"][name] = {"ok": True, **globals()[f"section_{name}"](args.tiny, steps)}
        except Exception as err:  # record, keep the figures of the other sections, fail at the end
            failed.append(name)
            result["sections"][name] = {"ok": False, "error": f"{type(err).__name__}: {err}",
                                        "traceback": traceback.format_exc()}
            print(f"[suite] {name} FAILED: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        result["sections"][name]["wall_s"] = time.perf_counter() - t
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(result, indent=1, default=float))
    if failed:
        print(f"[suite] failed sections: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
