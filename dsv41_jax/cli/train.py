"""`dsv41 train` (QAT fine-tuning) and `dsv41 demo` (the README's main job)."""
from __future__ import annotations

import argparse
import json
import sys

from dsv41_jax.cli import distributed
from dsv41_jax.cli.argtypes import non_negative_float, non_negative_int, positive_float, positive_int


def register(subparsers) -> None:
    s = subparsers.add_parser("train", help="QAT fine-tuning with optax and orbax",
                              description="Train (QAT) on text / JSONL / chat files; resumes from --ckpt-dir.")
    s.add_argument("--config", required=True, help="preset name (tiny, v41-flash) or config.json / checkpoint folder")
    s.add_argument("--data", required=True, nargs="+", help="text files, .jsonl files ({'text'} or {'messages'}), or folders")
    s.add_argument("--tokenizer", help="tokenizer.json or checkpoint folder (default: byte-level fallback tokenizer)")
    s.add_argument("--init-from", help="checkpoint folder (safetensors + config.json) whose FP8/FP4 weights to fine-tune")
    s.add_argument("--qat", dest="qat", action="store_true", default=True, help="fake-quantize FP8/FP4 weights (default)")
    s.add_argument("--no-qat", dest="qat", action="store_false", help="train the masters without weight fake-quant")
    s.add_argument("--lora", type=non_negative_int, default=0, metavar="RANK", help="train LoRA adapters of this rank instead of all weights")
    s.add_argument("--lora-alpha", type=float, default=0.0)
    s.add_argument("--mesh", help="device mesh, e.g. 'data=2,tensor=4' (default: all devices on data)")
    s.add_argument("--steps", type=positive_int, default=300)
    s.add_argument("--batch-size", type=positive_int, default=8)
    s.add_argument("--seq-len", type=positive_int, default=None, help="default: the config's max_seq_len")
    s.add_argument("--lr", type=positive_float, default=3e-4)
    s.add_argument("--warmup", type=non_negative_int, default=None, help="warmup steps (default: 5%% of --steps)")
    s.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw")
    s.add_argument("--weight-decay", type=float, default=0.1)
    s.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    s.add_argument("--lr-embed-mult", type=float, default=1.0)
    s.add_argument("--lr-engram-mult", type=float, default=5.0)
    s.add_argument("--balance-weight", type=float, default=1e-4)
    s.add_argument("--bias-rate", type=float, default=1e-3)
    s.add_argument("--indexer-kl-weight", type=float, default=1.0)
    s.add_argument("--kl-positions", type=non_negative_int, default=8)
    s.add_argument("--replay-prob", type=float, default=0.0, help="replay-aware decoder windows with this probability")
    s.add_argument("--impl", choices=("xla", "pallas", "auto"), default="xla",
                   help="kernels in the training forward: pallas runs the attention kernel (gradients through its "
                        "values-in VJP) and the indexer kernel for selection; the GEMMs stay XLA (QAT masters are "
                        "not packed). auto: the kernels on TPU/GPU, XLA on CPU (pallas on CPU runs interpreted: slow)")
    g = s.add_argument_group("DSpark drafter (--dspark)", "train only the speculative drafter (mtp.* stages) on the "
                             "frozen backbone's own taps and distributions, with DeepSpec's DSpark losses")
    g.add_argument("--dspark", action="store_true",
                   help="train the DSpark drafter instead of the backbone (frozen: bitwise unchanged); start from "
                        "--init-from a checkpoint whose backbone you will serve; --export writes both")
    g.add_argument("--dspark-anchors", type=positive_int, default=16, help="draft blocks per row and step")
    g.add_argument("--dspark-ce-weight", type=non_negative_float, default=0.1,
                   help="weight of the cross-entropy on the block's tokens")
    g.add_argument("--dspark-l1-weight", type=non_negative_float, default=0.9,
                   help="weight of the L1 distance between the draft and target distributions")
    g.add_argument("--dspark-confidence-weight", type=non_negative_float, default=1.0,
                   help="weight of the confidence head's BCE against the acceptance rate 1 - L1/2")
    g.add_argument("--dspark-decay-gamma", type=non_negative_float, default=4.0,
                   help="loss weight exp(-j/gamma) at block position j (0: no positional decay)")
    s.add_argument("--ckpt-dir", help="orbax checkpoint folder (resumes from its latest step)")
    s.add_argument("--accept-changed-settings", action="store_true",
                   help="resume even though the corpus, batch size, learning rate, seed or other settings differ "
                        "from the checkpoint's (shape-changing differences are always refused)")
    s.add_argument("--keep", type=positive_int, default=3, help="checkpoints to keep")
    s.add_argument("--save-every", type=positive_int, default=100)
    s.add_argument("--export", metavar="DIR", help="write the trained model in the served FP8/FP4 formats here "
                                                   "(an HF checkpoint folder; checked before training starts)")
    s.add_argument("--force", action="store_true",
                   help="let --export replace a non-empty checkpoint folder (atomically, once the new one is complete)")
    s.add_argument("--seed", type=non_negative_int, default=0)
    s.add_argument("--log-every", type=int, default=10)
    s.add_argument("--peak-tflops", type=float, default=None, help="per-device peak for the MFU estimate")
    s.add_argument("--no-progress", action="store_true")
    s.add_argument("--json", action="store_true",
                   help="print a JSON summary of the run on stdout (logs and progress stay on stderr)")
    distributed.add_arguments(s)
    s.set_defaults(func=_cmd_train)

    d = subparsers.add_parser("demo", help="train a tiny V4.1 with QAT on the stdlib's sources, save, generate")
    d.add_argument("--out", help="output folder (default: a new temporary folder)")
    d.add_argument("--steps", type=positive_int, help="training steps (default: 50)")
    d.add_argument("--time-budget", type=positive_float,
                   help="seconds of training after which to stop early on a slow machine (default: 90)")
    d.add_argument("--seed", type=non_negative_int, default=0)
    d.add_argument("--json", action="store_true",
                   help="print a JSON summary on stdout (the human-readable report goes to stderr)")
    d.set_defaults(func=_cmd_demo)


