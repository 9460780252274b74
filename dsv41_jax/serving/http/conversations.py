"""Conversation caches on disk: a request whose prompt extends one served earlier resumes from it.

The next turn of a conversation repeats the earlier turns, so its prompt starts with tokens
whose global cache was already computed. Each stored file (`prefix_cache.save_prefix`: the
global KV only, about 890 B per token at the released shape) holds one token sequence; a new
prompt resumes from the longest stored sequence it starts with, and the engine prefills only the
new tokens plus the replayed window (docs/SERVING.md "Conversation caches").

- Match: token prefixes, found through hashes of fixed-size token blocks (a chain hash per block
  count), then confirmed token by token.
- Files: named by a hash of their tokens, written atomically by `save_prefix`, under a byte
  budget with least-recently-used eviction.
- A file that fails `load_prefix`'s checks (corrupt, truncated, another model) is deleted and
  the next-best match is tried; the request never fails because of a cache file.
- What is stored: every completion (prompt + generated tokens): in chat mode the next turn
  extends it. In thinking mode the next turn drops this turn's reasoning and re-renders the
  generation header, so it extends only the prompt without its final `<think>`; that prefix is
  stored too (one extra prefill from the best match, after the reply, off the request's path).
- Speculation: a speculating engine stores the sequence's DSpark rings in the file too, so the next
  turn speculates from its first token; a file without them resumes without speculating.
- Images: a request with images matches on its key (`images.pixel_key`: image positions keyed by
  the image's processed pixels), stored in the file (`save_prefix`'s match_key); a resumed request
  gets the spans of its new tokens and of the stored ones (the replayed window reads them).

Every method except `attach` runs in the engine thread (through the job's callbacks).
"""
from __future__ import annotations

import collections
import hashlib
import os
import pathlib
import re
import sys
import traceback

import numpy as np

from dsv41_jax.checkpoint.atomic import pid_alive
from dsv41_jax.serving import prefix_cache
from dsv41_jax.serving.engine import Request

SUFFIX = ".dsv41"
BLOCK = 16
_TMP = re.compile(r"^\..+\.tmp-(\d+)-[0-9a-f]+$")  # checkpoint.atomic's temporary names


