"""Warm start: compile every program a server will run before it says it is ready.

A request that reaches a cold server pays for compiling the prefill pieces its prompt length
needs, the CED split's Graph B, the decode step, the sampler and the slot insert: on the demo
checkpoint that was 70-83 s for a first chat request and as much again for each new prompt
shape. `warm` compiles each of those programs for dummy inputs (the prefill, Graph B and
replay pieces without running them: `_compile`; the rest by running them once), at the one cache
capacity the server keeps (the bucket that holds `max_seq_len`; a request without `max_tokens`
reserves that much, so a server reaches that bucket at its first request anyway), so that after
it no request compiles, whatever its length:

- prefill pieces: `steps.pieces` cuts a prompt into a few fixed shapes (`steps.piece_set`, the
  last piece padded); `program_list` finds which of them the reachable prompt lengths need, for
  the exact path (prompts inside the tail, or every prompt with `exact_prefill`) and for Graph A;
- Graph B (one shape), the replay of a stored conversation's last window (when conversation
  caches are on; one shape: a shorter conversation's window is padded);
- `echo` prompt scoring (`prompt_logprobs`, when asked: the server), in the same piece shapes;
- image spans (a model with a vision tower): the prefill and replay programs again with span
  operands (a piece with image positions passes them; the vision tower itself is one program per
  image grid, compiled on an image's first use);
- one request through the engine's own admit/decode path: the batch-1 and batch-`slots` sampler,
  the slot insert, the decode step, the logprob path;
- on a speculating engine (`Engine(speculative=K)`): the prefill programs above are the ones that
  carry the drafter's rings (speculation is data in `serving.steps`: no second set), plus a greedy
  and a T = 1 request long enough to speculate (draft, sampled draft, verify, per-position
  targets, rejection sampling, commit); the engine's `spec_stats` are zeroed afterwards.

With a persistent compilation cache (`compile_cache`) a second start loads the programs instead
of compiling them.
"""
from __future__ import annotations

import collections
import os
import pathlib
import tempfile
import threading
import time
from collections.abc import Callable

import filelock
import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.serving import prefix_cache
from dsv41_jax.serving.engine import Engine, Request
from dsv41_jax.serving.prefill import prefill_buffers, row_state
from dsv41_jax.serving.prompt_logprobs import prompt_logprobs
from dsv41_jax.serving.sampling import SamplingParams
from dsv41_jax.serving.steps import piece_set, pieces, span_operands


def piece_sizes(lo: int, hi: int, chunk: int, padded: bool = True) -> list[int]:
    """Every piece shape `pieces(n, chunk, padded)` uses for some prompt length n in [lo, hi] (empty
    if lo > hi)."""
    if lo > hi:
        return []
    sizes = {chunk} if hi >= chunk else set()
    # the shapes below chunk depend on n % chunk only; every remainder occurs over chunk lengths
    rems = range(chunk) if hi - lo + 1 >= chunk else {n % chunk for n in range(lo, hi + 1)}
    for r in rems:
        sizes.update(pieces(r, chunk, padded))
        if len(sizes) == len(piece_set(chunk, padded)):
            break
    return sorted(sizes)


def program_list(engine: Engine, *, replay: bool = False, echo: bool = False) -> list[tuple[str, int]]:
    """(kind, tokens) of every program `warm` compiles: ("exact", n) and ("graph_a", n) prefill
    pieces, ("graph_b", tail), ("replay", window) when asked, ("echo", n) scoring pieces when asked,
    the same prefill and replay kinds with "+spans" on a model with a vision tower, and
    ("decode", slots) for the rest."""
    longest = engine.max_seq_len - 1  # a prompt leaves room for at least one generated token
    sizes = lambda lo, hi: piece_sizes(lo, hi, engine.prefill_chunk, engine.padded)  # noqa: E731
    if engine.exact:
        exact_hi, split = longest, []
    else:
        exact_hi = min(engine.tail, longest)
        split = sizes(engine.tail + 1, longest)
    prefill = [("exact", n) for n in sizes(1, exact_hi)]
    prefill += [("graph_a", n) for n in split]
    if split:
        prefill.append(("graph_b", engine.tail))
    if replay:
        prefill.append(("replay", engine.cfg.window_size))
    out = list(prefill)
    if getattr(engine.cfg, "vision_enabled", False):
        out += [(f"{kind}+spans", n) for kind, n in prefill]
    if echo:
        out += [("echo", n) for n in sizes(1, longest)]
    if engine.K:
        out.append(("speculate", engine.slots))
    out.append(("decode", engine.slots))
    return out


