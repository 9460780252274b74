"""A training run: build or restore the state on a mesh, step through the data, checkpoint.

Batch i of the data feeds step i, so the state's step counter is also the data position; it
is saved with every checkpoint (meta "next_batch") and a resumed run continues with exactly
the batches and per-step random draws an uninterrupted run would have used.
"""
from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass

import jax
import numpy as np

from dsv41_jax.config import ModelConfig
from dsv41_jax.train import mesh as meshlib
from dsv41_jax.train import throughput
from dsv41_jax.train.checkpoint import Checkpointer
from dsv41_jax.train.params import serving_formats, serving_graph
from dsv41_jax.train.qat_modules import build_training_model
from dsv41_jax.train.resume import check_resume
from dsv41_jax.train.step import TrainConfig, full_master, init_state, make_train_step


@dataclass
class Run:
    """Everything a run needs between steps."""

    cfg: ModelConfig
    tcfg: TrainConfig
    formats: dict
    graphdef: object
    mesh: object
    state: dict
    state_shardings: object
    batch_sharding: object
    step_fn: object
    settings: dict = dataclasses.field(default_factory=dict)  # corpus digest, data, tokenizer (dsv41_jax.train.resume)

    @property
    def step(self) -> int:
        return int(jax.device_get(self.state["step"]))

    def master(self) -> dict:
        """fp32 masters with biases and merged adapters (export these), on the mesh."""
        return full_master(self.state, self.tcfg)

    def export_master(self) -> dict:
        """`master()` in a form one process can export: across processes each holds only its shards,
        so they are gathered into host numpy arrays, whole on every process (process_allgather: a
        collective every process must call; the fp32 masters must fit in one host's memory)."""
        master = self.master()
        if jax.process_count() == 1:
            return master
        from jax.experimental import multihost_utils

        return multihost_utils.process_allgather(master, tiled=True)

    def batch_rows(self) -> tuple[int, int]:
        """The rows [lo, hi) of each global batch that this process's devices hold."""
        return meshlib.process_rows(self.batch_sharding, self.tcfg.batch_size)

    def put_batch(self, batch: dict) -> dict:
        """The global batch from this process's rows of it (`batch_rows`; all rows on one process)."""
        lo, hi = self.batch_rows()
        out = {}
        for k, v in batch.items():
            v = np.asarray(v)
            if v.shape[0] != hi - lo:
                raise ValueError(f"batch item {k!r} has {v.shape[0]} rows; this process feeds rows {lo}:{hi}")
            out[k] = jax.make_array_from_process_local_data(self.batch_sharding, v,
                                                            (self.tcfg.batch_size, *v.shape[1:]))
        return out


def _meta(run: Run, next_batch: int) -> dict:
    return {"next_batch": int(next_batch), "model_config": run.cfg.to_flat_dict(),
            "train_config": json_ready(dataclasses.asdict(run.tcfg)), "run_settings": json_ready(run.settings)}


def json_ready(d):
    if isinstance(d, dict):
        return {k: json_ready(v) for k, v in d.items()}
    if isinstance(d, tuple):
        return list(d)
    return d


def prepare(cfg: ModelConfig, tcfg: TrainConfig, *, mesh_spec: str | None = None, init_master: dict | None = None,
            checkpointer: Checkpointer | None = None, restore_step: int | None = None, settings: dict | None = None,
            accept_changes: bool = False, log=None) -> Run:
    """A Run on `mesh_spec`: restored from `checkpointer` when it holds a checkpoint, else
    fresh (from `init_master` fp32 masters, e.g. imported released weights, or a random init).

    settings: what else identifies the run (corpus digest, data paths, tokenizer), stored with
    every checkpoint; a resume with other settings is refused unless `accept_changes`
    (dsv41_jax.train.resume), and shape-changing ones always are, before orbax restores anything.
    """
    settings = dict(settings or {})
    resume = checkpointer is not None and (restore_step is not None or checkpointer.latest_step() is not None)
    if resume:  # the stored settings first: a refused resume costs no model building
        step = checkpointer.latest_step() if restore_step is None else restore_step
        where = f"the checkpoint at step {step} in {checkpointer.directory}"
        try:
            saved_meta = checkpointer.read_meta(step)
        except Exception as e:  # orbax raises assorted types for a missing or damaged step
            raise ValueError(f"{where} cannot be read ({type(e).__name__}: {_first_line(e)}); "
                             "pass a folder written by dsv41 train, or a new --ckpt-dir") from None
        check_resume(saved_meta, model_config=cfg.to_flat_dict(), train_config=json_ready(dataclasses.asdict(tcfg)),
                     settings=json_ready(settings), where=where, accept_changes=accept_changes,
                     log=log or (lambda line: print(f"dsv41 train: {line}", file=sys.stderr)))
    abstract_flat = serving_graph(cfg)[1]
    formats = serving_formats(cfg, abstract_flat)
    graphdef, master_shapes = build_training_model(cfg, formats, seed=tcfg.seed, exact_mhc=tcfg.exact_mhc, abstract=True)
    mesh = meshlib.make_mesh(mesh_spec)
    meshlib.check_batch(mesh, tcfg.batch_size)
    abstract = jax.eval_shape(lambda m: init_state(m, tcfg), master_shapes)
    shardings = meshlib.state_shardings(mesh, abstract, meshlib.param_shapes_of(abstract))
    if resume:
        target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
        try:
            state, meta = checkpointer.restore(step, target)
        except Exception as e:
            raise ValueError(f"{where} does not fit this run ({type(e).__name__}: {_first_line(e)}); "
                             "pass the settings it was trained with, or a new --ckpt-dir") from None
        if int(meta["next_batch"]) != int(jax.device_get(state["step"])):
            raise ValueError(f"checkpoint meta says next batch {meta['next_batch']} but the state is at step "
                             f"{int(jax.device_get(state['step']))}")
    else:
        if init_master is None:
            _, init_master = build_training_model(cfg, formats, seed=tcfg.seed)
        missing = set(master_shapes) ^ set(init_master)
        if missing:
            raise ValueError(f"initial masters do not match the model: {sorted(missing)[:5]}")
        # host values laid out on the mesh first: across processes jit takes only global arrays
        # (every process computed the same init_master from the same seed / checkpoint)
        init_master = {k: meshlib.global_from_host(mesh, k, v) for k, v in init_master.items()}
        state = jax.jit(lambda m: init_state(m, tcfg), out_shardings=shardings)(init_master)
    batch_sh = meshlib.batch_sharding(mesh)
    step_fn = make_train_step(meshlib.step_graph(graphdef, master_shapes, mesh), formats, cfg, tcfg,
                              state_shardings=shardings, batch_sharding=batch_sh)
    return Run(cfg, tcfg, formats, graphdef, mesh, state, shardings, batch_sh, step_fn, settings)


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0][:300] if text else "no message"


