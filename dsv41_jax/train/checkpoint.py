"""Training checkpoints with orbax: async saves, the last N kept, exact resume, any mesh.

A checkpoint holds the whole train state (step, masters, router biases, adapters, optimizer
state) and a JSON record of where the data stream stands (the next batch index) plus the
configs of the run. Restoring takes the shardings of the *current* mesh, so a run saved on
one mesh layout continues on another.
"""
from __future__ import annotations

import pathlib

import orbax.checkpoint as ocp

from dsv41_jax.train.ckpt_dir import check_directory


class Checkpointer:
    """A thin CheckpointManager wrapper with the two items a run needs (state, meta)."""

    def __init__(self, directory, *, keep: int = 3, async_save: bool = True, save_every: int = 1):
        self.directory = check_directory(directory)
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, save_interval_steps=save_every,
                                               enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "meta"))

    def save(self, step: int, state: dict, meta: dict, *, force: bool = False) -> bool:
        """Start saving (returns at once when async). `meta` must be JSON-serialisable."""
        return self.manager.save(int(step), args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                                     meta=ocp.args.JsonSave(meta)), force=force)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def restore(self, step: int | None, abstract_state) -> tuple[dict, dict]:
        """(state, meta) at `step` (latest if None), laid out as `abstract_state` says:
        a tree of jax.ShapeDtypeStruct with the target shardings."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        out = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                                                  meta=ocp.args.JsonRestore()))
        return out["state"], out["meta"]

    def read_meta(self, step: int | None = None) -> dict:
        step = self.latest_step() if step is None else step
        return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

