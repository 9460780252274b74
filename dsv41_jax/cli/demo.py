"""`dsv41 demo`: QAT-train a tiny V4.1-architecture model on the Python standard library's
own source files, save it with orbax, export it to the served FP8/FP4 formats, generate from
the exported model, and print the cache-memory and prefill-savings figures.

Runs on a fresh CPU machine in a few minutes with no downloads; a wall-clock budget stops
training early on a slow machine (the loss still falls well before the last step).
"""
from __future__ import annotations

import pathlib
import sys
import sysconfig
import tempfile
import threading
import time

import numpy as np

from dsv41_jax.config import ModelConfig
from dsv41_jax.train import data as D
from dsv41_jax.train.optim import OptimConfig
from dsv41_jax.train.step import TrainConfig

# The context the exported checkpoint is served with: a tools prompt (about 1.1K byte tokens for one
# tool) and a thinking turn fit. Training rows stay short; only the caches a server allocates grow.
SERVE_CONTEXT = 8192


def _say(line: str) -> None:
    print(line, flush=True)  # flushed: progress must show when the output is a pipe or a CI log


HEARTBEAT_S = 15.0  # the demo never stays silent longer: a line says what it is still doing


class Heartbeat:
    """`print_fn` that also, from a thread, prints what the demo is still doing (its last line) once
    nothing was printed for `every` seconds: compiles, the export and the sampling print nothing
    for a minute or more on a busy 2-core machine. A context manager: the thread runs inside it."""

    def __init__(self, print_fn, every: float = HEARTBEAT_S):
        self.print_fn, self.every = print_fn, every
        self.lock, self.stop = threading.Lock(), threading.Event()
        self.last = self.since = time.monotonic()
        self.phase = "starting"
        self.thread = threading.Thread(target=self._beat, name="dsv41-demo-heartbeat", daemon=True)

    def __call__(self, line: str) -> None:
        with self.lock:
            self.last = self.since = time.monotonic()
            self.phase = (line.strip().splitlines() or [""])[-1][:80]
            self.print_fn(line)

    def _beat(self):
        while not self.stop.wait(1.0):
            with self.lock:
                now = time.monotonic()
                if now - self.last >= self.every:
                    self.print_fn(f"  ... still working, {now - self.since:.0f} s after: {self.phase}")
                    self.last = now

    def __enter__(self) -> "Heartbeat":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def demo_config(tokenizer: D.ByteTokenizer, seq_len: int = 128) -> ModelConfig:
    """Every V4.1 layer role at toy size: SWA, Full ratio 2 (+Engram), Reuse, Full ratio 1
    (candidate-pool source, first decoder layer), Reindex inside the pool."""
    texts_vocab = D.engram_token_map(tokenizer)[1]
    return ModelConfig.tiny(
        vocab_size=tokenizer.vocab_size, n_layers=5, compress_ratios=(0, 2, 2, 1, 1), kv_source_layers=(1, 3),
        index_source_layers=(1, 3, 4), candidate_source_layer=3, candidate_topk_blocks=5, candidate_block_size=4,
        index_topk=16, window_size=16, engram_layer_ids=(1,), engram_compressed_vocab_size=texts_vocab,
        max_seq_len=seq_len, max_batch_size=8, **demo_drafter(tokenizer))


def demo_drafter(tokenizer: D.ByteTokenizer) -> dict:
    """The demo model's DSpark drafter: one stage on the taps of layers 2-4, blocks of 4 (3 drafts
    after the anchor); the noise token is the pad id, which no training label uses."""
    return dict(n_mtp_layers=1, dspark_block_size=4, dspark_noise_token_id=tokenizer.pad_id,
                dspark_target_layer_ids=(2, 3, 4), dspark_markov_rank=32, dspark_n_routed_experts=4,
                dspark_n_activated_experts=2)