def _train_config(args, cfg, seq_len: int):
    """The TrainConfig the flags ask for (the DSpark loss only where the config has a drafter)."""
    # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
    from dsv41_jax.train.optim import OptimConfig
    from dsv41_jax.train.step import TrainConfig

    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 20)
    dspark = None
    if args.dspark:
        # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
        from dsv41_jax.train.dspark import DSparkLoss

        if not cfg.has_dspark:
            raise ValueError(f"--dspark: the config has no DSpark drafter (n_mtp_layers={cfg.n_mtp_layers}, "
                             f"dspark_block_size={cfg.dspark_block_size}); pass a config or checkpoint with one")
        dspark = DSparkLoss(anchors=args.dspark_anchors, ce_weight=args.dspark_ce_weight,
                            l1_weight=args.dspark_l1_weight, confidence_weight=args.dspark_confidence_weight,
                            decay_gamma=args.dspark_decay_gamma)
    tcfg = TrainConfig(seq_len=seq_len, batch_size=args.batch_size, steps=args.steps, seed=args.seed, qat=args.qat,
                       lora_rank=args.lora, lora_alpha=args.lora_alpha, balance_weight=args.balance_weight,
                       bias_rate=args.bias_rate, indexer_kl_weight=args.indexer_kl_weight,
                       kl_positions=args.kl_positions, replay_prob=args.replay_prob, impl=args.impl,
                       optim=OptimConfig(optimizer=args.optimizer, lr=args.lr, warmup_steps=warmup,
                                         total_steps=args.steps, weight_decay=args.weight_decay, clip_norm=args.clip,
                                         lr_embed_mult=args.lr_embed_mult, lr_engram_mult=args.lr_engram_mult),
                       dspark=dspark)
    return tcfg


