"""The up-front check of a training checkpoint folder (no orbax import, so the CLI runs it first)."""
from __future__ import annotations

import os
import pathlib

_ORBAX_TMP = ".orbax-checkpoint-tmp"
_PROBE = ".write-test-"


def check_directory(directory) -> pathlib.Path:
    """The absolute checkpoint folder, created if new; a ValueError saying why it cannot hold
    training checkpoints otherwise. Run before any step, so a bad --ckpt-dir costs no training.

    Refused: a path that is a file (or lies under one); a folder holding anything but step
    folders (named by their step, each with the `state` and `meta` items) and orbax's temporary
    folders of an interrupted save; a folder this process cannot write to.
    """
    path = pathlib.Path(directory).absolute()
    if path.exists() and not path.is_dir():
        raise ValueError(f"--ckpt-dir {path} is a file; checkpoints go into a folder: pass a new or existing "
                         "checkpoint folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--ckpt-dir {path} cannot be created: {e.strerror or e}") from None
    junk = []
    for entry in sorted(path.iterdir()):
        # another process of a multi-process run may be probing the same folder right now
        if _ORBAX_TMP in entry.name or entry.name.startswith(_PROBE):
            continue
        if entry.name.isdigit() and entry.is_dir():
            missing = [item for item in ("state", "meta") if not (entry / item).is_dir()]
            if missing:
                junk.append(f"{entry.name}/ (a step folder without {' and '.join(missing)})")
            continue
        junk.append(entry.name + ("/" if entry.is_dir() else ""))
    if junk:
        shown = ", ".join(junk[:5]) + (f" and {len(junk) - 5} more" if len(junk) > 5 else "")
        raise ValueError(f"--ckpt-dir {path} holds things that are not dsv41 training checkpoints: {shown}; "
                         "pass an empty folder, a new one, or one written by dsv41 train")
    probe = path / f"{_PROBE}{os.getpid()}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"--ckpt-dir {path} is not writable: {e.strerror or e}") from None
    return path