def stdlib_corpus(max_bytes: int = 2_000_000) -> list[pathlib.Path]:
    """The standard library's top-level .py files, in sorted order, up to `max_bytes`."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for f in sorted(root.glob("*.py")):
        size = f.stat().st_size
        if total + size > max_bytes:
            break
        files.append(f)
        total += size
    if not files:
        raise FileNotFoundError(f"no Python source files found in {root}")
    return files


def cache_figures(cfg: ModelConfig, context: int) -> dict:
    """Per-sequence cache bytes at `context` tokens and the CED split's prefill saving."""
    # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
    from dsv41_jax.model.info import model_info

    info = model_info(cfg)
    exact = context * info["active_params_decode"]
    split_ = context * info["active_params_prefill_split"] + min(cfg.window_size, context) * (
        info["active_params_decode"] - info["active_params_prefill_split"])
    return {"global_kv_bytes_per_token": info["global_kv_bytes_per_token"],
            "global_kv_bytes": info["global_kv_bytes_per_token"] * context,
            "window_bytes": info["window_bytes_per_sequence"],
            "prefill_exact_flops": 2 * exact, "prefill_split_flops": 2 * split_,
            "prefill_saving": 1 - split_ / exact}


def format_figures(name: str, cfg: ModelConfig, context: int, figures: dict | None = None) -> str:
    f = figures or cache_figures(cfg, context)
    mib = 2 ** 20
    return (f"  {name} at {context:,} tokens of context:\n"
            f"    persistent global KV  {f['global_kv_bytes_per_token']:.1f} B/token -> {f['global_kv_bytes'] / mib:,.2f} MiB per sequence\n"
            f"    disposable window KV  {f['window_bytes'] / mib:,.2f} MiB per sequence (never persisted)\n"
            f"    prefill compute       exact {f['prefill_exact_flops']:.3g} FLOP, CED split {f['prefill_split_flops']:.3g} FLOP "
            f"({100 * f['prefill_saving']:.0f}% saved)")


def serve_hint(served_dir, context: int) -> str:
    """What to run next: serve the exported checkpoint and send it a request."""
    return (f"next: serve it ({context:,} tokens of context) with\n"
            f"  dsv41 serve --checkpoint {served_dir}\n"
            "and, from another shell, ask it something:\n"
            "  curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\\n"
            "    -d '{\"messages\": [{\"role\": \"user\", \"content\": \"def \"}], \"max_tokens\": 40}'")


def acceptance_length(engine) -> float:
    """Tokens emitted per speculating target forward: 1 + accepted drafts per drafting step."""
    st = engine.spec_stats
    steps = st["drafted"] / max(engine.K, 1)
    return 1.0 + st["accepted"] / steps if steps else 0.0


def train_drafter(cfg: ModelConfig, master: dict, data, *, steps: int, seed: int = 0, time_budget: float = 15.0,
                  progress: bool = True, print_fn=_say, batch_size: int | None = None) -> dict:
    """Train the DSpark drafter (mtp.*) of a trained backbone on the same rows (`dsv41 train --dspark`);
    returns {"master": the masters with the trained drafter, "steps", "first_tau", "last_tau"}.
    time_budget bounds the steps after the first 10 (which include compiling the step)."""
    # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
    from dsv41_jax.train.dspark import DSparkLoss
    from dsv41_jax.train.loop import format_metrics, prepare, train

    tcfg = TrainConfig(seq_len=data.rows["tokens"].shape[1], batch_size=batch_size or data.batch_size, steps=steps,
                       seed=seed, qat=True, kl_positions=0, dspark=DSparkLoss(anchors=16),
                       fast_compile=True,  # a few dozen steps of a tiny model: compiling dominates
                       optim=OptimConfig(lr=3e-3, warmup_steps=5, total_steps=steps, weight_decay=0.0))
    run = prepare(cfg, tcfg, init_master=master)
    print_fn(f"training the DSpark drafter ({cfg.n_mtp_layers} stage, blocks of {cfg.dspark_block_size}; backbone "
             "frozen): compiling its step, then 10 steps a line ...")
    history, deadline = [], None
    while run.step < steps:
        history += train(run, data, steps=min(steps, run.step + 10), progress=False, log_every=0)
        if progress:
            print_fn(format_metrics(history[-1]))
        if deadline is None:
            deadline = time.perf_counter() + time_budget
        elif time.perf_counter() > deadline and run.step < steps:
            print_fn(f"(drafter time budget of {time_budget:.0f}s reached: stopping at step {run.step})")
            break
    first, last = history[0]["tau"], float(np.mean([h["tau"] for h in history[-5:]]))
    print_fn(f"drafter: expected acceptance length (tau, teacher-forced) {first:.2f} -> {last:.2f} in {run.step} steps")
    return {"master": run.master(), "steps": run.step, "first_tau": first, "last_tau": last}


