#!/usr/bin/env python3
"""Decode-step cost against context length: FLOPs from XLA cost analysis (compile only, no
weights), and optionally wall time with random weights on whatever backend JAX has.

FLOPs are measured on the engine's lean decode step (`dsv41_jax.serving.split_prefill.decode_step`
on `decode_plan`) over abstract parameters with bf16 weights of the real shapes
(`cost.arithmetic_config`), per distinct layer signature (`cost.decode_flops_by_role`; `--full`
lowers the whole step instead, which agrees to <0.01% and takes minutes). Each context is
checked against:

- the arithmetic count: 2 x active matrix parameters + attention over window and selected
  slots + the indexer term (positions scored x 2 x index heads x index dim);
- growth: from the first context, total growth vs the indexer term. "strict" (the issue's
  criterion) counts only the indexer's dot products, positions scored x 2 x 32 x 128, and
  "rest" is everything else; "measured" uses the decode scoring's own cost-analysis FLOPs per
  position instead (`fast_index.scores_packed`: table key decode + block scale + dot + clamp +
  head sum + mask). The per-position cost of the reference-rounded scoring (`Indexer.scores`,
  what the step used before) is printed for comparison.
- loops and custom calls: the HLO of every lowering is searched for `stablehlo.while` (cost
  analysis counts a loop body once; `cost.loop_probe` shows it) and custom calls (reported as 0).

- `--golden ROOT`: on every golden config (its weights, fast mode), the production lean step
  (`fast_index.scores_packed`) against the lean step with the reference-rounded
  `Indexer.scores` (which equals `model.forward` bitwise), teacher-forced over the tail of the
  golden stream and of a longer random prompt, each path with its own cache: per index source
  the top-k overlap and the share of steps with identical top-k, and the logit differences.

    python bench/decode.py --json decode.json
    python bench/decode.py --config tiny-noengram --wall --contexts 64,128
    python bench/decode.py --golden ../shared/golden --no-flops
    python bench/decode.py --speculative --checkpoint DEMO_OUT/served --json spec.json

- `--speculative`: the DSpark cost table from shapes (one draft + one verification step vs one
  plain step: weight bytes and FLOPs at B=1 and B=8, the break-even acceptance length); with
  `--checkpoint DIR` (a served folder with a trained drafter, e.g. `dsv41 demo`'s `served/`) also
  measured, in one run, at each batch: greedy decoding of held-out prompts (the standard library's
  json and email packages; the demo trains on its top-level modules) on the engine with and
  without speculation: the mean acceptance length, weight bytes read per emitted token (the
  table's step bytes over the tokens a step emits) and wall-clock decode tokens per second (after a
  warm-up run that compiles every program).
- `--stored-weights --mesh SPEC`: the weight traffic per device of the engine's decode step on a
  mesh of fake CPU devices, kernel path, before and after the word views (`bench/mesh_weights.py`):

    python bench/decode.py --contexts 4096 --stored-weights --mesh expert=16 --json mesh_sw.json
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="v41-flash", help="preset name or config path (default v41-flash)")
    p.add_argument("--contexts", default="4096,16384,65536,262144,1048576",
                   help="comma-separated context lengths (cache capacity = context)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--full", action="store_true", help="lower the whole step per context (slow) instead of per role")
    p.add_argument("--stored-weights", action="store_true",
                   help="also report, at the first context, the decode step with the checkpoint's FP8/FP4 weights at "
                        "B=1 and B=64: weight bytes per step on the XLA and the kernel path (from the trace) and "
                        "XLA's cost analysis (FLOPs, bytes accessed) of the XLA path")
    p.add_argument("--mesh", metavar="SPEC",
                   help="with --stored-weights: the engine's mesh decode step's weight traffic per device instead "
                        "(kernel path, before and after the word views; fake CPU devices, e.g. expert=16)")
    p.add_argument("--wall", action="store_true", help="also time the step with random weights (needs memory for them)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per context with --wall")
    p.add_argument("--no-flops", action="store_true", help="skip the cost-analysis table")
    p.add_argument("--golden", metavar="ROOT", help="compare fast and reference-rounded index scoring on the golden configs")
    p.add_argument("--golden-steps", type=int, default=32, help="teacher-forced decode steps per prompt with --golden")
    p.add_argument("--random-length", type=int, default=256, help="random prompt length with --golden")
    p.add_argument("--speculative", action="store_true",
                   help="only the DSpark cost table: one draft + one verification step vs one plain step, "
                        "bytes read and FLOPs at B=1 and B=8, and the break-even acceptance length; with "
                        "--checkpoint also the measured acceptance, bytes per token and tokens/s")
    p.add_argument("--checkpoint", metavar="DIR",
                   help="with --speculative: a checkpoint folder with a trained drafter (dsv41 demo's served/) to "
                        "measure speculation on; its config replaces --config")
    p.add_argument("--num-draft-tokens", type=int, metavar="K",
                   help="with --checkpoint: drafts per step (default the drafter's block minus one, as the demo)")
    p.add_argument("--new-tokens", type=int, default=64, help="with --checkpoint: tokens generated per prompt")
    p.add_argument("--prompts", type=int, default=8, help="with --checkpoint: held-out prompts (at least the largest batch)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    return p.parse_args(argv)


def speculative_rows(cfg, batches=(1, 8), k: int | None = None) -> list[dict]:
    from dsv41_jax.serving.spec_cost import break_even

    rows = []
    for b in batches:
        r = break_even(cfg, b, k)
        rows.append({"batch": b, **r})
    print(f"DSpark draft + verify of {k or cfg.dspark_block_size} drafts vs plain decode (weights read; attention over "
          "the cache not included)")
    print(f"{'batch':>5} {'plain GB':>9} {'draft GB':>9} {'verify GB':>9} {'plain GF':>9} {'draft GF':>9} {'verify GF':>9} "
          f"{'break-even (bytes)':>18} {'(FLOPs)':>8}")
    for r in rows:
        G = 1e9
        print(f"{r['batch']:>5} {r['plain']['bytes'] / G:9.3g} {r['draft']['bytes'] / G:9.3g} {r['verify']['bytes'] / G:9.3g} "
              f"{r['plain']['flops'] / G:9.3g} {r['draft']['flops'] / G:9.3g} {r['verify']['flops'] / G:9.3g} "
              f"{r['break_even_tokens_per_step']['bytes']:18.2f} {r['break_even_tokens_per_step']['flops']:8.2f}")
    return rows


def held_out_prompts(tokenizer, n: int, length: int = 48) -> list[list[int]]:
    """n prompts of `length` tokens after BOS from standard-library packages the demo does not train on
    (it reads the top-level modules, `cli.demo.stdlib_corpus`)."""
    import sysconfig

    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted((root / "json").glob("*.py")) + sorted((root / "email").glob("*.py"))
    out = []
    for f in files:
        ids = tokenizer.encode(f.read_text(encoding="utf-8")[:4 * length], split_special_tokens=True)[:length]
        if len(ids) == length:
            out.append([tokenizer.bos_id] + ids)
        if len(out) == n:
            return out
    raise ValueError(f"found only {len(out)} held-out prompts of {length} tokens in {root}/json and email; ask for fewer")


def measured_speculation(folder, batches, k: int | None, new_tokens: int, n_prompts: int) -> dict:
    """Greedy decoding of the held-out prompts at each batch on two engines (exact prefill, the
    model's default runtime), one with Engine(speculative=k): acceptance length, weight bytes read
    per emitted token (`spec_cost.step_costs`) and decode tokens per second, after a warm-up run."""
    import numpy as np

    from dsv41_jax.checkpoint import load
    from dsv41_jax.serving.engine import Engine, Request
    from dsv41_jax.serving.generate import engram_tables, banned_ids
    from dsv41_jax.serving.sampling import SamplingParams
    from dsv41_jax.serving.spec_cost import step_costs
    from dsv41_jax.serving.speculation import summary
    from dsv41_jax.text.tokenizer import load_tokenizer

    if n_prompts < max(batches):
        raise ValueError(f"--prompts {n_prompts} is fewer than the largest batch {max(batches)}")
    tokenizer = load_tokenizer(folder)
    cfg, model, _ = load(folder, progress=False, config_overrides={"max_batch_size": max(batches)})
    k = cfg.dspark_block_size - 1 if k is None else k
    prompts = held_out_prompts(tokenizer, n_prompts)
    engram = engram_tables(cfg, tokenizer) if cfg.engram_layer_ids else None

    def run(engine, slots):
        """Every prompt, `slots` at a time: (tokens per prompt, decode tokens, decode seconds). All of a
        group are admitted (prefilled) in the first step, so its decode runs from the last first token."""
        tokens, n_dec, secs = [], 0, 0.0
        for g in range(0, len(prompts), slots):
            res = engine.run([Request(list(p), SamplingParams(max_tokens=new_tokens)) for p in prompts[g:g + slots]])
            tokens += [r.tokens for r in res]
            n_dec += sum(len(r.tokens) - 1 for r in res)
            # submitted together (microseconds apart): from the last first token to the last finish
            secs += max(r.timing["total_s"] for r in res) - max(r.timing["time_to_first_token_s"] for r in res)
        return tokens, n_dec, secs

    rows = []
    for b in batches:
        kw = dict(slots=b, max_seq_len=cfg.max_seq_len, exact_prefill=True, banned_ids=banned_ids(cfg, tokenizer),
                  engram=engram)
        row = {"batch": b, "k": k, "prompts": len(prompts), "new_tokens": new_tokens}
        costs = step_costs(cfg, b, k)
        got = {}
        for name, engine in (("plain", Engine(model, **kw)), ("speculative", Engine(model, speculative=k, **kw))):
            run(engine, b)  # warm-up: compiles every program this workload uses
            if engine.K:
                engine.spec_stats.update(dict.fromkeys(engine.spec_stats, 0))
            tokens, n_dec, secs = run(engine, b)
            got[name] = tokens
            row[name] = {"decode_tokens": n_dec, "decode_s": secs, "tokens_per_s": n_dec / secs}
        spec = summary(engine.spec_stats)
        acc = spec["mean_acceptance_length"]
        row["speculative"].update(spec)
        row["acceptance_length"] = acc
        row["plain"]["weight_bytes_per_token"] = costs["plain"]["bytes"] / b
        row["speculative"]["weight_bytes_per_token"] = (costs["draft"]["bytes"] + costs["verify"]["bytes"]) / (b * acc)
        row["speedup"] = row["speculative"]["tokens_per_s"] / row["plain"]["tokens_per_s"]
        row["same_tokens"] = got["plain"] == got["speculative"]
        rows.append(row)
    print(f"measured on {folder} (greedy, {len(prompts)} held-out prompts of 49 tokens, {new_tokens} new tokens each, "
          f"K={k} drafts per step)")
    print(f"{'batch':>5} {'accept len':>10} {'plain B/tok':>12} {'spec B/tok':>12} {'plain tok/s':>11} {'spec tok/s':>10} "
          f"{'speed-up':>8} {'same tokens':>11}")
    for r in rows:
        print(f"{r['batch']:>5} {r['acceptance_length']:10.2f} {r['plain']['weight_bytes_per_token']:12.4g} "
              f"{r['speculative']['weight_bytes_per_token']:12.4g} {r['plain']['tokens_per_s']:11.1f} "
              f"{r['speculative']['tokens_per_s']:10.1f} {r['speedup']:8.2f} {str(r['same_tokens']):>11}")
    return {"checkpoint": str(folder), "rows": rows, "config": cfg}


def wall_time(cfg, context: int, batch: int, steps: int) -> float:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dsv41_jax.runtime import COMPILER_OPTIONS
    from dsv41_jax.serving import cost
    from dsv41_jax.serving.buckets import empty_cache
    from dsv41_jax.serving.random_weights import random_model

    gd, params = nnx.split(random_model(cfg, 0))
    step = jax.jit(cost.decode_fn(gd), compiler_options=COMPILER_OPTIONS)
    cache = empty_cache(cfg, batch, context)
    cache["length"] = jnp.full((batch,), context - steps - 3, jnp.int32)
    toks = jnp.ones((batch, 1), jnp.int32)
    ids = None
    if cfg.engram_layer_ids:
        ids = jnp.zeros(cost.engram_spec(cfg, batch, 1).shape, jnp.int32)
    for _ in range(2):  # compile, and warm the host-side length update too
        cache["length"] = cache["length"] + 1
        logits, cache = step(params, toks, cache, ids)
    jax.block_until_ready(logits)
    t = time.perf_counter()
    for _ in range(steps):
        cache["length"] = cache["length"] + 1
        logits, cache = step(params, toks, cache, ids)
    jax.block_until_ready(logits)
    return (time.perf_counter() - t) / steps


def _overlap(a, b) -> float:
    """Mean over rows of |A & B| / |B| for -1-padded index sets."""
    import numpy as np

    vals = []
    for x, y in zip(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])):
        sy = set(y[y >= 0].tolist())
        vals.append(len(set(x[x >= 0].tolist()) & sy) / len(sy) if sy else 1.0)
    return float(np.mean(vals))


def golden_rows(root, steps: int, random_length: int) -> list[dict]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from dsv41_jax.golden.data import discover
    from dsv41_jax.runtime import COMPILER_OPTIONS
    from dsv41_jax.serving import split_prefill as sp
    from dsv41_jax.serving.buckets import capacity_for, empty_cache

    rows = []
    for gc in discover(root):
        cfg = gc.cfg
        gd, params = nnx.split(gc.load_model())

        def make(packed):
            @jax.jit
            def step(params, tokens, cache, ids):
                logits, cache, aux = sp.decode_step(nnx.merge(gd, params), tokens, cache, sp.decode_plan(packed=packed),
                                                    engram_ids=ids, collect_topk=True)
                return logits[:, -1], cache, aux["topk"]

            return step

        fast, ref = make(True), make(False)
        prefill = sp.make_exact_prefill(gd)
        hasher = gc.engram_hasher()
        stream = gc.longest_prefill()
        if stream is None:  # the DSpark and vision folders hold no text prefill case
            rows.append({"config": gc.name, "skipped": "no text prefill case in this folder"})
            continue
        prompts = [("golden", np.asarray(stream, np.int64)),
                   (f"random{random_length}", np.random.default_rng(random_length).integers(0, cfg.vocab_size, random_length))]
        for label, toks in prompts:
            n_dec = min(steps, len(toks) - 1)
            ids = None
            if hasher is not None:
                from dsv41_jax.engram.hashing import hash_ids

                ids = jnp.asarray(hash_ids(hasher[0], hasher[1], toks[None]).astype(np.int32))
            cut = lambda a, lo, hi: None if a is None else a[:, lo:hi]
            t = jnp.asarray(toks[None], jnp.int32)
            P = len(toks) - n_dec
            cap = capacity_for(cfg, len(toks), 16, maximum=max(len(toks), cfg.max_seq_len))
            _, cache, _ = prefill(params, t[:, :P], empty_cache(cfg, 1, cap), cut(ids, 0, P))
            c_fast = c_ref = cache
            diffs, argmax_eq, overlap, identical = [], [], {}, {}
            for i in range(P, len(toks)):
                lf, c_fast, kf = fast(params, t[:, i:i + 1], c_fast, cut(ids, i, i + 1))
                lr, c_ref, kr = ref(params, t[:, i:i + 1], c_ref, cut(ids, i, i + 1))
                lf, lr = np.asarray(lf[0]), np.asarray(lr[0])
                diffs.append(float(np.max(np.abs(lf - lr)) / np.max(np.abs(lr))))
                argmax_eq.append(bool(np.argmax(lf) == np.argmax(lr)))
                for l in cfg.index_source_layers:
                    a, b = np.asarray(kf[l]), np.asarray(kr[l])
                    overlap.setdefault(str(l), []).append(_overlap(a, b))
                    identical.setdefault(str(l), []).append(bool(np.array_equal(a, b)))
            row = {"config": gc.name, "prompt": label, "length": int(len(toks)), "decode_steps": n_dec,
                   "max_rel_logit_diff": max(diffs), "mean_rel_logit_diff": float(np.mean(diffs)),
                   "argmax_agreement": float(np.mean(argmax_eq)),
                   "topk_overlap_mean": {l: float(np.mean(v)) for l, v in overlap.items()},
                   "topk_overlap_min": {l: float(np.min(v)) for l, v in overlap.items()},
                   "topk_identical_steps": {l: float(np.mean(v)) for l, v in identical.items()}}
            rows.append(row)
            print(f"  {gc.name} {label}: max rel logit diff {row['max_rel_logit_diff']:.3g}", file=sys.stderr)
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    from dsv41_jax.config import ModelConfig

    if args.mesh:
        return mesh_main(args)

    if args.speculative:
        out = {"config": args.config}
        cfg, k = None, args.num_draft_tokens
        if args.checkpoint:
            measured = measured_speculation(args.checkpoint, (1, 8), k, args.new_tokens, args.prompts)
            cfg = measured.pop("config")
            k = measured["rows"][0]["k"]
            out = {"config": args.checkpoint, "measured": measured}
        out["speculative"] = speculative_rows(cfg or ModelConfig.load(args.config), k=k)
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(out, indent=2))
        return 0

    if args.golden and args.no_flops:
        out = {"golden": golden_rows(args.golden, args.golden_steps, args.random_length)}
        print_golden(out["golden"])
        if args.json:
            pathlib.Path(args.json).write_text(json.dumps(out, indent=2))
        return 0
    from dsv41_jax.serving import cost

    cfg = ModelConfig.load(args.config)
    contexts = [int(c) for c in args.contexts.split(",")]
    acfg = cost.arithmetic_config(cfg)
    probe = sorted({min(contexts), max(contexts)})
    if len(probe) == 1:
        probe = [probe[0], 2 * probe[0]]
    def per_position(packed: bool) -> float:
        lo, hi = (cost.indexer_scoring_flops(acfg, p, packed=packed) for p in probe)
        return (hi - lo) / (probe[1] - probe[0])

    slope = per_position(True)
    slope_reference = per_position(False)
    loops = cost.loop_probe()
    dot_per_pos = 2 * cfg.index_n_heads * cfg.index_head_dim
    rows = []
    for c in contexts:
        t = time.perf_counter()
        if args.full:
            measured = cost.decode_flops(acfg, c, args.batch)
        else:
            measured = cost.decode_flops_by_role(acfg, c, args.batch)
        ar = cost.arithmetic_decode(cfg, c, args.batch)
        row = {"context": c, "flops": measured["flops"], "arithmetic": ar,
               "vs_arithmetic": measured["flops"] / ar["total"] - 1, "positions_scored": ar["positions_scored"],
               "hlo": measured["hlo"], "lower_s": time.perf_counter() - t}
        if args.wall:
            row["wall_s"] = wall_time(cfg, c, args.batch, args.steps)
        rows.append(row)
        print(f"  context {c}: {row['flops']:.4e} FLOPs ({row['lower_s']:.0f}s)", file=sys.stderr)
    base = rows[0]
    for r in rows:
        dpos = r["positions_scored"] - base["positions_scored"]
        r["growth"] = r["flops"] - base["flops"]
        r["indexer_dot_growth"] = dpos * dot_per_pos * args.batch
        r["indexer_measured_growth"] = dpos * slope * args.batch
        strict = lambda x: x["flops"] - x["positions_scored"] * dot_per_pos * args.batch
        rest = lambda x: x["flops"] - x["positions_scored"] * slope * args.batch
        r["rest_strict_change"] = strict(r) / strict(base) - 1
        r["rest_change"] = rest(r) / rest(base) - 1
        r["ratio_to_first"] = r["flops"] / base["flops"]
    out = {"config": args.config, "batch": args.batch, "method": "full" if args.full else "per-role",
           "indexer_flops_per_position": {"dot": dot_per_pos, "measured": slope, "reference_rounded_scoring": slope_reference},
           "loop_probe": loops, "rows": rows,
           "checks": {"first_context_within_10pct_of_arithmetic": abs(base["vs_arithmetic"]) <= 0.10,
                      "rest_strict_constant_within_2pct": all(abs(r["rest_strict_change"]) <= 0.02 for r in rows),
                      "rest_constant_within_2pct": all(abs(r["rest_change"]) <= 0.02 for r in rows),
                      "no_loops_or_custom_calls": all(r["hlo"]["while"] == 0 and not r["hlo"]["custom_call"] for r in rows)}}
    print(f"decode step, {args.config}, batch {args.batch} ({out['method']} cost analysis, bf16 weights of the real shapes)")
    print(f"indexer FLOPs per scored position: dot {dot_per_pos}, measured {slope:.0f} (fast_index.scores_packed), "
          f"reference-rounded Indexer.scores {slope_reference:.0f}")
    print(f"loop probe: 4 matmuls as a scan {loops['scan']:.0f} FLOPs, unrolled {loops['unrolled']:.0f} "
          f"(arithmetic {loops['arithmetic']}): a loop body is counted once")
    hdr = f"{'context':>9} {'GFLOP':>9} {'arith':>9} {'vs arith':>8} {'x first':>7} {'positions':>10} {'growth':>9} {'idx dot':>9} {'idx meas':>9} {'rest|meas':>9} {'rest|dot':>9} {'while':>5}"
    print(hdr)
    for r in rows:
        print(f"{r['context']:>9} {r['flops'] / 1e9:9.2f} {r['arithmetic']['total'] / 1e9:9.2f} {r['vs_arithmetic']:+8.2%} "
              f"{r['ratio_to_first']:7.3f} {r['positions_scored']:>10} {r['growth'] / 1e9:9.2f} "
              f"{r['indexer_dot_growth'] / 1e9:9.2f} {r['indexer_measured_growth'] / 1e9:9.2f} {r['rest_change']:+9.2%} "
              f"{r['rest_strict_change']:+9.2%} {r['hlo']['while']:>5}" + (f"  wall {r['wall_s'] * 1e3:.2f} ms" if "wall_s" in r else ""))
    for k, v in out["checks"].items():
        print(f"  {k}: {v}")
    if args.stored_weights:
        out["stored_weights"] = stored_weight_rows(cfg, contexts[0], args.full)
        print_stored(out["stored_weights"], contexts[0])
    if args.golden:
        out["golden"] = golden_rows(args.golden, args.golden_steps, args.random_length)
        print_golden(out["golden"])
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


def stored_weight_rows(cfg, context: int, full: bool = False, batches=(1, 64)) -> list[dict]:
    """The decode step with the checkpoint's stored FP8/FP4 weights (fast numerics) at each batch, on
    the XLA path and on the kernel path (impl "pallas"):
    - weight traffic from the step's trace (`serving.weight_traffic`): stored bytes read, whole
      weights dequantized outside a kernel (bf16, written and read back), relayout copies made for a
      kernel; the kernels' calls, which XLA's cost analysis cannot see into;
    - XLA's cost analysis of the lowered XLA-path step (FLOPs and bytes accessed, unfused), beside
      the same shapes with bf16 weights (the arithmetic). Not for the kernel path: a kernel is a
      custom call (TPU/GPU) or an interpreted loop (CPU) there, so the figures would leave it out.
    The kernel path twice: on the stored bytes (params "stored") and on the params the engine holds
    (params "engine": `kernel_weights.kernel_params`' word views, made once at load)."""
    import jax

    from flax import nnx

    from dsv41_jax.model.kernel_weights import kernel_params
    from dsv41_jax.runtime import Runtime
    from dsv41_jax.serving import cost, split_prefill, weight_traffic

    acfg = cost.arithmetic_config(cfg)
    gd, params = cost.abstract_params(cfg)
    by_role = cost.decode_flops if full else cost.decode_flops_by_role
    rows = []
    for batch in batches:
        toks = jax.ShapeDtypeStruct((batch, 1), jax.numpy.int32)
        cache, ids = cost.abstract_cache(cfg, batch, context), cost.engram_spec(cfg, batch, 1)
        arith = by_role(acfg, context, batch)
        for impl, prepared in (("xla", True), ("pallas", False), ("pallas", True)):
            t = time.perf_counter()
            rt = Runtime(mode="fast", impl=impl, interpret=False if impl == "pallas" else None)
            plan = split_prefill.decode_plan(rt)
            # the params as the engine holds them for its plan (the kernels' word views, made once at
            # load: `kernel_weights.kernel_params`), or the stored bytes, which the kernels' wrappers relayout per call
            held = jax.eval_shape(lambda p: kernel_params(gd, p, plan), params) if prepared else params
            tree = jax.tree_util.tree_structure(held)

            def step(leaves, tokens, cache, ids):
                model = nnx.merge(gd, jax.tree_util.tree_unflatten(tree, leaves))
                return split_prefill.decode_step(model, tokens, cache, plan, engram_ids=ids)[0]

            uses = weight_traffic.trace_uses(step, held, toks, cache, ids)
            row = {"impl": impl, "params": "engine" if prepared else "stored", "batch": batch, "context": context,
                   "weight_traffic": weight_traffic.traffic(uses, rows=batch * cfg.n_activated_experts),
                   "kernel_calls": cost.kernel_calls(cost.decode_fn(gd, rt), held, toks, cache, ids),
                   "arithmetic_flops": arith["flops"], "arithmetic_bytes": arith["bytes"]}
            if impl == "xla":
                m = by_role(cfg, context, batch, rt)
                row.update(flops=m["flops"], bytes=m["bytes"], hlo=m["hlo"])
            row["seconds"] = time.perf_counter() - t
            rows.append(row)
            w = row["weight_traffic"]
            print(f"  stored weights {impl} ({row['params']} params) B={batch}: weight traffic {w['total'] / 1e9:.2f} GB "
                  f"({row['seconds']:.0f}s)", file=sys.stderr)
    return rows


def mesh_main(args) -> int:
    """--stored-weights --mesh SPEC: bench/mesh_weights.py on this many fake CPU devices."""
    import math
    import os

    from sharding.mesh import parse_mesh_spec

    n = math.prod(parse_mesh_spec(args.mesh).values())
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import mesh_weights  # noqa: E402 (beside this script; after the device count is set)
    from dsv41_jax.config import ModelConfig

    rows = mesh_weights.rows(ModelConfig.load(args.config), int(args.contexts.split(",")[0]), args.mesh)
    mesh_weights.print_rows(rows)
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"mesh_stored_weights": rows}, indent=2))
    return 0