def _spans(engine: Engine, n: int, on: bool):
    """Span operands of n positions, all outside a span, made as a request's piece makes them
    (`steps.span_operands`), or None."""
    if not on:
        return None
    return span_operands(np.zeros((1, n, engine.cfg.dim), np.float32), np.full((1, n), -1))


def _conversation(engine: Engine, n: int):
    """What a server with conversation caches runs on a stored conversation of n tokens: the engine's
    save of a finished request, a resume (the file read into a cache, the replay), and the
    conversation store's save of a one-row cache (`http.conversations`)."""
    with tempfile.TemporaryDirectory(prefix="dsv41-warmup-") as folder:
        first, second = (str(pathlib.Path(folder) / name) for name in ("first.dsv41", "second.dsv41"))
        engine.run([Request([0] * n, SamplingParams(max_tokens=1), request_id="dsv41-warmup-save", save_to=first)])
        _, row, tokens, _ = engine.prefill(Request([0], resume_from=first))
        prefix_cache.save_prefix(second, engine.cfg, row, tokens, fingerprint=engine.fingerprint)


def _run(engine: Engine, kind: str, n: int):
    # the arguments exactly as Engine.prefill passes them: same shapes and dtypes, placed buffers
    # (Engine.placed), uncommitted token/id/floor arrays, and None where it passes None
    tokens = jnp.asarray([[0] * n], jnp.int32)
    params, ids = engine.step_inputs(engine.engram_ids([], [0] * n))  # host Engram: compact tables
    steps, valid = engine.steps, jnp.asarray([n], jnp.int32)
    kind, spans = kind.removesuffix("+spans"), _spans(engine, n, kind.endswith("+spans"))
    if kind == "exact":
        _compile(steps.prefill, params, tokens, engine.empty(1), row_state(engine), ids, spans, valid)
    elif kind == "graph_a":
        _compile(steps.encode, params, tokens, engine.empty(1), prefill_buffers(engine), ids, spans, valid)
    elif kind == "graph_b":
        _compile(steps.finish, params, prefill_buffers(engine), engine.empty(1), row_state(engine),
                 jnp.full((1,), 0, jnp.int32), ids, None if spans is None else spans[1] >= 0)
    elif kind == "replay" and spans is not None:
        _compile(steps.replay, params, tokens, engine.empty(1), ids, spans, valid)
    elif kind == "replay":  # a conversation's round trip: stored by the engine, resumed, stored again
        _conversation(engine, n)
    elif kind == "echo":
        jax.block_until_ready(prompt_logprobs(engine, [0] * n))
    elif kind == "speculate":  # K + 3 tokens: speculating steps, then the plain step near max_tokens;
        # greedy (greedy drafts), then at T = 1 (sampled drafts and rejection sampling)
        for t in (0.0, 1.0):
            engine.run([Request([0], SamplingParams(max_tokens=engine.K + 3, temperature=t),
                                request_id=f"dsv41-warmup-spec-{t:g}", want_logprobs=True,
                                on_token=lambda token, logprobs: None)])
    else:  # one request through admit, the samplers, insert, decode and logprobs
        req = Request([0], SamplingParams(max_tokens=2), request_id="dsv41-warmup", want_logprobs=True,
                      on_token=lambda token, logprobs: None)
        engine.run([req])


def _compile(step, *args) -> None:
    """Compile `step` for these arguments (or load it from the persistent cache) without running it:
    a later call with arguments of the same shapes, dtypes and placement finds the executable in
    the jit's own cache. Running a prefill piece at the server's full cache capacity only to throw
    its result away adds its run time to every start (a cached one most: it compiles nothing), and
    running it compiles nothing more (the warm-up's request through the engine runs what a request
    does with a piece's outputs)."""
    step.lower(*args).compile()