def _cmd_train(args) -> int:
    if (rc := distributed.join(args, "dsv41 train")) is not None:  # first: before any other JAX call
        return rc
    # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
    from dsv41_jax.train.ckpt_dir import check_directory

    try:  # before the heavy imports and any work: a bad --ckpt-dir costs a second, not a run
        if args.ckpt_dir:
            check_directory(args.ckpt_dir)
    except ValueError as e:
        print(f"dsv41 train: {e}", file=sys.stderr)
        return 2
    # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
    from dsv41_jax.checkpoint.atomic import check_destination
    from dsv41_jax.config import ConfigError, ModelConfig
    from dsv41_jax.train import data as D
    from dsv41_jax.train.checkpoint import Checkpointer
    from dsv41_jax.train.export import export_checkpoint, masters_from_checkpoint
    from dsv41_jax.train.loop import prepare, train
    from dsv41_jax.train.params import serving_formats

    try:
        if args.export:  # found now, not after the training steps are spent
            check_destination(args.export, overwrite=args.force)
        cfg = ModelConfig.load(args.config)
        tok = D.load_tokenizer(args.tokenizer)
        if tok.vocab_size > cfg.vocab_size:
            raise ValueError(f"the tokenizer has {tok.vocab_size} tokens but the config's vocab_size is {cfg.vocab_size}")
        seq_len = args.seq_len or cfg.max_seq_len
        if seq_len > cfg.max_seq_len:
            cfg = cfg.replace(max_seq_len=seq_len)
        docs = D.read_documents(args.data, tok)
        rows = D.pack(docs, seq_len, D.alignment(cfg), tok.pad_id, args.seed)
        data = D.PackedData(rows, args.batch_size, args.seed, D.engram_setup(cfg, tok))
        tcfg = _train_config(args, cfg, seq_len)
        init = masters_from_checkpoint(args.init_from, serving_formats(cfg), cfg) if args.init_from else None
        ckpt = Checkpointer(args.ckpt_dir, keep=args.keep) if args.ckpt_dir else None
        # the tokenized corpus (so also the tokenizer), not its paths: moving the files is no change
        settings = {"corpus": f"{len(docs)} documents, sha256 {D.corpus_digest(docs)[:16]}"}
        # bad --mesh, a batch the mesh cannot split, a checkpoint of another run: usage errors
        run = prepare(cfg, tcfg, mesh_spec=args.mesh, init_master=init, checkpointer=ckpt, settings=settings,
                      accept_changes=args.accept_changed_settings)
    except (ConfigError, ValueError, OSError) as e:
        print(f"dsv41 train: {e}", file=sys.stderr)
        return 2
    import jax

    start = run.step
    lead = jax.process_index() == 0  # across processes: one progress bar, one export writer
    print(f"dsv41 train: {len(docs)} documents -> {rows['tokens'].shape[0]} rows of {seq_len}; mesh "
          f"{dict(run.mesh.shape)}; starting at step {start}", file=sys.stderr)
    history = train(run, data, checkpointer=ckpt, save_every=args.save_every, progress=not args.no_progress and lead,
                    log_every=args.log_every, peak_tflops=args.peak_tflops)
    if ckpt is not None:
        ckpt.close()
    out = None
    if args.export:
        master = run.export_master()  # every process takes part in gathering the shards
        if lead:
            out = export_checkpoint(args.export, cfg, master, run.formats, overwrite=args.force, tokenizer=tok)
            print(f"dsv41 train: exported the served FP8/FP4 checkpoint to {out}", file=sys.stderr)
    if args.json:
        print(json.dumps({"start_step": start, "step": run.step, "documents": len(docs),
                          "rows": int(rows["tokens"].shape[0]), "seq_len": seq_len, "mesh": dict(run.mesh.shape),
                          "checkpoint_dir": str(ckpt.directory) if ckpt else None,
                          "export": str(out) if out else None,
                          "process": jax.process_index(), "processes": jax.process_count(),
                          "losses": [m["loss"] for m in history],
                          "first": history[0] if history else None, "last": history[-1] if history else None},
                         indent=1))
    return 0


def _cmd_demo(args) -> int:
    report = sys.stderr if args.json else sys.stdout
    print("dsv41 demo: starting (loading JAX; the whole demo takes about 4 minutes on 2 CPU cores)", file=report,
          flush=True)
    # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
    from dsv41_jax.cli.demo import run_demo

    kw = {k: v for k, v in (("steps", args.steps), ("time_budget", args.time_budget)) if v is not None}
    if args.json:
        kw["print_fn"] = lambda line: print(line, file=sys.stderr, flush=True)
    try:
        summary = run_demo(args.out, seed=args.seed, **kw)
    except FileExistsError as e:
        print(f"dsv41 demo: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(summary, indent=1))
    # the demo is also CI's end-to-end check: training that does not learn is a failure
    if not summary["last_ce"] < 0.7 * summary["first_ce"]:
        print(f"dsv41 demo: the loss did not fall below 70% of its start ({summary['first_ce']:.3f} -> "
              f"{summary['last_ce']:.3f} nats/byte in {summary['steps']} steps)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(prog="dsv41")
    register(p.add_subparsers(dest="command", required=True))
    a = p.parse_args()
    sys.exit(a.func(a))
