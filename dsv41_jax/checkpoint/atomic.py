"""Writing files and checkpoint folders so that a crash never leaves a half-written one behind.

Every file a checkpoint writer produces goes through `atomic_file`: it is written to a hidden
temporary sibling (`.NAME.tmp-PID-XXXX`), flushed and fsynced, then renamed over NAME, so a
reader sees the old file or the new one, never a prefix. A whole checkpoint folder goes
through `atomic_folder`: it is built in a hidden temporary sibling of the destination, and only
when it is complete does it replace the destination (an atomic exchange of the two folders
where the OS has one, else two renames), after which the old contents are removed. A process
killed mid-write leaves the destination as it was, plus the temporary sibling, which the next
write to the same destination removes once its process is gone (docs/TROUBLESHOOTING.md,
"Checkpoint files").

`check_destination` is the policy of what a writer may replace: never a folder that holds, or
lies inside, the checkpoint being read, and with `--force` only a folder that looks like a
checkpoint, so that no file the writer did not write is deleted.

Test hook: with the environment variable `DSV41_TEST_KILL_AFTER_BYTES=N`, the process kills
itself (SIGKILL) once N bytes have gone through `atomic_file` writers, which is how the tests
interrupt real `convert` / `export` processes mid-write.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import pathlib
import re
import secrets
import shutil
import signal
from typing import Iterator

KILL_AFTER_ENV = "DSV41_TEST_KILL_AFTER_BYTES"
_written = 0  # bytes written through atomic_file in this process (for the kill hook)

# what a checkpoint folder may hold; `--force` refuses to replace a folder with anything else
_CHECKPOINT_NAMES = re.compile(r"^(config\.json|tokenizer\.json|tokenizer_config\.json|generation_config\.json"
                               r"|special_tokens_map\.json|model\.safetensors\.index\.json|[^/]+\.safetensors|params"
                               r"|README\.md|LICENSE|\.gitattributes|\.cache|\.DS_Store)$")


def _count(n: int) -> None:
    """The kill hook: SIGKILL this process once KILL_AFTER_ENV bytes have been written."""
    global _written
    _written += n
    limit = os.environ.get(KILL_AFTER_ENV)
    if limit is not None and _written >= int(limit):
        os.kill(os.getpid(), signal.SIGKILL)


class _HookedFile:
    """A binary file whose writes are counted for the kill hook (and cut at its limit)."""

    def __init__(self, f):
        self._f = f

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        limit = os.environ.get(KILL_AFTER_ENV)
        if limit is not None and _written + len(view) >= int(limit):
            keep = max(0, int(limit) - _written)
            self._f.write(view[:keep])  # the partial write a crash leaves, on disk before the kill
            self._f.flush()
            os.fsync(self._f.fileno())
            _count(len(view))
        n = self._f.write(view)
        _count(n)
        return n


def _tmp_name(path: pathlib.Path, kind: str) -> pathlib.Path:
    return path.with_name(f".{path.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}")


def _fsync_dir(folder: pathlib.Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems cannot fsync a directory; the rename is still atomic
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path) -> Iterator[_HookedFile]:
    """`with atomic_file(p) as f: f.write(b)`: p appears complete, or not at all."""
    path = pathlib.Path(path)
    tmp = _tmp_name(path, "tmp")
    try:
        with open(tmp, "wb") as f:
            yield _HookedFile(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def write_text(path, text: str) -> None:
    """Write a small text file (config.json, an index) atomically."""
    with atomic_file(path) as f:
        f.write(text.encode())


def copy_file(src, dst) -> None:
    """Copy a file (e.g. tokenizer.json) atomically."""
    with open(src, "rb") as s, atomic_file(dst) as d:
        while chunk := s.read(16 << 20):
            d.write(chunk)


# --------------------------------------------------------------------------------- folders
def _is_inside(a: pathlib.Path, b: pathlib.Path) -> bool:
    """a == b or a lies under b (both resolved)."""
    return a == b or b in a.parents


def check_destination(dest, *, overwrite: bool, sources=()) -> None:
    """Raise unless `dest` may be (re)written: it must not hold or lie inside a source, and a
    non-empty dest is replaced only with overwrite=True and only when it looks like a checkpoint."""
    dest = pathlib.Path(dest)
    d = dest.resolve()
    for src in sources:
        s = pathlib.Path(src).resolve()
        if _is_inside(d, s) or _is_inside(s, d):
            rel = "is the source" if d == s else ("lies inside the source" if _is_inside(d, s) else "contains the source")
            raise ValueError(f"destination {dest} {rel} {src}; write to a folder outside it (and not holding it)")
    if dest.exists() and not dest.is_dir():
        raise FileExistsError(f"destination {dest} is a file, not a folder; choose a folder")
    if not dest.is_dir() or not any(dest.iterdir()):
        return
    if not overwrite:
        raise FileExistsError(f"{dest} exists and is not empty; pass --force (overwrite=True) to replace it, "
                              "or choose another folder")
    foreign = sorted(p.name for p in dest.iterdir() if not _CHECKPOINT_NAMES.match(p.name))
    if foreign:
        raise FileExistsError(f"{dest} holds files that are not part of a checkpoint ({foreign[:5]}"
                              f"{' ...' if len(foreign) > 5 else ''}); --force replaces only checkpoint folders, so "
                              "nothing that the writer did not write is deleted; move them away or choose another folder")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale(dest: pathlib.Path) -> None:
    """Temporary siblings of dest left by writers that were killed (their process is gone)."""
    pattern = re.compile(rf"^\.{re.escape(dest.name)}\.(tmp|old)-(\d+)-[0-9a-f]+$")
    if not dest.parent.is_dir():
        return
    for p in dest.parent.iterdir():
        m = pattern.match(p.name)
        if m and int(m.group(2)) != os.getpid() and not pid_alive(int(m.group(2))):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def _exchange(a: pathlib.Path, b: pathlib.Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


@contextlib.contextmanager
def atomic_folder(dest, *, overwrite: bool = False, sources=()) -> Iterator[pathlib.Path]:
    """`with atomic_folder(d) as tmp: write into tmp`: on success tmp replaces d as a whole;
    on any error (or a kill) d is left as it was."""
    dest = pathlib.Path(dest).absolute()
    check_destination(dest, overwrite=overwrite, sources=sources)
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(dest)
    tmp = _tmp_name(dest, "tmp")
    tmp.mkdir()
    try:
        yield tmp
        _fsync_dir(tmp)
        if not dest.exists():
            os.rename(tmp, dest)
        elif not any(dest.iterdir()):
            dest.rmdir()
            os.rename(tmp, dest)
        elif _exchange(tmp, dest):
            shutil.rmtree(tmp)  # now the old contents
        else:
            old = _tmp_name(dest, "old")
            os.rename(dest, old)
            os.rename(tmp, dest)
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(dest.parent)
