"""Compile time of a step with the layers scanned (runs of one kind, `Runtime.scan_layers`) and unrolled.

    python bench/layer_scan.py [--config v41-flash] [--what decode prefill] [--tokens 2048]
                               [--context 4096] [--json out.json]

For each step and each of scan on / off: the seconds to trace and lower the program and the seconds
XLA:CPU takes to compile it, over abstract parameters (`serving.cost.abstract_params`: nothing is
allocated, so the released width works on a laptop), plus the lowered module's size. decode: the
engine's one-token step (`split_prefill.decode_step` with `decode_plan`, B=1, `--context` cached
tokens); prefill: Graph A over one `--tokens` piece (`encoder_pass`, what a long prompt compiles
once per piece shape) and the exact prefill (`exact_prefill`, all layers) over the same tokens.
A benchmark, not a test: timings depend on the machine and its load.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time


def steps(cfg, what: str, tokens: int, context: int, runtime):
    """{name: (fn, abstract args)} for `what`."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dsv41_jax.serving import cost
    from dsv41_jax.serving.split_prefill import decode_plan, decode_step, encoder_pass, exact_prefill

    gd, params = cost.abstract_params(cfg)
    if what == "decode":
        cache = cost.abstract_cache(cfg, 1, context)
        toks = jax.ShapeDtypeStruct((1, 1), jnp.int32)

        def decode(params, toks, cache, ids):
            return decode_step(nnx.merge(gd, params), toks, cache, decode_plan(runtime), engram_ids=ids)[:2]

        return {"decode": (decode, (params, toks, cache, cost.engram_spec(cfg, 1, 1)))}
    cache = cost.abstract_cache(cfg, 1, max(context, tokens))
    toks = jax.ShapeDtypeStruct((1, tokens), jnp.int32)

    def piece(params, toks, cache, ids):
        return encoder_pass(nnx.merge(gd, params), toks, cache, runtime=runtime, engram_ids=ids)

    def exact(params, toks, cache, ids):
        return exact_prefill(nnx.merge(gd, params), toks, cache, runtime=runtime, engram_ids=ids)[:2]

    args = (params, toks, cache, cost.engram_spec(cfg, 1, tokens))
    return {"graph_a_piece": (piece, args), "exact_prefill": (exact, args)}


def measure(cfg, what: str, tokens: int, context: int, scan: bool) -> list[dict]:
    import jax

    from dsv41_jax.runtime import COMPILER_OPTIONS, Runtime

    runtime = dataclasses.replace(Runtime(), scan_layers=scan)
    rows = []
    for name, (fn, args) in steps(cfg, what, tokens, context, runtime).items():
        t0 = time.perf_counter()
        low = jax.jit(fn, compiler_options=COMPILER_OPTIONS).lower(*args)
        t1 = time.perf_counter()
        low.compile()
        t2 = time.perf_counter()
        rows.append({"step": name, "scan": scan, "tokens": 1 if what == "decode" else tokens, "context": context,
                     "lower_s": round(t1 - t0, 2), "compile_s": round(t2 - t1, 2),
                     "stablehlo_chars": len(low.as_text())})
        print(f"{name:14} scan={str(scan):5} lower {t1 - t0:7.1f} s  compile {t2 - t1:7.1f} s  "
              f"StableHLO {rows[-1]['stablehlo_chars'] / 1e6:6.2f} MB", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="v41-flash", help="preset name or config.json path")
    ap.add_argument("--what", nargs="+", choices=["decode", "prefill"], default=["decode"])
    ap.add_argument("--tokens", type=int, default=2048, help="prefill tokens per call")
    ap.add_argument("--context", type=int, default=4096, help="cache capacity (decode: cached tokens)")
    ap.add_argument("--scan", choices=["on", "off", "both"], default="both")
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args(argv)

    from dsv41_jax.config import ModelConfig
    from dsv41_jax.model import block as body
    from dsv41_jax.model.plan import Plan
    from dsv41_jax.serving import cost

    cfg = ModelConfig.load(args.config)
    runs = body.layer_runs(cost.abstract_model(cfg), range(cfg.n_layers), Plan())
    print(f"{args.config}: {cfg.n_layers} layers, {len(runs)} bodies with the scan "
          f"(runs: {[r for r in runs if len(r) > 1]})")
    rows = [r for what in args.what for scan in {"on": [True], "off": [False], "both": [False, True]}[args.scan]
            for r in measure(cfg, what, args.tokens, args.context, scan)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "layers": cfg.n_layers, "bodies_scanned": len(runs), "rows": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