def warm(engine: Engine, *, replay: bool = False, echo: bool = False,
         progress: Callable[[int, int, str, float], None] | None = None) -> dict:
    """Compile (or load from the persistent cache) every program of `program_list`, growing the
    engine's caches to the bucket that holds `max_seq_len` first. The engine must be idle; it is
    idle and empty afterwards. `progress(done, total, name, seconds)` after each program.
    Returns {"programs": total, "seconds": wall time, "capacity": positions per slot}."""
    if not engine.idle():
        raise RuntimeError("warm() needs an idle engine (call it before serving requests)")
    t0 = time.perf_counter()
    engine.grow(engine.max_seq_len)
    todo = program_list(engine, replay=replay, echo=echo)
    if progress is not None:
        progress(0, len(todo), "start", 0.0)
    for i, (kind, n) in enumerate(todo, 1):
        t = time.perf_counter()
        _run(engine, kind, n)
        if progress is not None:
            progress(i, len(todo), f"{kind} {n}", time.perf_counter() - t)
    engine.reset()
    if engine.K:
        engine.spec_stats.update(dict.fromkeys(engine.spec_stats, 0))
    return {"programs": len(todo), "seconds": time.perf_counter() - t0, "capacity": engine.capacity}


def default_cache_dir() -> pathlib.Path:
    """$DSV41_COMPILE_CACHE, else JAX's own $JAX_COMPILATION_CACHE_DIR, else
    $XDG_CACHE_HOME/dsv41-jax/xla, else ~/.cache/dsv41-jax/xla."""
    for var in ("DSV41_COMPILE_CACHE", "JAX_COMPILATION_CACHE_DIR"):
        if os.environ.get(var):
            return pathlib.Path(os.environ[var])
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "dsv41-jax" / "xla"


# Not a budget: any bound turns on JAX's file lock around every entry it writes (its LRU
# eviction's), which `quiesce_cache` takes before a stopping process exits mid-compile.
CACHE_BOUND_BYTES = 1 << 40
_LOCK_NAME = ".lockfile"  # the lock file JAX's LRU cache keeps in the cache folder


def compile_cache(folder) -> pathlib.Path | None:
    """Turn on JAX's persistent compilation cache in `folder` ("off" or None: leave it off).
    Every program is kept, however fast it compiled (JAX skips those under 1 s by default, and a
    server's small programs add up). Entries are keyed by the lowered program, the jax/jaxlib
    versions, the device kind and the compile options (jax/_src/cache_key.py), so a stale entry is
    never used for a changed model or another machine's device. JAX writes an entry in place (not
    through a rename), so every write happens under its file lock (`CACHE_BOUND_BYTES`): a process
    that stops while compiling waits for that lock (`quiesce_cache`) and leaves no half entry."""
    if folder is None or str(folder) == "off":
        return None
    path = pathlib.Path(folder).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_compilation_cache_max_size", CACHE_BOUND_BYTES)
    return path


def quiesce_cache(timeout: float = 60.0) -> bool:
    """Wait until no compilation-cache entry is being written, and keep it so (the lock is held
    until the process exits): call it just before `os._exit` in a process that stops while another
    thread compiles. True when the lock was taken (or no cache is on), False after `timeout` s."""
    folder = jax.config.jax_compilation_cache_dir
    if not folder:
        return True
    lock = filelock.FileLock(str(pathlib.Path(folder) / _LOCK_NAME))
    try:
        lock.acquire(timeout=timeout)
    except filelock.Timeout:
        return False
    _held_locks.append(lock)  # never released: the exit releases it
    return True


_held_locks: list = []


# ------------------------------------------------------------------ compile counting
# Programs compiled (XLA) or loaded from the persistent cache, per thread: a server's engine thread
# counts its own after the warm-up (`EngineWorker`, the /metrics counter), so that compiles of
# other threads in the same process (tests, a second server) are not counted against it.
_COMPILE_EVENTS = ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_hits")
_compiles: collections.Counter = collections.Counter()
_listening = threading.Lock()
_listeners_on = False


def _count(event, *_, **__):
    if event in _COMPILE_EVENTS:
        _compiles[threading.get_ident()] += 1


def count_compiles() -> None:
    """Start counting compiles per thread (once per process; JAX's listeners cannot be removed)."""
    global _listeners_on
    with _listening:
        if not _listeners_on:
            jax.monitoring.register_event_duration_secs_listener(_count)
            jax.monitoring.register_event_listener(_count)
            _listeners_on = True


def compiles(thread: int | None = None) -> int:
    """Programs compiled or loaded by `thread` (an ident; default this thread) since `count_compiles`."""
    return _compiles[threading.get_ident() if thread is None else thread]
