"""`dsv41 serve --speculative dspark [--num-draft-tokens K] [--speculative-acceptance RULE]`: the
server's engine drafts K tokens per step per slot with the checkpoint's DSpark drafter
(`serving/speculation.py`) and accepts them at T > 0 by RULE (`Engine(spec_acceptance=...)`).

Checked in the order a user can fix them: the flags alone (before the checkpoint is opened), the
checkpoint's tensor names (an HF folder without `mtp.*` is refused before any weight is read),
then the loaded model (`dspark.require_dspark`, which covers orbax folders too) and K against its
drafter's block.
"""
from __future__ import annotations

import pathlib

from dsv41_jax.cli.argtypes import positive_int


def add_args(s) -> None:
    s.add_argument("--speculative", choices=("dspark",), default=None,
                   help="speculative decoding with the checkpoint's DSpark drafter (mtp.* tensors): every step drafts "
                        "K tokens per request and verifies them in one forward (the prefill's taps fill the drafter's "
                        "rings, with the split prefill too). /metrics reports drafted / accepted tokens")
    s.add_argument("--num-draft-tokens", type=positive_int, default=None, metavar="K",
                   help="drafts per step with --speculative (1 .. the drafter's block, dspark_block_size; default: "
                        "the whole block)")
    s.add_argument("--speculative-acceptance", choices=ACCEPTANCE, default=None, metavar="RULE",
                   help="with --speculative, how drafts are accepted at temperature > 0: 'rejection' (default: "
                        "rejection sampling, the target distribution, more drafts accepted) or 'match' (a draft must "
                        "equal the token plain decoding draws: a seeded request gives the same tokens as a server "
                        "without speculation). Greedy requests accept the same way under both")


ACCEPTANCE = ("rejection", "match")  # Engine(spec_acceptance=...); the first is the default


def acceptance(args) -> str:
    """The acceptance rule for `Engine(spec_acceptance=...)`."""
    return args.speculative_acceptance or ACCEPTANCE[0]


def check_flags(args) -> None:
    """The flags alone, before the checkpoint is opened."""
    # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
    from dsv41_jax.cli.model_args import InputError

    if args.num_draft_tokens is not None and args.speculative is None:
        raise InputError(f"--num-draft-tokens {args.num_draft_tokens} needs --speculative dspark")
    if args.speculative_acceptance is not None and args.speculative is None:
        raise InputError(f"--speculative-acceptance {args.speculative_acceptance} needs --speculative dspark")


def check_checkpoint(args, folder: pathlib.Path) -> None:
    """An HF folder that ships no drafter is refused by its tensor names, before weights are read."""
    # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
    from dsv41_jax.checkpoint import checkpoint_format
    from dsv41_jax.checkpoint.hf_loader import read_config, weight_map
    from dsv41_jax.checkpoint.weights import has_dspark_tensors
    from dsv41_jax.cli.model_args import InputError

    if args.speculative is None or checkpoint_format(folder) != "hf":
        return
    cfg = read_config(folder)
    if not cfg.has_dspark or not has_dspark_tensors(weight_map(folder)):
        stages = max(cfg.n_mtp_layers, 1)
        raise InputError(f"--speculative dspark: {folder} has no DSpark drafter: it needs the mtp.* tensors "
                         f"(mtp.0.* .. mtp.{stages - 1}.*) and a config with n_mtp_layers > 0 and dspark_block_size "
                         f"> 0 (found n_mtp_layers={cfg.n_mtp_layers}, dspark_block_size={cfg.dspark_block_size}, "
                         f"{'some' if has_dspark_tensors(weight_map(folder)) else 'no'} mtp.* tensors); serve it "
                         "without --speculative or use a checkpoint that ships the drafter")
    if args.num_draft_tokens is not None and args.num_draft_tokens > cfg.dspark_block_size:
        _too_many(args.num_draft_tokens, cfg.dspark_block_size)


def _too_many(k: int, block: int):
    # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
    from dsv41_jax.cli.model_args import InputError

    raise InputError(f"--num-draft-tokens {k}: this drafter proposes at most dspark_block_size={block} tokens per "
                     f"step; pass 1 .. {block}")


def draft_tokens(args, model) -> int:
    """K for `Engine(speculative=K)` (0 without --speculative), checked against the loaded drafter."""
    # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
    from dsv41_jax.model import dspark

    if args.speculative is None:
        return 0
    dspark.require_dspark(model)
    block = model.cfg.dspark_block_size
    k = block if args.num_draft_tokens is None else args.num_draft_tokens
    if k > block:
        _too_many(k, block)
    return k
