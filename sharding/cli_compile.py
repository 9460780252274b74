"""`dsv41 compile`: the model's step compiled by XLA:TPU (and its kernels by Mosaic) for a TPU slice, here.

No TPU is needed: libtpu (the dev install brings it) compiles for a named topology. The figures
are the TPU compiler's buffer assignment and cost model, not measurements on a TPU.

Exit status: 0 the program compiled and fits the chip's HBM, 1 it does not fit or does not
compile (the report says which program and why), 2 bad input.
"""
from __future__ import annotations

import json
import sys


GiB = 2 ** 30
WHAT = ("decode",)  # the engine's programs compiled so far; prefill, verify and train are next


def register(subparsers) -> None:
    s = subparsers.add_parser("compile", help="compile the model's step for a TPU slice with XLA:TPU (no TPU needed)")
    s.add_argument("--config", default="v41-flash", help="preset name (v41-flash, tiny) or path to a config.json")
    s.add_argument("--topology", required=True, help="TPU slice, e.g. v6e:4x4 (16 chips), v5p:4x4x4 (64 chips), "
                   "v5e:2x2")
    s.add_argument("--mesh", required=True, help="mesh spec over the slice's chips, e.g. data=1,expert=16")
    s.add_argument("--preset", default="inference", help="sharding preset (inference, inference-indexer-replicated, "
                   "training)")
    s.add_argument("--batch", type=int, default=1, help="sequences served at once (whole mesh)")
    s.add_argument("--context", type=int, default=4096, help="tokens per sequence the caches hold")
    s.add_argument("--impl", choices=["xla", "pallas"], default="xla", help="XLA path or the Pallas kernels")
    s.add_argument("--what", choices=WHAT, default="decode", help="which program to compile")
    s.add_argument("--layers-per-kind", type=int, default=0, metavar="N",
                   help="compile N layers of each layer kind at the released width (0: the whole stack)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=run)


def _plan_figures(cfg, args) -> dict:
    # deferred: `dsv41 --help` builds this parser without loading jax or the model
    from sharding.plan import build_plan

    p = build_plan(cfg, args.mesh, batch=args.batch, context=args.context, preset=args.preset)
    d = p["per_device_bytes"]
    return {"arguments": d["weights"] + d["engram"] + d["cache"], "activations": d["activations"], "total": d["total"],
            "decode_activations": sum(p["activations_detail"]["decode"].values())}


def _compile(args) -> dict:
    # deferred: `dsv41 --help` builds this parser without loading jax or the model
    from dsv41_jax.config import ModelConfig
    from pallas_kernels.common import tpu_compile
    from sharding.tpu_step import compile_decode, subset_config

    missing = tpu_compile.libtpu_missing()
    if missing:
        raise RuntimeError(missing)
    if args.batch <= 0 or args.context <= 0 or args.layers_per_kind < 0:
        raise ValueError(f"--batch and --context must be positive and --layers-per-kind >= 0, got "
                         f"{args.batch}, {args.context}, {args.layers_per_kind}")
    full = ModelConfig.load(args.config)
    cfg, kept = (subset_config(full, args.layers_per_kind) if args.layers_per_kind else (full, None))
    report = compile_decode(cfg, args.topology, args.mesh, batch=args.batch, context=args.context,
                            preset=args.preset, impl=args.impl)
    report.update(config=args.config, what=args.what, layers_of_full_stack=full.n_layers,
                  plan_compiled_layers=_plan_figures(cfg, args))
    if kept is not None:
        report["layers_kept_per_kind"] = kept
        report["plan_full_stack"] = _plan_figures(full, args)
    return report


def _format(r: dict) -> str:
    # deferred: `dsv41 --help` builds this parser without loading jax or the model
    from sharding.mesh import format_mesh_spec

    def g(b):
        return f"{b / GiB:.2f} GiB"

    head = (f"{r['what']} step, config {r['config']}, {r['layers']} of {r['layers_of_full_stack']} layers, "
            f"impl {r['impl']}, batch {r['batch']}, context {r['context']}; {r['topology']}: {r['chips']} chips "
            f"({r['device_kind']}), {r['hosts']} hosts; mesh {format_mesh_spec(r['mesh'])}, preset {r['preset']}")
    if not r["ok"]:
        return f"{head}\ncompile FAILED after {r['seconds']:.1f} s: {r['error']}"
    d, plan = r["per_device_bytes"], r["plan_compiled_layers"]
    hbm = r["hbm_bytes"]
    lines = [head, f"compiled by XLA:TPU in {r['seconds']:.1f} s (this machine)",
             "per device (TPU compiler's buffer assignment, not measured on a TPU):",
             f"  arguments {g(d['argument'])} (plan: {g(plan['arguments'])}), temp {g(d['temp'])} "
             f"(plan's XLA-path activation estimate: decode step {g(plan['decode_activations'])}, the larger of it "
             f"and a prefill chunk {g(plan['activations'])}), output {g(d['output'])} "
             f"(aliased {g(d['alias'])}), code {d['generated_code'] / 2 ** 20:.1f} MiB",
             f"  peak {g(d['peak'])} of {g(hbm) if hbm else '?'} HBM -> {'fits' if r['fits'] else 'does NOT fit'}"]
    if "plan_full_stack" in r:
        kept = ", ".join(f"{k} {v}" for k, v in r["layers_kept_per_kind"].items())
        lines.append(f"  fewer layers compiled ({kept}); the full stack's plan: arguments "
                     f"{g(r['plan_full_stack']['arguments'])}, total {g(r['plan_full_stack']['total'])}")
    coll = ", ".join(f"{k} x{v['count']} ({v['bytes'] / 2 ** 20:.2f} MiB"
                     + (f", {v['cross_host']} across hosts)" if r["hosts"] > 1 else ")")
                     for k, v in r["collectives"].items())
    lines.append(f"collectives per device: {coll or 'none'}")
    if r["impl"] == "pallas":
        lines.append(f"Mosaic kernels: {r['mosaic_calls']} calls of {', '.join(r['mosaic_kernels']) or 'none'}")
    lines.append(f"cost model (TPU cost model, not measured on a TPU): {r['flops'] / 1e9:.2f} GFLOP, "
                 f"{r['bytes_accessed'] / GiB:.2f} GiB accessed, {r['cost_model_seconds'] * 1e3:.3f} ms per device")
    return "\n".join(lines)


def run(args) -> int:
    # deferred: `dsv41 --help` builds this parser without loading jax or the model
    from dsv41_jax.config import ConfigError

    try:
        report = _compile(args)
    except (ValueError, ConfigError, RuntimeError) as e:  # a bad mesh, topology, config; libtpu missing
        print(f"dsv41 compile: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1, default=str) if args.json else _format(report))
    return 0 if report["ok"] and report["fits"] else 1


