#!/usr/bin/env python3
"""Split (CED) vs exact prefill: FLOPs from XLA cost analysis, wall time, and accuracy.

- FLOPs (default; compile only, no weights): both prefills lowered over abstract parameters with
  bf16 weights of the real shapes (`cost.arithmetic_config`) for one prompt on an empty cache
  whose capacity is the prompt length. The MoE's grouped path uses `lax.ragged_dot`, which XLA's
  CPU lowering computes densely over every expert group; its cost is replaced by the routed
  rows' arithmetic (`cost.prefill_flops`), and the uncorrected ratio is printed as well.
- `--wall`: time both prefills with random weights on the current backend (small configs on CPU).
- `--golden ROOT`: on every golden config (its weights, fast mode): the last-position logit
  difference between split and exact prefill, argmax agreement, whether the encoder and
  first-decoder-layer caches/top-k/pool are identical, and the later index sources' top-k
  overlap, on the golden token stream and on longer random prompts.

    python bench/prefill.py --lengths 65536 --json prefill.json
    python bench/prefill.py --config tiny-noengram --lengths 64,128 --wall --no-flops
    python bench/prefill.py --golden ../shared/golden --no-flops
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="v41-flash", help="preset name or config path (default v41-flash)")
    p.add_argument("--lengths", default="65536", help="comma-separated prompt lengths")
    p.add_argument("--tail", type=int, default=None, help="Graph B tail (default: the window)")
    p.add_argument("--no-flops", action="store_true", help="skip the cost-analysis part")
    p.add_argument("--wall", action="store_true", help="time both prefills with random weights")
    p.add_argument("--golden", metavar="ROOT", help="measure accuracy on the golden configs under ROOT")
    p.add_argument("--random-lengths", default="128,256", help="random prompt lengths for --golden")
    p.add_argument("--only", action="append", help="with --golden: only this config folder (repeatable)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    return p.parse_args(argv)


def flops_rows(cfg, lengths, tail):
    from dsv41_jax.serving import cost

    acfg = cost.arithmetic_config(cfg)
    rows = []
    for n in lengths:
        t = time.perf_counter()
        r = cost.prefill_flops(acfg, n, tail)
        rows.append({"length": n, "split": r["split"]["flops"], "exact": r["exact"]["flops"], "ratio": r["ratio"],
                     "split_reported": r["split"]["reported"], "exact_reported": r["exact"]["reported"],
                     "ratio_reported": r["ratio_reported"], "hlo": r["split"]["hlo"], "moe": r["moe"],
                     "lower_s": time.perf_counter() - t})
        print(f"  length {n}: ratio {r['ratio']:.4f} ({rows[-1]['lower_s']:.0f}s)", file=sys.stderr)
    return rows


def wall_rows(cfg, lengths, tail):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dsv41_jax.serving import split_prefill as sp
    from dsv41_jax.serving.buckets import empty_cache
    from dsv41_jax.serving.random_weights import random_model

    gd, params = nnx.split(random_model(cfg, 0))
    fns = {"split": sp.make_split_prefill(gd, tail=tail), "exact": sp.make_exact_prefill(gd)}
    rows = []
    for n in lengths:
        toks = jnp.asarray(np.random.default_rng(n).integers(0, cfg.vocab_size, (1, n)), jnp.int32)
        row = {"length": n}
        for name, fn in fns.items():
            cache = empty_cache(cfg, 1, n)
            jax.block_until_ready(fn(params, toks, cache)[0])  # compile
            t = time.perf_counter()
            for _ in range(3):
                jax.block_until_ready(fn(params, toks, empty_cache(cfg, 1, n))[0])
            row[f"{name}_s"] = (time.perf_counter() - t) / 3
        row["ratio"] = row["split_s"] / row["exact_s"]
        rows.append(row)
    return rows


def _overlap(a: np.ndarray, b: np.ndarray) -> float:
    """Mean over rows of |A & B| / |B| for -1-padded index sets."""
    vals = []
    for x, y in zip(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])):
        sy = set(y[y >= 0].tolist())
        vals.append(len(set(x[x >= 0].tolist()) & sy) / len(sy) if sy else 1.0)
    return float(np.mean(vals))


def golden_rows(root, random_lengths, tail, only=None):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dsv41_jax.golden.data import discover
    from dsv41_jax.serving import split_prefill as sp
    from dsv41_jax.serving.buckets import capacity_for, empty_cache

    rows = []
    for gc in discover(root):
        if only and gc.name not in only and gc.root.name not in only:
            continue
        cfg = gc.cfg
        try:
            sp.check_splittable(cfg)
        except ValueError as e:
            rows.append({"config": gc.name, "skipped": str(e)})
            continue
        gd, params = nnx.split(gc.load_model())
        split = sp.make_split_prefill(gd, tail=tail, collect_topk=True)
        exact = sp.make_exact_prefill(gd, collect_topk=True)
        hasher = gc.engram_hasher()
        stream = gc.longest_prefill()
        if stream is None:  # the DSpark and vision folders hold no text prefill case
            rows.append({"config": gc.name, "skipped": "no text prefill case in this folder"})
            continue
        prompts = [("golden", np.asarray(stream, np.int64))]
        for n in random_lengths:
            prompts.append((f"random{n}", np.random.default_rng(n).integers(0, cfg.vocab_size, n)))
        for label, toks in prompts:
            ids = None
            if hasher is not None:
                from dsv41_jax.engram.hashing import hash_ids

                ids = jnp.asarray(hash_ids(hasher[0], hasher[1], toks[None]).astype(np.int32))
            t = jnp.asarray(toks[None], jnp.int32)
            cap = capacity_for(cfg, len(toks), 16, maximum=max(len(toks), cfg.max_seq_len))
            sl, sc, sa = split(params, t, empty_cache(cfg, 1, cap), ids)
            el, ec, ea = exact(params, t, empty_cache(cfg, 1, cap), ids)
            d, W = cfg.decoder_start, sl.shape[1]
            same = lambda a, b: all(bool(jnp.array_equal(x, y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
            last = np.asarray(sl[0, -1]), np.asarray(el[0, -1])
            tail_diff = np.abs(np.asarray(sl[0]) - np.asarray(el[0, -W:]))
            row = {"config": gc.name, "prompt": label, "length": int(len(toks)), "tail": int(W),
                   "last_max_abs_diff": float(np.max(np.abs(last[0] - last[1]))),
                   "last_rel_diff": float(np.max(np.abs(last[0] - last[1])) / np.max(np.abs(last[1]))),
                   "last_argmax_equal": bool(np.argmax(last[0]) == np.argmax(last[1])),
                   "tail_argmax_agreement": float(np.mean(np.argmax(np.asarray(sl[0]), -1) == np.argmax(np.asarray(el[0, -W:]), -1))),
                   "tail_max_abs_diff": float(tail_diff.max()),
                   "global_caches_identical": all(same(sc[p], ec[p]) for p in ("compressed", "index_keys", "compressor")),
                   "decoder_start_topk_identical": same(sa["topk"][d], ea["topk"][d][:, -W:]),
                   "pool_identical": same(sa["pool"], ea["pool"][:, -W:]),
                   "later_topk_overlap": {str(l): {"last": _overlap(np.asarray(sa["topk"][l][:, -1]), np.asarray(ea["topk"][l][:, -1])),
                                                   "tail_mean": _overlap(np.asarray(sa["topk"][l]), np.asarray(ea["topk"][l][:, -W:]))}
                                          for l in cfg.index_source_layers if l > d}}
            rows.append(row)
            print(f"  {gc.name} {label}: last max|diff| {row['last_max_abs_diff']:.4g}", file=sys.stderr)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    from dsv41_jax.config import ModelConfig

    cfg = ModelConfig.load(args.config)
    lengths = [int(x) for x in args.lengths.split(",")]
    out = {"config": args.config, "tail": args.tail or cfg.window_size}
    if not args.no_flops:
        out["flops"] = flops_rows(cfg, lengths, args.tail)
        print(f"prefill FLOPs, {args.config} (cost analysis, bf16 weights of the real shapes, MoE ragged_dot corrected)")
        print(f"{'length':>8} {'split TFLOP':>12} {'exact TFLOP':>12} {'ratio':>7} {'ratio (uncorrected)':>20}")
        for r in out["flops"]:
            print(f"{r['length']:>8} {r['split'] / 1e12:12.2f} {r['exact'] / 1e12:12.2f} {r['ratio']:7.4f} {r['ratio_reported']:20.4f}")
    if args.wall:
        out["wall"] = wall_rows(cfg, lengths, args.tail)
        print(f"prefill wall time, {args.config}, random weights, backend {__import__('jax').default_backend()}")
        for r in out["wall"]:
            print(f"  length {r['length']:>8}: split {r['split_s'] * 1e3:9.1f} ms  exact {r['exact_s'] * 1e3:9.1f} ms  ratio {r['ratio']:.3f}")
    if args.golden:
        out["golden"] = golden_rows(args.golden, [int(x) for x in args.random_lengths.split(",")], args.tail, args.only)
        print("split vs exact prefill accuracy (fast mode)")
        for r in out["golden"]:
            if "skipped" in r:
                print(f"  {r['config']}: skipped ({r['skipped']})")
                continue
            ov = ", ".join(f"L{l} {v['last']:.2f}/{v['tail_mean']:.2f}" for l, v in r["later_topk_overlap"].items())
            print(f"  {r['config']:>11} {r['prompt']:>10} N={r['length']:<4} last max|diff| {r['last_max_abs_diff']:8.4f} "
                  f"(rel {r['last_rel_diff']:.3f}) argmax {'=' if r['last_argmax_equal'] else '!='} tail-argmax "
                  f"{r['tail_argmax_agreement']:.2f} | global {r['global_caches_identical']} topk/pool "
                  f"{r['decoder_start_topk_identical']}/{r['pool_identical']} | later top-k overlap last/tail {ov}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
