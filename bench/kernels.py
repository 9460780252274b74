"""Benchmark the Pallas kernels against their XLA paths at V4.1-Flash shapes; print a table, write JSON.

    python bench/kernels.py [--quick] [--json PATH] [--interpret] [--kernels attention,indexer,...]

For every kernel and shape it reports the median time of each implementation, the bytes the
kernel must move (cache rows / weights it reads, plus activations and outputs), the fraction of
the roof those bytes reach, and the speed-up of the kernel over the XLA path. The roof is the
device-to-device copy bandwidth (read + write of a large array) measured in the same run.

On CPU the Pallas kernels only run in the interpreter, which says nothing about speed, so the
CPU run times the XLA path only unless --interpret is given. --quick uses tiny shapes (a CI smoke
test that finishes in seconds). Inputs are random bytes in the cache / weight formats (not
quantized real values): timing does not depend on the values, and random bytes let 1M-token
caches be made quickly. Every number printed comes from this run; nothing is estimated.

Not yet measured on hardware: no H200 (or any GPU/TPU) was available to the sessions that wrote
and wired the kernels, so there is no device table yet (docs/PERFORMANCE.md is to receive it; the
issue-3 targets are sparse decode attention >= 60 % of the roof at B=64 and faster than XLA at
every batch, the expert GEMM >= 50 % of the roof at B=64). Run `python bench/kernels.py --json
kernels.json` on the device (a few device-minutes) and record the table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from dsv41_jax.numerics import kv_layout  # noqa: E402
from pallas_kernels import fp8_block_gemm, grouped_fp4_gemm, indexer_scores, sparse_sink_attention  # noqa: E402
from pallas_kernels.expert_gemm import specs as gemm_specs  # noqa: E402
from pallas_kernels.indexer import specs as indexer_specs  # noqa: E402
from pallas_kernels.sparse_attention import specs as attention_specs  # noqa: E402

KERNELS = ("attention", "indexer", "grouped_gemm", "fp8_gemm")


def _timeit(fn, args, reps: int) -> float:
    """Median wall time in seconds of a jitted call (after one warm-up that compiles)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_roof(quick: bool, reps: int) -> float:
    """Device-to-device copy bandwidth in bytes/s (each byte is read once and written once)."""
    n = (16 if quick else 1024) * 2**20 // 4
    x = jnp.arange(n, dtype=jnp.float32)
    copy = jax.jit(lambda a: a + 0.0)  # a real read+write; jnp.copy may be elided
    seconds = _timeit(copy, (x,), reps)
    return 2 * x.nbytes / seconds


def _random_bytes(key, shape, mask=0xFF, base=0):
    return (jax.random.bits(key, shape, jnp.uint8) & mask) | base