def _sample_speculative(model, tok, engram, *, seed: int, tokens: int, print_fn) -> tuple[str, float]:
    """Sample `tokens` after "def " from the exported model on a one-slot engine that speculates with
    its DSpark drafter; print the text and the acceptance. Returns (text, mean acceptance length)."""
    # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
    from dsv41_jax.serving.engine import Engine
    from dsv41_jax.serving.generate import generate
    from dsv41_jax.serving.sampling import SamplingParams

    prompt, cfg = "def ", model.cfg
    engine = Engine(model, slots=1, max_seq_len=cfg.max_seq_len, min_capacity=min(256, cfg.max_seq_len),
                    prefill_chunk=1, exact_prefill=True, engram=engram, speculative=cfg.dspark_block_size - 1)
    ids = generate(engine, [tok.bos_id] + tok.encode(prompt), max_new_tokens=tokens,
                   sampling=SamplingParams(temperature=0.7, seed=seed), stop_tokens=(tok.eos_id,)).tokens
    text = prompt + tok.decode(ids, skip_special=True)
    print_fn("-" * 60 + "\n" + text + "\n" + "-" * 60)
    acceptance = acceptance_length(engine)
    print_fn(f"speculation: mean acceptance length {acceptance:.2f} tokens per target forward "
             f"({engine.spec_stats['accepted']} of {engine.spec_stats['drafted']} drafts accepted, T=0.7)")
    return text, acceptance


def run_demo(out_dir=None, *, progress: bool = True, print_fn=_say, **options) -> dict:
    """The whole demo (`_demo`, its `options`); returns a summary (losses, paths, sample text,
    figures, seconds). With `progress`, never silent for more than `HEARTBEAT_S` seconds (`Heartbeat`)."""
    if not progress:
        return _demo(out_dir, progress=False, print_fn=print_fn, **options)
    with Heartbeat(print_fn) as beat:
        return _demo(out_dir, progress=True, print_fn=beat, **options)