def print_stored(rows, context: int) -> None:
    print(f"decode step at context {context} with the stored FP8/FP4 weights (fast numerics)")
    print("weight traffic per step, from the trace (GB): stored bytes read (by kernels / whole-weight dequantization /"
          " gathered rows), dequantized bf16 weights written and read back, relayout copies for kernels")
    print(f"{'impl':>6} {'params':>6} {'batch':>5} {'read':>8} {'kernel':>8} {'dequant':>8} {'gathered':>8} {'deq w+r':>8} "
          f"{'relayout':>8} {'total':>8}  kernels (cost analysis cannot see into them)")
    for r in rows:
        w = r["weight_traffic"]
        u = w["by_use"]
        kernels = ", ".join(f"{k} x{v}" for k, v in r["kernel_calls"].items()) or "-"
        print(f"{r['impl']:>6} {r.get('params', 'stored'):>6} {r['batch']:>5} {w['read'] / 1e9:8.2f} {u['kernel'] / 1e9:8.2f} {u['dequantized'] / 1e9:8.2f} "
              f"{u['gathered'] / 1e9:8.2f} {w['dequantized'] / 1e9:8.2f} {w['relayout'] / 1e9:8.2f} {w['total'] / 1e9:8.2f}  "
              f"{kernels}")
    print("XLA cost analysis of the XLA path (lowered, unfused; 'bf16' = the same shapes with bf16 weights)")
    print(f"{'batch':>5} {'GFLOP':>10} {'bf16 GFLOP':>10} {'x bf16':>7} {'GB accessed':>11} {'bf16 GB':>8}")
    for r in rows:
        if r["impl"] == "xla":
            print(f"{r['batch']:>5} {r['flops'] / 1e9:10.2f} {r['arithmetic_flops'] / 1e9:10.2f} "
                  f"{r['flops'] / r['arithmetic_flops']:7.2f} {r['bytes'] / 1e9:11.2f} {r['arithmetic_bytes'] / 1e9:8.2f}")


def print_golden(rows) -> None:
    print("fast (packed) vs reference-rounded index scoring, lean decode, teacher-forced, golden weights")
    for r in rows:
        ov = ", ".join(f"L{l} {r['topk_overlap_mean'][l]:.3f}/{r['topk_overlap_min'][l]:.2f}/{r['topk_identical_steps'][l]:.2f}"
                       for l in r["topk_overlap_mean"])
        print(f"  {r['config']:>11} {r['prompt']:>10} N={r['length']:<4} steps {r['decode_steps']:<3} logits max rel diff "
              f"{r['max_rel_logit_diff']:.2e} (mean {r['mean_rel_logit_diff']:.2e}) argmax {r['argmax_agreement']:.2f} | "
              f"top-k overlap mean/min/identical-steps {ov}")


if __name__ == "__main__":
    sys.exit(main())
