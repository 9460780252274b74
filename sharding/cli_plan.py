"""`dsv41 plan`: per-device memory of a config on a mesh, and a one-layer AOT compile on fake devices.

Exit status: 0 when the plan was made (and fits the named device, if one is named),
1 when it does not fit or the compile failed, 2 for bad arguments.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

from sharding.devices import HBM_GIB


DEFAULT_CONTEXT = 65536  # the plan's context when --context is not given and the config allows this much


def _context(cfg, asked: int | None) -> int:
    """--context, or the config's max_seq_len capped at DEFAULT_CONTEXT: the serve command then passes
    no more than the checkpoint's own limit as --max-model-len (a checkpoint exported for 8192 tokens
    is not planned at 65536). An explicit --context is taken as asked (`dsv41 serve --max-model-len`
    overrides the config's too)."""
    if asked is None:
        return min(DEFAULT_CONTEXT, cfg.max_seq_len)
    if asked < 1:
        raise ValueError(f"--context must be a positive number of tokens, got {asked}")
    return asked


def register(subparsers) -> None:
    s = subparsers.add_parser("plan", help="per-device memory of a config on a mesh (and a one-layer AOT compile)")
    s.add_argument("--config", default="v41-flash", help="preset name (v41-flash, tiny) or path to a config.json")
    s.add_argument("--mesh", required=True, help="mesh spec, e.g. data=1,expert=16,tensor=4")
    s.add_argument("--batch", type=int, default=1, help="sequences served at once (whole mesh)")
    s.add_argument("--context", type=int, default=None,
                   help=f"tokens per sequence the caches hold (default: the config's max_seq_len, at most "
                        f"{DEFAULT_CONTEXT})")
    s.add_argument("--device", choices=sorted(HBM_GIB), help="check the plan against this chip's HBM")
    s.add_argument("--preset", default="inference", help="sharding preset (inference, inference-indexer-replicated, training)")
    s.add_argument("--prefill-chunk", type=int, default=512, help="prefill chunk for the activation estimate")
    s.add_argument("--engram", choices=["hbm", "host"], default="hbm", help="Engram tables in HBM (row-sharded) or host memory")
    s.add_argument("--max-batch", action="store_true", help="also report the largest batch that fits --device")
    s.add_argument("--no-compile", action="store_true", help="skip the one-layer AOT compile")
    s.add_argument("--compile-tokens", type=int, default=1, help="tokens per sequence in the compiled step (1 = decode)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=run)


def _mesh_devices(spec: str) -> int:
    # deferred: `dsv41 --help` builds this parser without loading jax or the model
    from sharding.mesh import parse_mesh_spec

    sizes = parse_mesh_spec(spec)
    if -1 in sizes.values():
        raise ValueError(f"--mesh needs explicit sizes, got {spec!r}")
    return math.prod(sizes.values())


def _request_fake_devices(n: int) -> bool:
    """Ask for n fake CPU devices if the JAX backend has not started yet; True when it will have them."""
    try:
        from jax._src import xla_bridge  # private: guarded, the fallback is a child process

        started = xla_bridge.backends_are_initialized()
    except (ImportError, AttributeError):
        return False
    if started:
        import jax

        return jax.default_backend() == "cpu" and jax.device_count() >= n
    flags = os.environ.get("XLA_FLAGS", "")
    m = re.search(r"--xla_force_host_platform_device_count=(\d+)", flags)
    if m is None or int(m.group(1)) < n:
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags)
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    return os.environ["JAX_PLATFORMS"] == "cpu"


def _compile(args, in_process: bool) -> dict:
    if in_process:
        # deferred: `dsv41 --help` builds this parser without loading jax or the model
        from dsv41_jax.config import ModelConfig
        from sharding.layer_compile import compile_one_layer

        return compile_one_layer(ModelConfig.load(args.config), args.mesh, batch=args.batch, context=args.context,
                                 preset=args.preset, tokens=args.compile_tokens)
    n = _mesh_devices(args.mesh)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={n}")
    cmd = [sys.executable, "-m", "sharding.layer_compile", "--config", args.config, "--mesh", args.mesh,
           "--batch", str(args.batch), "--context", str(args.context), "--preset", args.preset,
           "--tokens", str(args.compile_tokens)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError):
        return {"ok": False, "devices": n, "error": (proc.stderr or proc.stdout)[-2000:]}


def serve_command(plan: dict, args) -> str:
    """The `dsv41 serve` command line for the planned mesh, preset, batch and context."""
    # deferred: `dsv41 --help` builds this parser without loading jax or the model
    from sharding.mesh import format_mesh_spec

    cmd = (f"dsv41 serve --checkpoint DIR --mesh {format_mesh_spec(plan['mesh'])} --preset {args.preset} "
           f"--max-batch {args.batch} --max-model-len {plan['context']} --prefill-chunk {args.prefill_chunk}")
    if args.engram == "host":
        cmd += " --engram host"
    return cmd


def run(args) -> int:
    from dsv41_jax.config import ConfigError, ModelConfig  # no JAX backend start: safe before the flags

    try:
        n = _mesh_devices(args.mesh)
        in_process = args.no_compile or _request_fake_devices(n)
        # deferred: `dsv41 --help` builds this parser without loading jax or the model
        from sharding.plan import build_plan, format_plan, max_batch

        cfg = ModelConfig.load(args.config)
        args.context = _context(cfg, args.context)
        plan = build_plan(cfg, args.mesh, batch=args.batch, context=args.context, preset=args.preset,
                          device=args.device, chunk=args.prefill_chunk, engram=args.engram)
    except (ValueError, ConfigError) as e:  # MeshSpecError, ShardingRuleError and ConfigError are ValueErrors
        print(f"dsv41 plan: {e}", file=sys.stderr)
        return 2
    plan["config"] = args.config
    plan["serve_command"] = serve_command(plan, args)
    if args.max_batch:
        if args.device is None:
            print("dsv41 plan: --max-batch needs --device", file=sys.stderr)
            return 2
        plan["max_batch"] = max_batch(cfg, args.mesh, context=args.context, device=args.device, preset=args.preset,
                                      chunk=args.prefill_chunk, engram=args.engram)
    if not args.no_compile:
        plan["compile"] = _compile(args, in_process)
    if args.json:
        print(json.dumps(plan, indent=1, default=str))
    else:
        print(f"config {args.config}")
        print(format_plan(plan))
        if "max_batch" in plan:
            print(f"largest batch that fits {args.device} at context {plan['context']}: {plan['max_batch']}")
        print(f"serve it: {plan['serve_command']}")
    ok = plan.get("fits", True) and plan.get("compile", {"ok": True})["ok"]
    return 0 if ok else 1
