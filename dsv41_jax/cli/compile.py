"""`dsv41 compile`: the engine's programs compiled by XLA:TPU (and its kernels by Mosaic) for a TPU slice, here.

No TPU is needed: libtpu (the dev install brings it) compiles for a named topology. The figures
are the TPU compiler's buffer assignment and cost model, not measurements on a TPU. `--what`:
decode (`sharding.tpu_step`), prefill (Graph A, Graph B and the bounded replay for a `--context`
prompt) or verify (DSpark's verify step; both `serving.tpu_programs`), or train (the QAT training
step, `train.tpu_compile`).

Exit status: 0 the program compiled and fits the chip's HBM (the compiler's own peak of live
arguments and temporaries, plus the generated code: `sharding.tpu_memory`), 1 it does not fit or
does not compile (the report says which program and why), 2 bad input.
"""
from __future__ import annotations

import json
import sys


GiB = 2 ** 30
WHAT = ("decode", "prefill", "verify", "train")


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
    s.add_argument("--what", choices=WHAT, default="decode",
                   help="decode: the decode step; prefill: Graph A (one --prefill-chunk piece), Graph B and the "
                        "replay of a --context-token prompt; verify: DSpark's verify step for --batch sequences; "
                        "train: the QAT training step on --batch rows of --context tokens (preset training)")
    s.add_argument("--prefill-chunk", type=int, default=512, help="with --what prefill: Graph A's piece length")
    s.add_argument("--num-draft-tokens", type=int, default=None, metavar="K",
                   help="with --what verify: drafts per step (default: the drafter's block, as dsv41 serve drafts)")
    s.add_argument("--layers-per-kind", type=int, default=0, metavar="N",
                   help="compile N layers of each layer kind at the released width (0: the whole stack)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=run)


def _plan_figures(cfg, args) -> dict:
    # deferred: `dsv41 --help` builds this parser without loading jax or the model
    from sharding.activations import activation_estimate
    from sharding.plan import build_plan, mesh_sizes, plan_context

    batch = 1 if args.what == "prefill" else args.batch
    p = build_plan(cfg, args.mesh, batch=batch, context=args.context, preset=args.preset, chunk=args.prefill_chunk)
    d = p["per_device_bytes"]
    run_cfg = cfg.replace(max_seq_len=plan_context(cfg, args.context), max_batch_size=batch)
    mine = activation_estimate(run_cfg, mesh_sizes(args.mesh), args.preset, batch=batch, chunk=p["prefill_chunk"],
                               impl=args.impl)
    return {"arguments": d["weights"] + d["engram"] + d["cache"], "activations": d["activations"], "total": d["total"],
            "decode_activations": sum(mine["decode"].values()), "prefill_activations": sum(mine["prefill"].values())}


def _compile(args) -> list[dict]:
    # deferred: `dsv41 --help` builds this parser without loading jax or the model
    from dsv41_jax.config import ModelConfig
    from dsv41_jax.serving.tpu_programs import compile_programs
    from dsv41_jax.train.tpu_compile import compile_train
    from pallas_kernels.common import tpu_compile
    from sharding.tpu_step import compile_decode, subset_config

    missing = tpu_compile.libtpu_missing()
    if missing:
        raise RuntimeError(missing)
    if args.batch <= 0 or args.context <= 0 or args.layers_per_kind < 0 or args.prefill_chunk <= 0:
        raise ValueError(f"--batch, --context and --prefill-chunk must be positive and --layers-per-kind >= 0, got "
                         f"{args.batch}, {args.context}, {args.prefill_chunk}, {args.layers_per_kind}")
    full = ModelConfig.load(args.config)
    cfg, kept = (subset_config(full, args.layers_per_kind) if args.layers_per_kind else (full, None))
    kw = dict(batch=args.batch, context=args.context, preset=args.preset, impl=args.impl)
    if args.what == "decode":
        reports = [compile_decode(cfg, args.topology, args.mesh, **kw)]
    elif args.what == "train":
        reports = [compile_train(cfg, args.topology, args.mesh, batch=args.batch, seq_len=args.context, impl=args.impl)]
    else:
        reports = compile_programs(cfg, args.topology, args.mesh, what=args.what, chunk=args.prefill_chunk,
                                   k=args.num_draft_tokens, **kw)
    # `dsv41 plan` lays out the served formats, not a training state (fp32 masters and moments)
    plan = args.what != "train"
    extra = {"config": args.config, "what": args.what, "layers_of_full_stack": full.n_layers,
             "plan_compiled_layers": _plan_figures(cfg, args) if plan else None}
    if kept is not None:
        extra.update(layers_kept_per_kind=kept, plan_full_stack=_plan_figures(full, args) if plan else None)
    return [{**r, **extra} for r in reports]


def _format(r: dict) -> str:
    # deferred: `dsv41 --help` builds this parser without loading jax or the model
    from sharding.mesh import format_mesh_spec

    def g(b):
        return f"{b / GiB:.2f} GiB"

    head = (f"{r['program']} program, config {r['config']}, {r['layers']} of {r['layers_of_full_stack']} layers, "
            f"impl {r['impl']}, batch {r['batch']}, context {r['context']}; {r['topology']}: {r['chips']} chips "
            f"({r['device_kind']}), {r['hosts']} hosts; mesh {format_mesh_spec(r['mesh'])}, preset {r['preset']}")
    if not r["ok"]:
        return f"{head}\ncompile FAILED after {r['seconds']:.1f} s: {r['error']}"
    d, plan = r["per_device_bytes"], r["plan_compiled_layers"]
    hbm = r["hbm_bytes"]
    if plan is None:
        beside = ("", "")
    else:
        estimate = plan["prefill_activations" if r["what"] == "prefill" else "decode_activations"]
        beside = (f" (plan: {g(plan['arguments'])})",
                  f" (plan's {'prefill-chunk' if r['what'] == 'prefill' else 'decode-step'} activation estimate on "
                  f"this path {g(estimate)}; its XLA-path figure, the larger of a decode step and a prefill chunk, "
                  f"{g(plan['activations'])})")
    lines = [head, f"compiled by XLA:TPU in {r['seconds']:.1f} s (this machine)",
             "per device (TPU compiler's buffer assignment, not measured on a TPU):",
             f"  arguments {g(d['argument'])}{beside[0]}, temp {g(d['temp'])}{beside[1]}, output {g(d['output'])} "
             f"(aliased {g(d['alias'])}), code {d['generated_code'] / 2 ** 20:.1f} MiB",
             f"  compiler's peak {g(d['compiler_peak'])} (arguments and temporaries live at once) + code = "
             f"{g(d['fit'])} of {g(hbm) if hbm else '?'} HBM -> {'fits' if r['fits'] else 'does NOT fit'}",
             f"  (summed: arguments + outputs - aliased + temp + code = {g(d['summed'])}; XLA:TPU's temp counts "
             "more than the temporaries it allocates, so the sum is not what it enforces: sharding/tpu_memory.py)"]
    if r.get("plan_full_stack"):
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
        reports = _compile(args)
    except (ValueError, ConfigError, RuntimeError) as e:  # a bad mesh, topology, config; libtpu missing
        print(f"dsv41 compile: {e}", file=sys.stderr)
        return 2
    if args.json:  # one program: its report (as before --what); several: {"programs": [...]}
        print(json.dumps(reports[0] if len(reports) == 1 else {"programs": reports}, indent=1, default=str))
    else:
        print("\n\n".join(_format(r) for r in reports))
    return 0 if all(r["ok"] and r["fits"] for r in reports) else 1
