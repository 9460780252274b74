"""Resuming a run: compare the settings stored with a checkpoint with the ones given now.

Every checkpoint's meta holds the model config, the train config and the run's settings (the
corpus digest, data paths, tokenizer; `loop.prepare(settings=...)`). Before orbax restores a
byte, a resume is checked against them:
- a different model config, LoRA rank or optimizer changes the shapes of the saved state: refused;
- any other difference (corpus, batch size, learning rates, seed, ...) changes what the resumed
  run computes without changing shapes: listed, and refused unless `accept_changes` is set;
- the step count and compile options may differ (a resumed run is usually asked for more steps).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping

SHAPE_FIELDS = ("lora_rank", "optim.optimizer")
FREE_FIELDS = ("steps", "optim.total_steps", "fast_compile")
ACCEPT_FLAG = "--accept-changed-settings"


def flatten(tree: Mapping, prefix: str = "") -> dict:
    """{"optim": {"lr": 1}} -> {"optim.lr": 1}; tuples become lists (as JSON stores them)."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        else:
            out[name] = list(value) if isinstance(value, tuple) else value
    return out


def differences(saved: Mapping, current: Mapping, fields=None) -> list[str]:
    """'name: checkpoint X, now Y' for each differing (or one-sided) field, sorted."""
    names = sorted(set(saved) | set(current)) if fields is None else fields
    missing = "<absent>"
    return [f"{n}: checkpoint {saved.get(n, missing)!r}, now {current.get(n, missing)!r}"
            for n in names if saved.get(n, missing) != current.get(n, missing)]


def check_resume(meta: Mapping, *, model_config: Mapping, train_config: Mapping, settings: Mapping,
                 where: str, accept_changes: bool, log: Callable[[str], None]) -> None:
    """Raise ValueError for a resume that cannot or should not continue; log accepted changes.

    model_config: `cfg.to_flat_dict()`; train_config: the TrainConfig as a (nested) dict;
    settings: the run's other settings; where: "the checkpoint at step N in DIR" for messages.
    """
    saved_model = meta.get("model_config")
    if saved_model:
        diff = differences(flatten(saved_model), flatten(model_config))
        if diff:
            raise ValueError(f"{where} was trained with another model config ({'; '.join(diff[:6])}"
                             f"{' ...' if len(diff) > 6 else ''}); pass the same --config or a new --ckpt-dir")
    saved_train = flatten(meta.get("train_config") or {})
    current_train = flatten(train_config)
    if saved_train:
        diff = differences(saved_train, current_train, SHAPE_FIELDS)
        if diff:
            raise ValueError(f"{where} cannot continue with these settings: {'; '.join(diff)} changes the shapes "
                             "of the saved state; use the checkpoint's values or a new --ckpt-dir")
    changed = [] if not saved_train else differences(
        saved_train, current_train, sorted(n for n in set(saved_train) | set(current_train)
                                           if n not in SHAPE_FIELDS + FREE_FIELDS))
    if "run_settings" in meta:
        changed += differences(flatten(meta["run_settings"] or {}), flatten(settings))
    if not changed:
        return
    listing = "; ".join(changed)
    if not accept_changes:
        raise ValueError(f"{where} was written with other settings: {listing}. Resuming would silently change "
                         f"the run; pass the same settings, a new --ckpt-dir, or {ACCEPT_FLAG} to resume with these")
    log(f"warning: resuming {where} with changed settings: {listing}")