def _attention_inputs(key, B, G, H, D, W, K):
    ks = jax.random.split(key, 8)
    q = jax.random.normal(ks[0], (B, 1, H, D), jnp.bfloat16)
    # E4M3 bytes with exponent <= 7 (no NaN), E8M0 around 2^0, E4M3 scales around 1
    window = kv_layout.WindowKV(jax.lax.bitcast_convert_type(_random_bytes(ks[1], (B, W, D), 0xBF), jnp.float8_e4m3fn),
                                _random_bytes(ks[2], (B, W, D // 32), 0x03, 0x7C))
    compressed = kv_layout.CompressedKV(_random_bytes(ks[3], (B, G, D // 2)),
                                        jax.lax.bitcast_convert_type(_random_bytes(ks[4], (B, G, D // 16), 0x07, 0x30),
                                                                     jnp.float8_e4m3fn))
    widx = jnp.broadcast_to(jnp.arange(W, dtype=jnp.int32), (B, 1, W))
    cidx = jnp.sort(jax.random.randint(ks[5], (B, 1, K), 0, G, jnp.int32), axis=-1)
    sink = jax.random.normal(ks[6], (H,), jnp.float32)
    args = (q, window, compressed, widx, cidx, sink)
    bytes_moved = B * (W * (D + D // 32) + K * (D // 2 + D // 16)) + 2 * q.nbytes + widx.nbytes + cidx.nbytes
    return args, bytes_moved


def _indexer_inputs(key, B, G, Hi, Di):
    ks = jax.random.split(key, 6)
    qp = _random_bytes(ks[0], (B, 1, Hi, Di // 2))
    qs = _random_bytes(ks[1], (B, 1, Hi, Di // 32), 0x03, 0x7C)
    keys = kv_layout.IndexKeys(_random_bytes(ks[2], (B, G, Di // 2)), _random_bytes(ks[3], (B, G, Di // 32), 0x03, 0x7C))
    w = jax.random.normal(ks[4], (B, 1, Hi), jnp.float32)
    clen = jnp.full((B, 1), G, jnp.int32)
    bytes_moved = B * G * (Di // 2 + Di // 32) + B * G * 4 + qp.nbytes + qs.nbytes + w.nbytes
    return (qp, qs, keys, w, clen), bytes_moved


def _grouped_inputs(key, tokens, E, top_k, N, K):
    ks = jax.random.split(key, 4)
    experts = jax.random.randint(ks[0], (tokens * top_k,), 0, E)
    sizes = jnp.bincount(experts, length=E).astype(jnp.int32)
    x = jax.random.normal(ks[1], (tokens * top_k, K), jnp.bfloat16)
    wp = _random_bytes(ks[2], (E, N, K // 2))
    ws = _random_bytes(ks[3], (E, N, K // 32), 0x03, 0x7C)
    hit = int(jnp.sum(sizes > 0))
    bytes_moved = hit * N * (K // 2 + K // 32) + x.nbytes + tokens * top_k * N * 4
    return (x, sizes, wp, ws), bytes_moved, hit


def _fp8_inputs(key, M, N, K):
    ks = jax.random.split(key, 3)
    x = jax.random.normal(ks[0], (M, K), jnp.bfloat16)
    w = jax.lax.bitcast_convert_type(_random_bytes(ks[1], (N, K), 0xBF), jnp.float8_e4m3fn)
    s = _random_bytes(ks[2], (-(-N // 32), -(-K // 32)), 0x03, 0x7C)
    return (x, w, s), N * K + s.nbytes + x.nbytes + M * N * 4


def _impls(on_cpu: bool, interpret: bool) -> list[str]:
    return ["xla", "pallas"] if (not on_cpu or interpret) else ["xla"]


def run(kernels, quick: bool, interpret: bool, reps: int) -> dict:
    backend = jax.default_backend()
    on_cpu = backend == "cpu"
    roof = copy_roof(quick, reps)
    results = []
    key = jax.random.PRNGKey(0)

    def measure(name, params, fns, args, bytes_moved, extra=None):
        entry = {"kernel": name, **params, "bytes": int(bytes_moved), **(extra or {})}
        for impl, fn in fns.items():
            try:
                t = _timeit(fn, args, reps)
                entry[impl] = {"time_us": t * 1e6, "GBps": bytes_moved / t / 1e9, "frac_roof": bytes_moved / t / roof}
            except Exception as err:  # report, keep benchmarking the other cases
                entry[impl] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
        if "time_us" in entry.get("xla", {}) and "time_us" in entry.get("pallas", {}):
            entry["speedup"] = entry["xla"]["time_us"] / entry["pallas"]["time_us"]
        results.append(entry)
        print(_row(entry), flush=True)

    kw = lambda impl: dict(impl=impl, interpret=interpret if impl == "pallas" and on_cpu else None)  # noqa: E731
    print(f"backend {backend} ({jax.devices()[0].device_kind}); copy roof {roof / 1e9:.1f} GB/s", flush=True)
    print(_header(), flush=True)
    if "attention" in kernels:
        for B, ctx, H, D, W, K in attention_specs.cases(quick):
            key, sub = jax.random.split(key)
            args, nbytes = _attention_inputs(sub, B, ctx, H, D, W, K)
            fns = {impl: jax.jit(lambda q, w, c, wi, ci, s, impl=impl: sparse_sink_attention(
                q, w, c, wi, ci, s, D ** -0.5, **kw(impl))) for impl in _impls(on_cpu, interpret)}
            measure("sparse_attention", {"batch": B, "context": ctx}, fns, args, nbytes)
            del args
    if "indexer" in kernels:
        for B, G, Hi, Di in indexer_specs.cases(quick):
            key, sub = jax.random.split(key)
            args, nbytes = _indexer_inputs(sub, B, G, Hi, Di)
            fns = {impl: jax.jit(lambda *a, impl=impl: indexer_scores(*a, **kw(impl))) for impl in _impls(on_cpu, interpret)}
            measure("indexer_scores", {"batch": B, "context": G}, fns, args, nbytes)
            del args
    if "grouped_gemm" in kernels:
        for tokens, E, top_k, N, K in gemm_specs.cases(quick):
            key, sub = jax.random.split(key)
            args, nbytes, hit = _grouped_inputs(sub, tokens, E, top_k, N, K)
            fns = {impl: jax.jit(lambda *a, impl=impl: grouped_fp4_gemm(*a, **kw(impl))) for impl in _impls(on_cpu, interpret)}
            measure("grouped_fp4_gemm", {"batch": tokens, "N": N, "K": K}, fns, args, nbytes, {"experts_hit": hit})
            del args
    if "fp8_gemm" in kernels:
        for M, N, K in gemm_specs.dense_cases(quick):
            key, sub = jax.random.split(key)
            args, nbytes = _fp8_inputs(sub, M, N, K)
            fns = {impl: jax.jit(lambda *a, impl=impl: fp8_block_gemm(*a, **kw(impl))) for impl in _impls(on_cpu, interpret)}
            measure("fp8_block_gemm", {"batch": M, "N": N, "K": K}, fns, args, nbytes)
            del args
    return {"backend": backend, "device": jax.devices()[0].device_kind, "jax": jax.__version__, "quick": quick,
            "interpret": interpret, "reps": reps, "roof_GBps": roof / 1e9, "results": results}


def _header() -> str:
    return (f"{'kernel':<18} {'shape':<26} {'MB':>9} {'xla us':>10} {'pallas us':>10} "
            f"{'roof% xla':>9} {'roof% pal':>9} {'speedup':>8}")


def _fmt(entry, impl, field, scale=1.0, spec="{:.1f}"):
    value = entry.get(impl, {}).get(field)
    if value is None:
        return "err" if "error" in entry.get(impl, {}) else "-"
    return spec.format(value * scale)


def _row(entry) -> str:
    shape = ", ".join(f"{k}={v}" for k, v in entry.items() if k in ("batch", "context", "N", "K"))
    speed = f"{entry['speedup']:.2f}x" if "speedup" in entry else "-"
    return (f"{entry['kernel']:<18} {shape:<26} {entry['bytes'] / 1e6:>9.2f} {_fmt(entry, 'xla', 'time_us'):>10} "
            f"{_fmt(entry, 'pallas', 'time_us'):>10} {_fmt(entry, 'xla', 'frac_roof', 100):>9} "
            f"{_fmt(entry, 'pallas', 'frac_roof', 100):>9} {speed:>8}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run that finishes in seconds")
    parser.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    parser.add_argument("--interpret", action="store_true",
                        help="on CPU, also run the Pallas kernels in the interpreter (correctness only, not speed)")
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated subset of {','.join(KERNELS)}")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per case (default 10, quick 2)")
    args = parser.parse_args(argv)
    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    unknown = sorted(set(kernels) - set(KERNELS))
    if unknown:
        parser.error(f"unknown kernels {unknown}; choose from {KERNELS}")
    reps = args.reps or (2 if args.quick else 10)
    report = run(kernels, args.quick, args.interpret, reps)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json}")
    failed = [e for e in report["results"] if any("error" in e.get(i, {}) for i in ("xla", "pallas"))]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
