"""The `dsv41` command line: info, golden-check (and the commands other modules register)."""
from __future__ import annotations

import argparse
import json
import sys
import warnings


def _cmd_info(args) -> int:
    # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
    from dsv41_jax.config import ConfigError, ModelConfig

    try:
        cfg = ModelConfig.load(args.config)
    except ConfigError as e:
        print(f"dsv41 info: {e}", file=sys.stderr)
        return 2
    # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
    from dsv41_jax.model.info import format_info, model_info

    info = model_info(cfg)
    if args.json:
        print(json.dumps({"config": args.config, **info}, indent=1))
    else:
        print(format_info(args.config, info))
    return 0


def _default_golden_dir():
    """$DSV41_GOLDEN_DIR, else the small subset this repository ships (golden_subset/, next to the package
    in a clone or an editable install), else None."""
    import os
    import pathlib

    if os.environ.get("DSV41_GOLDEN_DIR"):
        return pathlib.Path(os.environ["DSV41_GOLDEN_DIR"])
    shipped = pathlib.Path(__file__).resolve().parents[2] / "golden_subset"
    return shipped if shipped.is_dir() else None


def _cmd_golden_check(args) -> int:
    import pathlib

    if args.dir is None:
        root = _default_golden_dir()
        if root is None:
            print("dsv41 golden-check: name a golden folder (the full set is ../shared/golden next to a clone; a "
                  "clone ships golden_subset/) or set DSV41_GOLDEN_DIR", file=sys.stderr)
            return 2
        print(f"dsv41 golden-check: checking {root}", file=sys.stderr)
    else:
        root = pathlib.Path(args.dir)
    if not root.is_dir():
        print(f"dsv41 golden-check: {root} is not a folder", file=sys.stderr)
        return 2
    # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
    from dsv41_jax.golden import data as golden_data

    found = [gc.name for gc in golden_data.discover(root)]
    found += ["quant"] if (root / "quant_vectors.safetensors").is_file() else []
    unknown = sorted(set(args.only or ()) - set(found))
    if not found or unknown:
        what = f"no case set named {unknown}" if found else "no golden cases"
        print(f"dsv41 golden-check: found {what} in {root} (it holds {found or 'none'}); a golden folder holds "
              "config folders with cases.json and config.json, and/or quant_vectors.safetensors", file=sys.stderr)
        return 2
    if args.numerics == "fast":
        return _fast_report(root, args)
    # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
    from dsv41_jax.golden.check import format_table, run_all

    decisions = {} if args.dump_decisions else None
    entries = run_all(root, impl=args.impl, interpret=args.impl == "pallas", only=args.only, decisions=decisions,
                      variant=args.variant)
    if decisions is not None:
        with open(args.dump_decisions, "w") as f:
            json.dump(decisions, f, separators=(",", ":"), sort_keys=True)
    if args.json:
        print(json.dumps({"cases": [e.to_json() for e in entries]}, indent=1))
    else:
        print(format_table(entries))
    return 0 if entries and all(e.passed for e in entries) else 1


def _fast_report(root, args) -> int:
    if args.impl != "xla" or args.dump_decisions:
        print("dsv41 golden-check: --numerics fast runs the XLA path and dumps no decisions; drop --impl pallas "
              "and --dump-decisions", file=sys.stderr)
        return 2
    # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
    from dsv41_jax.golden.fast_report import fast_report, format_report

    records = fast_report(root, only=args.only, variant=args.variant)
    print(json.dumps({"runs": records}, indent=1) if args.json else format_report(records))
    return 0 if records and all(r["passed"] for r in records) else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv41", description="DeepSeek-V4.1-Flash in JAX/Flax")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("info", help="parameter counts and cache bytes of a config")
    s.add_argument("--config", default="v41-flash", help="preset name (v41-flash, tiny) or path to a config.json")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=_cmd_info)

    s = sub.add_parser("golden-check", help="compare the model with a folder of reference outputs")
    s.add_argument("dir", nargs="?", help="golden root folder (config folders with cases.json, optional quant "
                                          "vectors); default: $DSV41_GOLDEN_DIR, else the repository's golden_subset/")
    s.add_argument("--json", action="store_true", help="print only {\"cases\": [...]} on stdout")
    s.add_argument("--impl", choices=["xla", "pallas"], default="xla", help="attention/MoE implementation (pallas runs interpreted on CPU)")
    s.add_argument("--only", action="append", metavar="NAME", help="check only this config folder ('quant' for the vectors); repeatable")
    s.add_argument("--numerics", choices=["exact", "fast"], default="exact",
                   help="exact (default): every entry must equal the oracle's; fast: measure the production "
                        "numerics (logit error, argmax agreement) and fail only on a decision that differs by more "
                        "than a near-tie (golden/fast_report.py)")
    s.add_argument("--variant", choices=["published", "corrected"],
                   help="run one part of the check: a decode case's runs of this index-key variant (free and forced); "
                        "'published' also takes everything without a variant (prefill cases, replays, image towers, "
                        "number-format vectors), so the two parts together are the whole check (a long case split "
                        "across two processes); with --numerics fast, that part's free runs")
    s.add_argument("--dump-decisions", metavar="FILE", help="write each case's own decisions (top-k, experts), "
                   "agreement flags and logits hashes, per run and call, as JSON to FILE (diff two runs' files)")
    s.set_defaults(func=_cmd_golden_check)

    for register in _extra_commands():
        register(sub)
    return p


def _extra_commands():
    """Subcommands owned by other modules (generate, convert, plan, compile, train, demo, serve), when present."""
    import importlib

    out = []
    for mod in ("dsv41_jax.cli.generate", "dsv41_jax.cli.convert", "sharding.cli_plan", "dsv41_jax.cli.compile",
                "dsv41_jax.cli.train", "dsv41_jax.cli.serve"):
        try:
            out.append(importlib.import_module(mod).register)
        except ModuleNotFoundError as e:
            if e.name != mod:
                print(f"dsv41: the {mod} commands are unavailable ({e})", file=sys.stderr)
    return out


def _format_warning(message, category, filename, lineno, line=None, _default=warnings.formatwarning):
    """Config warnings (a misspelt key) as one `dsv41: warning: ...` line; others as Python prints them."""
    if category.__name__ == "ConfigWarning":
        return f"dsv41: warning: {message}\n"
    return _default(message, category, filename, lineno, line)


def _keep_jax_off_absent_tpu() -> None:
    """On a machine with neither TPU chips nor a GPU, and JAX_PLATFORMS unset, run JAX on the CPU alone.

    The dev install brings libtpu (the TPU compiler `dsv41 compile` uses); with it installed JAX's
    default platform search loads it and tries to start a TPU that is not there: a warning on every
    command, ~100 MB of memory and libtpu's one-process lock (/tmp/libtpu_lockfile) held while the
    command runs. Compiling for a TPU topology does not need that backend. Child processes inherit
    the setting.
    """
    import os

    if "JAX_PLATFORMS" in os.environ:
        return
    try:
        from jax._src import hardware_utils  # private: guarded, the fallback is JAX's own search

        tpu_chips = hardware_utils.num_available_tpu_chips_and_device_id()[0]
        gpu = hardware_utils.has_visible_nvidia_gpu() or os.path.exists("/dev/kfd")
    except (ImportError, AttributeError):
        return
    if tpu_chips or gpu:
        return
    import jax

    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")  # jax read the environment when it was imported


def main(argv=None) -> int:
    warnings.formatwarning = _format_warning
    _keep_jax_off_absent_tpu()
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