def train(run: Run, data, *, steps: int | None = None, checkpointer: Checkpointer | None = None, save_every: int = 0,
          progress: bool = True, log_every: int = 10, peak_tflops: float | None = None, log=None) -> list[dict]:
    """Step `run` up to `steps` (default tcfg.steps); returns per-step metrics (floats)."""
    total = steps if steps is not None else run.tcfg.steps
    start = run.step
    log = log or (lambda s: print(s, file=sys.stderr))
    fpt = throughput.flops_per_token(run.cfg, run.tcfg.seq_len)
    peak = throughput.peak_flops(peak_tflops * 1e12 if peak_tflops else None)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, initial=start, desc="train", unit="step", dynamic_ncols=True, file=sys.stderr)
    history = []
    t_last = time.perf_counter()
    for i in range(start, total):
        batch = run.put_batch(data.batch(i, rows=run.batch_rows()))
        run.state, metrics = run.step_fn(run.state, batch)
        m = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        dt, t_last = now - t_last, now
        m["step"] = i + 1
        m["tokens_per_s"] = data.tokens_per_batch / max(dt, 1e-9)
        # the FLOP count is the backbone's training step; the drafter's step is another program
        m["mfu"] = throughput.mfu(m["tokens_per_s"], fpt, peak) if run.tcfg.dspark is None else None
        history.append(m)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{m['loss']:.3f}", ce=f"{m['ce']:.3f}", tok_s=f"{m['tokens_per_s']:.0f}")
        if log_every and ((i + 1) % log_every == 0 or i + 1 == total):
            line = format_metrics(m)
            bar.write(line, file=sys.stderr) if bar is not None else log(line)
        if checkpointer is not None and save_every and (i + 1) % save_every == 0 and i + 1 < total:
            checkpointer.save(i + 1, run.state, _meta(run, i + 1))
    if bar is not None:
        bar.close()
    if checkpointer is not None and total > start:
        checkpointer.save(total, run.state, _meta(run, total), force=True)
        checkpointer.wait()
    return history


def format_metrics(m: dict) -> str:
    mfu = "n/a" if m.get("mfu") is None else f"{100 * m['mfu']:.1f}%"
    if "tau" in m:  # the drafter's step (dsv41_jax.train.dspark)
        return (f"step {m['step']:5d}  loss {m['loss']:.4f}  ce {m['ce']:.4f}  l1 {m['l1']:.4f}  "
                f"confidence_bce {m['confidence_bce']:.4f}  accept {m['accept_rate']:.3f}  tau {m['tau']:.3f}  "
                f"load_max/mean {m['load_imbalance']:.2f}  grad_norm {m['grad_norm']:.3f}  lr {m['lr']:.2e}  "
                f"tok/s {m['tokens_per_s']:.0f}")
    return (f"step {m['step']:5d}  loss {m['loss']:.4f}  ce {m['ce']:.4f}  balance {m['balance']:.4f}  "
            f"indexer_kl {m['indexer_kl']:.4f}  load_max/mean {m['load_imbalance']:.2f}  grad_norm {m['grad_norm']:.3f}  "
            f"lr {m['lr']:.2e}  tok/s {m['tokens_per_s']:.0f}  MFU {mfu}")
