"""Prefill piece shapes: programs a server compiles and the padding they cost, host arithmetic only.

    python bench/prefill_pieces.py [--chunk 512] [--max-len 8192 65536] [--prompts 20000] [--json out.json]

For each max model length, draws prompt lengths log-uniformly in 1..max-1 (seed 0) and cuts each
with `serving.steps.pieces` (fast numerics: a few shapes, the last piece padded) and with the
binary remainders the engine used before (exact numerics still does). Prints, per scheme: the
piece shapes (one prefill program each, per path), tokens computed / tokens served over the whole
mix (token-weighted), the mean of that ratio per prompt, and the pieces (device calls) per prompt.
"""
from __future__ import annotations

import argparse
import json

import numpy as np

from dsv41_jax.serving.steps import piece_set, pieces


def measure(chunk: int, max_len: int, n_prompts: int, padded: bool) -> dict:
    rng = np.random.default_rng(0)
    lengths = np.exp(rng.uniform(0, np.log(max_len - 1), n_prompts)).astype(int).clip(1, max_len - 1)
    cut = [pieces(int(n), chunk, padded) for n in lengths]
    computed = np.array([sum(c) for c in cut])
    calls = np.array([len(c) for c in cut])
    return {"scheme": "padded" if padded else "binary", "max_len": max_len, "shapes": piece_set(chunk, padded),
            "computed_per_served": float(computed.sum() / lengths.sum()),
            "mean_ratio_per_prompt": float(np.mean(computed / lengths)),
            "calls_mean": float(calls.mean()), "calls_max": int(calls.max())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--max-len", type=int, nargs="+", default=[8192, 65536])
    ap.add_argument("--prompts", type=int, default=20000)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)
    rows = [measure(args.chunk, m, args.prompts, padded) for m in args.max_len for padded in (False, True)]
    print("| max len | scheme | piece shapes | computed / served | mean per prompt | calls mean / max |")
    print("|---:|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['max_len']} | {r['scheme']} | {len(r['shapes'])}: {', '.join(map(str, r['shapes']))} | "
              f"{r['computed_per_served']:.3f} | {r['mean_ratio_per_prompt']:.2f} | {r['calls_mean']:.1f} / {r['calls_max']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
