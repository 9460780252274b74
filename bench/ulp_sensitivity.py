"""How far one bf16 ulp carries: the yardstick for fast numerics against the oracle.

    python bench/ulp_sensitivity.py GOLDEN_DIR --config NAME [--tokens N] [--seed S] [--json]

Fast numerics (float32 accumulation) differ from the oracle's rounding by a bf16 ulp here and there;
at the released width `golden-check --numerics fast` finds logit errors of several percent of the
logits' spread even with the oracle's decisions imposed. Is that fast mode's arithmetic, or the
network's? This runs the config's first decode case's prompt (its first N tokens, one prefill call,
the oracle's stored top-k and expert choices imposed, so no decision can differ) three times:
exact numerics; exact numerics again with the stream entering layer 0 nudged by one bf16 ulp (towards
+inf) in one random element per row; and fast numerics. Per layer it prints the relative mean error
(mean |d| / mean |exact|) of each site against the first run, then the logits' errors. Where the
nudged exact run grows as the fast one does, the error is the network's response to a one-ulp
difference (FP8 activation quantization turns it into whole FP8 steps, and each GEMM carries their
RMS), not something fast mode adds. A measurement, not a test: nothing is asserted.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from dsv41_jax.golden import data as golden_data
from dsv41_jax.golden.check import CaseRunner

SITES = ("attn_input", "sparse_attn_out", "attn_output", "ffn_input", "ffn_output")


def _rel(got, ref) -> float:
    got, ref = np.asarray(got).astype(np.float64), np.asarray(ref).astype(np.float64)
    ok = np.isfinite(got) & np.isfinite(ref)
    got, ref = np.where(ok, got, 0.0), np.where(ok, ref, 0.0)
    return float(np.abs(got - ref).mean() / max(np.abs(ref).mean(), 1e-30))


def nudge_one_per_row(stream: np.ndarray, seed: int) -> np.ndarray:
    """stream [1, T, ...] bf16 with one random element of each row moved to the next bf16 value up."""
    flat = np.asarray(stream).reshape(stream.shape[1], -1).copy()
    rows = np.arange(flat.shape[0])
    cols = np.random.default_rng(seed).integers(0, flat.shape[1], flat.shape[0])
    up = np.array(np.inf, ml_dtypes.bfloat16)
    flat[rows, cols] = np.nextafter(flat[rows, cols].astype(ml_dtypes.bfloat16), up)
    return flat.reshape(stream.shape)


def measure(root, config: str, n_tokens: int, seed: int = 0, control: bool = False, log=sys.stderr) -> dict:
    """control: also replay layer 0's exact input unchanged (the replay alone must change nothing)."""
    found = [g for g in golden_data.discover(root) if g.name == config]
    if not found:
        raise SystemExit(f"ulp_sensitivity: no config folder {config!r} under {root} "
                         f"(found: {', '.join(g.name for g in golden_data.discover(root)) or 'none'})")
    gc = found[0]
    cases = [c for c in gc.cases if c["kind"] in ("decode", "dspark_decode")]
    if not cases:
        raise SystemExit(f"ulp_sensitivity: {config} has no decode case (its stored prefill decisions are imposed)")
    case, t = cases[0], gc.case_tensors(cases[0])
    P = case["schedule"][0]["n_tokens"]
    if not 0 < n_tokens <= P:
        raise SystemExit(f"ulp_sensitivity: --tokens must be in 1..{P} (the case's prompt), got {n_tokens}")
    with jax.enable_x64(True):
        exact = CaseRunner(gc)
        fast = copy.copy(exact)  # the same loaded weights, its own compiled steps
        fast.mode, fast._steps = "fast", {}
        tokens = np.asarray(t["tokens"]).astype(np.int64)[:n_tokens]
        sched = [{"start_pos": 0, "n_tokens": n_tokens}]
        forced = [exact.forced_from(t, "select.prefill.", slice(0, n_tokens))]
        runs, traces = {}, {}
        for name in ("exact", "exact, nudged", "fast") + (("exact, replayed",) if control else ()):
            t0 = time.perf_counter()
            runner = fast if name == "fast" else exact
            replay = None
            if name.startswith("exact, "):
                E = traces["exact"]
                h = E["layer0.block_input"] if name == "exact, replayed" else nudge_one_per_row(E["layer0.block_input"], seed)
                replay = {0: (jnp.asarray(h), E["layer0.pre_mix_in"])}
            logits, res = runner.run(tokens, sched, forced_calls=forced, impose=True, collect=True, replay=replay)
            runs[name], traces[name] = logits, res["traces"][0]
            print(f"[ulp] {name}: {time.perf_counter() - t0:.0f} s", file=log, flush=True)
    E = traces["exact"]
    out = {"config": config, "case": case["name"], "tokens": n_tokens, "seed": seed,
           "nudged_input_rel": _rel(nudge_one_per_row(E["layer0.block_input"], seed), E["layer0.block_input"]),
           "sites": [], "logits": {}}
    for l in range(len(gc.cfg.roles)):
        for site in SITES:
            key = f"layer{l}.{site}"
            if key in E:
                out["sites"].append({"site": key, **{n: _rel(traces[n][key], E[key]) for n in ("exact, nudged", "fast")}})
    for n in [n for n in runs if n != "exact"]:
        d = np.abs(runs[n] - runs["exact"])
        out["logits"][n] = {"max_abs": float(d.max()), "mean_abs": float(d.mean()),
                            "argmax_agreement": float(np.mean(runs[n].argmax(-1) == runs["exact"].argmax(-1)))}
    out["logit_std"] = float(np.std(runs["exact"]))
    return out


def format_result(r: dict) -> str:
    rows = [f"{r['config']}/{r['case']}, first {r['tokens']} tokens, the oracle's decisions imposed; layer-0 input "
            f"nudged by one bf16 ulp in one element per row (relative mean {r['nudged_input_rel']:.2g})",
            f"{'relative mean error vs exact':32s} {'exact, nudged':>14s} {'fast':>10s}"]
    rows += [f"{s['site']:32s} {s['exact, nudged']:14.3g} {s['fast']:10.3g}" for s in r["sites"]]
    for n, v in r["logits"].items():
        rows.append(f"logits, {n}: max |d| {v['max_abs']:.3g}, mean |d| {v['mean_abs']:.3g} (logit std "
                    f"{r['logit_std']:.3g}), argmax agreement {v['argmax_agreement']:.3f}")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("root", help="a golden folder (its config folders beside each other)")
    ap.add_argument("--config", required=True, help="the config folder whose first decode case is measured")
    ap.add_argument("--tokens", type=int, default=256, help="the prompt's first N tokens, one prefill call (default 256)")
    ap.add_argument("--seed", type=int, default=0, help="which element of each row is nudged")
    ap.add_argument("--control", action="store_true",
                    help="also replay layer 0's exact input unchanged: its logits must equal the exact run's")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")
    args = ap.parse_args(argv)
    r = measure(args.root, args.config, args.tokens, args.seed, args.control)
    print(json.dumps(r, indent=1) if args.json else format_result(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