def _chain(tokens, block: int = BLOCK) -> list[str]:
    """hash[k] identifies tokens[:k * block] (hash[0] is the empty prefix)."""
    out, h = [""], hashlib.sha256()
    arr = np.asarray(tokens, np.int32)
    for k in range(len(arr) // block):
        h.update(arr[k * block:(k + 1) * block].tobytes())
        out.append(h.copy().hexdigest()[:32])
    return out


class ConversationStore:
    """Stored sequences under `folder`, at most `budget` bytes, LRU-evicted."""

    def __init__(self, folder, budget: int, engine, metrics):
        self.folder = pathlib.Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.budget, self.engine, self.metrics = budget, engine, metrics
        self.files: collections.OrderedDict[pathlib.Path, tuple[np.ndarray, int]] = collections.OrderedDict()
        self.index: dict[tuple[int, str], set[pathlib.Path]] = collections.defaultdict(set)
        self.pinned: collections.Counter = collections.Counter()  # files queued requests resume from
        self.orphans_removed = self._remove_orphans()
        for f in sorted(self.folder.glob("[!.]*" + SUFFIX), key=lambda p: p.stat().st_mtime):
            try:
                self._add(f, prefix_cache.read_tokens(f, "match_key"))
            except (prefix_cache.PrefixCacheError, OSError, ValueError):
                f.unlink(missing_ok=True)  # unreadable leftovers are recomputed when needed
        self._evict()

    def _remove_orphans(self) -> int:
        """Delete what a killed server left behind: `.pending-*` files of requests that never finished
        and the atomic writer's temporary files (`.NAME.tmp-PID-*`) whose process is gone. They are
        outside the byte budget, so without this they would stay forever. Returns how many."""
        removed = 0
        for p in self.folder.iterdir():
            m = _TMP.match(p.name)
            stale = p.name.startswith(".pending-") and m is None or (
                m is not None and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))))
            if stale and p.is_file():
                p.unlink(missing_ok=True)
                removed += 1
        if removed:
            print(f"dsv41 serve: removed {removed} unfinished conversation-cache file(s) left in {self.folder} "
                  "by a server that stopped mid-write", file=sys.stderr)
        self.metrics.cache_orphans.inc(removed)
        return removed

    # ------------------------------------------------------------------ bookkeeping
    def _add(self, path: pathlib.Path, tokens: np.ndarray):
        if path in self.files:
            self._drop(path, unlink=False)
        k = len(tokens) // BLOCK
        self.files[path] = (tokens, path.stat().st_size)
        self.index[(k, _chain(tokens)[k])].add(path)
        self._gauges()

    def _drop(self, path: pathlib.Path, unlink: bool = True):
        tokens, _ = self.files.pop(path)
        k = len(tokens) // BLOCK
        self.index[(k, _chain(tokens)[k])].discard(path)
        if unlink:
            path.unlink(missing_ok=True)
        self._gauges()

    def _gauges(self):
        self.metrics.cache_files.set(len(self.files))
        self.metrics.cache_bytes.set(sum(size for _, size in self.files.values()))

    def _evict(self):
        """Drop least recently used files until the budget holds; files a queued request will
        resume from are kept (the engine reads them at admission)."""
        for path in list(self.files):
            if sum(size for _, size in self.files.values()) <= self.budget:
                return
            if not self.pinned[path]:
                self._drop(path)

    def path_for(self, tokens) -> pathlib.Path:
        return self.folder / (hashlib.sha256(np.asarray(tokens, np.int32).tobytes()).hexdigest()[:32] + SUFFIX)

    def candidates(self, prompt) -> list[tuple[pathlib.Path, int]]:
        """Stored sequences the prompt starts with, longest first."""
        prompt = np.asarray(prompt, np.int32)
        chain = _chain(prompt)
        found = []
        for k in range(len(chain) - 1, -1, -1):
            for path in self.index.get((k, chain[k]), ()):
                tokens, _ = self.files[path]
                if len(tokens) <= len(prompt) and np.array_equal(tokens, prompt[:len(tokens)]):
                    found.append((path, len(tokens)))
        return sorted(found, key=lambda c: -c[1])

    def best(self, prompt) -> tuple[pathlib.Path | None, int]:
        """The longest usable match (verified with `load_prefix`); bad files are deleted."""
        e = self.engine
        for path, n in self.candidates(prompt):
            try:
                prefix_cache.load_prefix(path, e.cfg, capacity=max(e.capacity, n), fingerprint=e.fingerprint)
            except (prefix_cache.PrefixCacheError, OSError, ValueError) as err:
                print(f"dsv41 serve: ignoring conversation cache {path.name}: {err}")
                self._drop(path)
                continue
            self.files.move_to_end(path)
            return path, n
        return None, 0

    def save(self, tokens, cache_row, key=None, rings=None) -> pathlib.Path:
        key = tokens if key is None else key
        path = self.path_for(key)
        prefix_cache.save_prefix(path, self.engine.cfg, cache_row, tokens, fingerprint=self.engine.fingerprint,
                                 match_key=None if list(key) == list(tokens) else key, rings=rings)
        self._add(path, np.asarray(key, np.int32))
        self._evict()
        return path

    # ------------------------------------------------------------------ request hooks
    def attach(self, job, *, thinking: bool, chat: bool, key=None):
        """Called on the event loop: set the job's engine-thread callbacks. key: the prompt's match key
        (an image prompt's `pixel_key`; default its ids); the request's spans cover the whole prompt."""
        job.full_prompt = list(job.request.prompt)
        job.full_key = job.full_prompt if key is None else [int(k) for k in key]
        job.full_spans = job.request.spans
        if len(job.full_key) != len(job.full_prompt):
            raise ValueError(f"the match key has {len(job.full_key)} entries for {len(job.full_prompt)} prompt tokens")
        job.request.match_key = None if key is None else job.full_key
        job.thinking = thinking and chat
        job.on_admit, job.on_finish, job.on_cancel = self._admit, self._finish, self._cancelled
        job.resumed = (None, 0)

    def _cancelled(self, job):
        path, _ = job.resumed
        if path is not None:
            self.pinned[path] -= 1

    def _admit(self, job):
        prompt = job.full_prompt
        path, n = self.best(job.full_key)
        if path is not None and n > 0:
            self.metrics.cache_hits.inc()
            self.metrics.cached_tokens.inc(n)
            job.request.prompt = prompt[n:]
            job.request.resume_from = str(path)
            job.request.spans, job.request.history_spans = _split_spans(job.full_spans, n)
            self.pinned[path] += 1
        else:
            self.metrics.cache_misses.inc()
        job.resumed = (path, n)
        job.request.save_to = str(self.folder / f".pending-{job.request.request_id}{SUFFIX}")

    def _finish(self, job, result):
        path, _ = job.resumed
        if path is not None:
            self.pinned[path] -= 1
        pending = pathlib.Path(job.request.save_to)
        key = job.full_key + result.tokens[:-1]  # generated tokens are text: their ids are their key
        if pending.is_file():
            final = self.path_for(key)
            pending.replace(final)
            self._add(final, np.asarray(key, np.int32))
            self._evict()
        if job.thinking and len(job.full_prompt) > 1:
            self._store_prefix(job.full_prompt[:-1], job.full_key[:-1], _split_spans(job.full_spans, -1)[1])

    def _store_prefix(self, prefix: list[int], key: list[int] | None = None, spans=None):
        """Compute and store the cache of `prefix` (match key `key`, image spans `spans`), resuming from
        the best stored match."""
        key = prefix if key is None else key
        if self.path_for(key) in self.files:
            self.files.move_to_end(self.path_for(key))
            return
        path, n = self.best(key)
        new_spans, old_spans = _split_spans(spans, n)
        try:
            _, row, tokens, _ = self.engine.prefill(Request(
                prefix[n:], resume_from=None if path is None else str(path), spans=new_spans,
                history_spans=old_spans if path is not None else None))
            self.save(tokens, row, key, self.engine.row_rings)  # a speculating engine's drafter rings, or None
        except Exception:  # noqa: BLE001 - a cache that cannot be stored is only a lost speed-up
            traceback.print_exc()


def _split_spans(spans, n: int):
    """(spans of positions n.., spans of positions ..n) of a prompt's image spans, each None without
    an image position."""
    if spans is None:
        return None, None
    rows, types = np.asarray(spans[0]), np.asarray(spans[1])
    part = lambda sl: (rows[sl], types[sl]) if np.any(types[sl] >= 0) else None
    return part(slice(n, None)), part(slice(None, n))