def _demo(out_dir=None, *, steps: int = 50, batch_size: int = 8, seq_len: int = 128, time_budget: float = 90.0,
          seed: int = 0, progress: bool = True, print_fn=_say, sample_tokens: int = 64,
          serve_context: int = SERVE_CONTEXT, drafter_steps: int = 40, drafter_budget: float = 15.0) -> dict:
    """`run_demo`'s steps. `time_budget` bounds the training steps after the first 10 (which include
    compiling the step): on a slow or busy machine the run stops early; the loss has long fallen by then."""
    # deferred: the CLI loads nothing of the model before a command runs (fast --help and input errors)
    from dsv41_jax.train.checkpoint import Checkpointer
    from dsv41_jax.train.export import export_checkpoint, load_exported
    from dsv41_jax.train.loop import format_metrics, prepare, train

    t0 = time.perf_counter()
    out = pathlib.Path(out_dir) if out_dir else pathlib.Path(tempfile.mkdtemp(prefix="dsv41-demo-"))
    if (out / "checkpoints").exists() and any((out / "checkpoints").iterdir()):
        raise FileExistsError(f"{out / 'checkpoints'} already holds a run; give the demo a new --out folder")
    tok = D.ByteTokenizer()
    cfg = demo_config(tok, seq_len)
    files = stdlib_corpus()
    docs = D.read_documents(files, tok)
    engram = D.engram_setup(cfg, tok)
    data = D.PackedData(D.pack(docs, seq_len, D.alignment(cfg), tok.pad_id, seed), batch_size, seed, engram)
    print_fn(f"corpus: {len(files)} standard-library files, {sum(len(d.ids) for d in docs):,} byte tokens, "
             f"{data.rows['tokens'].shape[0]} packed rows of {seq_len}")
    tcfg = TrainConfig(seq_len=seq_len, batch_size=batch_size, steps=steps, seed=seed, qat=True, kl_positions=8,
                       optim=OptimConfig(lr=3e-3, warmup_steps=20, total_steps=steps, weight_decay=0.01))
    ckpt = Checkpointer(out / "checkpoints", keep=2)
    run = prepare(cfg, tcfg, checkpointer=ckpt)
    print_fn(f"model: tiny V4.1 ({cfg.n_layers} layers: " + ", ".join(f"{r.kind}" + (f"/r{r.ratio}" if r.ratio else "")
                                                                  for r in cfg.roles) + "), QAT on")
    print_fn("compiling the QAT training step (about a minute on 2 CPU cores), then training, 10 steps a line ...")
    history = []
    deadline = None
    while run.step < steps:
        stop = min(steps, run.step + 10)
        history += train(run, data, steps=stop, progress=False, log_every=0)
        if progress:
            print_fn(format_metrics(history[-1]))
        if deadline is None:
            deadline = time.perf_counter() + time_budget  # the first block compiled the step
            t_compiled = time.perf_counter()
        elif time.perf_counter() > deadline and run.step < steps:
            print_fn(f"(time budget of {time_budget:.0f}s reached: stopping at step {run.step})")
            break
    ckpt.save(run.step, run.state, {"next_batch": run.step, "model_config": cfg.to_flat_dict()}, force=True)
    ckpt.close()
    t_trained = time.perf_counter()
    first = float(np.mean([h["ce"] for h in history[:10]]))
    last = float(np.mean([h["ce"] for h in history[-10:]]))
    print_fn(f"cross-entropy: first 10 steps {first:.3f} -> last 10 steps {last:.3f} nats/byte "
             f"({run.step} steps; setup, compilation and the first 10: {t_compiled - t0:.0f}s, the rest: {t_trained - t_compiled:.0f}s); "
             f"orbax checkpoint in {ckpt.directory}")

    drafter = train_drafter(cfg, run.master(), data, steps=drafter_steps, seed=seed, time_budget=drafter_budget,
                            progress=progress, print_fn=print_fn)
    print_fn("exporting the served FP8/FP4 checkpoint (backbone and drafter) ...")
    served_dir = export_checkpoint(out / "served", cfg.replace(max_seq_len=serve_context), drafter["master"],
                                   run.formats, tokenizer=tok)
    _, model = load_exported(served_dir, cfg.replace(max_seq_len=2 * seq_len, max_batch_size=1))
    print_fn(f"exported to {served_dir}; sampling from it with speculative decoding "
             f"({cfg.dspark_block_size - 1} drafts per step; compiling the engine's programs first) ...")
    text, acceptance = _sample_speculative(model, tok, engram, seed=seed, tokens=sample_tokens, print_fn=print_fn)
    print_fn("cache memory and prefill savings (dsv41_jax.model.info.model_info):")
    figures = {"demo_model_1k": cache_figures(cfg, 1024),
               "v41_flash_128k": cache_figures(ModelConfig.v41_flash(), 131072)}
    print_fn(format_figures("this demo model", cfg, 1024, figures["demo_model_1k"]))
    print_fn(format_figures("DeepSeek-V4.1-Flash", ModelConfig.v41_flash(), 131072, figures["v41_flash_128k"]))
    seconds = time.perf_counter() - t0
    print_fn(f"demo finished in {seconds:.0f}s")
    print_fn(serve_hint(served_dir, serve_context))
    return {"first_ce": first, "last_ce": last, "steps": run.step, "out": str(out), "sample": text,
            "drafter_steps": drafter["steps"], "drafter_first_tau": drafter["first_tau"],
            "drafter_last_tau": drafter["last_tau"], "acceptance_length": acceptance,
            "checkpoint": str(ckpt.directory), "served": str(served_dir), "served_context": serve_context,
            "figures": figures, "seconds": seconds}


if __name__ == "__main__":
    run_demo()
    sys.exit(0)
