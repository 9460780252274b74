"""`dsv41 convert`: HF shards <-> orbax (either direction, or re-sharding HF -> HF)."""
from __future__ import annotations

import argparse
import pathlib
import re
import sys

FORMATS = ("hf", "orbax")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'5GB', '512MiB', '1000000' -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size; use e.g. 5GB, 512MiB or a byte count")
    size = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive size; a shard holds at least one byte (e.g. 5GB)")
    return size


def _endpoint(value, flag: str) -> tuple[str, pathlib.Path]:
    fmt, path = value
    if fmt not in FORMATS:
        raise ValueError(f"{flag} {fmt!r}: the format must be one of {FORMATS} (e.g. {flag} hf ./DeepSeek-V4.1-Flash)")
    return fmt, pathlib.Path(path)


def _groups(names) -> list[str]:
    return sorted({n.split(".")[0] + ".*" for n in names})


def _cmd_convert(args) -> int:
    # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
    from dsv41_jax.checkpoint import CheckpointError, checkpoint_format, load
    from dsv41_jax.checkpoint.atomic import check_destination
    from dsv41_jax.checkpoint.hf_writer import copied_entries, save_hf_checkpoint
    from dsv41_jax.checkpoint.orbax_io import save_params
    from dsv41_jax.config import ConfigError
    from dsv41_jax.checkpoint.weights import WeightError

    try:
        src_fmt, src = _endpoint(args.src, "--from")
        dst_fmt, dst = _endpoint(args.dst, "--to")
        found = checkpoint_format(src)
        if found != src_fmt:
            raise CheckpointError(f"{src} is an {found} checkpoint, not {src_fmt}; use --from {found} {src}")
        # refused before anything is loaded: a destination holding / inside the source, a
        # non-empty one without --force, one with files that are not a checkpoint's
        check_destination(dst, overwrite=args.force, sources=[src])
        cfg, model, report = load(src, progress=not args.quiet, check_values=not args.no_value_check)
        print(report.summary(), file=sys.stderr)
        tok = src / "tokenizer.json"
        tok = tok if tok.is_file() else None
        if dst_fmt == "hf":
            extra = copied_entries(src, report.skipped) if report.format == "hf" else []
            index = save_hf_checkpoint(model, dst, narrow=args.narrow, max_shard_bytes=args.max_shard_size, tokenizer=tok,
                                       overwrite=args.force, progress=not args.quiet, extra=extra, sources=[src])
            n = len(set(index["weight_map"].values()))
            kept = f", including {len(extra)} copied unchanged ({', '.join(_groups(e.name for e in extra))})" if extra else ""
            print(f"wrote {len(index['weight_map'])} tensors{kept} in {n} shard(s) to {dst}", file=sys.stderr)
        else:
            if report.skipped:
                print(f"dsv41 convert: WARNING: the orbax checkpoint holds only the text backbone; the "
                      f"{len(report.skipped)} tensors it does not model ({', '.join(_groups(report.skipped))}) are "
                      f"NOT written to {dst}; keep {src} for them, or convert to hf, which copies them",
                      file=sys.stderr)
            save_params(dst, model, cfg, tokenizer=tok, overwrite=args.force, sources=[src])
            print(f"wrote an orbax checkpoint to {dst}", file=sys.stderr)
    except (CheckpointError, ConfigError, WeightError, FileExistsError, FileNotFoundError, ValueError) as e:
        print(f"dsv41 convert: {e}", file=sys.stderr)
        return 2
    return 0


def register(subparsers) -> None:
    s = subparsers.add_parser("convert", help="convert checkpoints between HF shards and orbax",
                              description="Convert a checkpoint: --from FORMAT SRC --to FORMAT DST, FORMAT in {hf, orbax}. "
                                          "The whole model is loaded on the first device on the way.")
    s.add_argument("--from", dest="src", nargs=2, metavar=("FORMAT", "SRC"), required=True, help="source format and folder")
    s.add_argument("--to", dest="dst", nargs=2, metavar=("FORMAT", "DST"), required=True, help="destination format and folder")
    s.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"), help="HF output shard size (default 5GB)")
    s.add_argument("--narrow", choices=("auto", "strict", "round"), default="auto",
                   help="HF output: wo_a (FP8 on disk) and compressor weights (BF16 on disk) that the release dtype cannot "
                        "hold exactly: keep the model's dtype (auto), fail (strict) or round (round)")
    s.add_argument("--force", action="store_true",
                   help="replace a non-empty destination checkpoint folder (atomically; a folder holding other files, "
                        "or the source, is refused)")
    s.add_argument("--no-value-check", action="store_true", help="skip the load-time NaN/inf check of the weights")
    s.add_argument("--quiet", action="store_true", help="no progress bars")
    s.set_defaults(func=_cmd_convert)
