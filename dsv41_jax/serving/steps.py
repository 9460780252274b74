"""The serving engine's compiled steps: pure functions of (params, cache, inputs) -> (outputs, cache).

`build_steps` jits each step once from what is fixed for an engine (its graphdef, runtime, decode
plan, CED tail, placement and drafter size); the engine's scheduler (`serving.engine`) only calls
them. The steps, in the order a request meets them (JetStream's prefill / insert / generate):

- `prefill`: one exact prefill piece of a one-row cache (every layer over the piece's tokens);
- `encode` + `finish`: the CED split, Graph A over every prompt piece (keeping the newest `tail`
  positions' hidden state in the buffers) and Graph B over the tail;
- `replay`: a stored conversation's last window through the layers that keep no global state;
- `insert`: a one-row cache (or sampling history, or rings) into a slot of the batch's;
- `decode`: one token for every slot;
- `drafting` (an engine with a DSpark drafter only): draft, verify K+1 tokens, the sampler's
  targets, rejection sampling, and the commit of what each slot accepted;
- `image` (a model with a vision tower): the tower and aligner over one image's patches, with the
  learned span delimiters, all returned replicated (the host builds the span rows from them).

Speculation is data, not a second set of programs: on an engine with a drafter the drafter's
rings go through `prefill`, `finish` and `decode` beside the cache (each writes the taps of the
positions it caches into them) and Graph A's buffers carry the tail's taps; without a drafter
`rings` is None (an empty pytree) and the same functions trace without them. So each step is one
program per engine, whichever requests speculate.

On a mesh every returned cache keeps the preset's layout (steps chain without resharding), and the
returned logits are replicated: the sampler's softmax / top-p sums and a log-softmax over a row
split on `tensor` would add the shards in another order than one device does (the last bits
differ), so the gather happens once, inside the step (`Placement.constrain`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.model import dspark
from dsv41_jax.model.cache import insert_row
from dsv41_jax.model.transformer import init_cache, make_step
from dsv41_jax.runtime import COMPILER_OPTIONS
from dsv41_jax.serving import speculation
from dsv41_jax.serving.split_prefill import (commit, decode_step, decoder_pass, drop_window, encoder_pass, exact_prefill,
                                             make_replay, replay_window)
from dsv41_jax.vision.merge import encode_image


PIECE_RATIO = 4  # each piece shape is the next larger one / 4
SMALLEST_PIECE = 64  # the smallest piece shape is chunk / 64 (at least 1 token)


def piece_set(chunk: int, padded: bool = True) -> list[int]:
    """The prefill piece shapes of an engine, largest first. padded (fast numerics): chunk, chunk/4,
    chunk/16, ... down to max(1, chunk/64) (512: 512, 128, 32, 8), the last piece of a prompt padded.
    Unpadded (exact numerics): chunk and every power of two below it, as the binary digits of the
    remainder need them: exact mode mirrors the oracle's torch loops, whose scalar tail (the last
    T mod 8 tokens of a call) is part of its numerics, so a padded call would change the bits of a
    real token (`layers/mhc.py`)."""
    if not padded:
        return [chunk] + [1 << b for b in reversed(range(max(chunk - 1, 0).bit_length())) if 1 << b < chunk]
    sizes = [chunk]
    while sizes[-1] // PIECE_RATIO >= max(1, chunk // SMALLEST_PIECE):
        sizes.append(sizes[-1] // PIECE_RATIO)
    return sizes


def pieces(n: int, chunk: int, padded: bool = True) -> list[int]:
    """Piece shapes covering n tokens (`piece_set`): whole chunks, then each smaller shape as often as
    it fits. padded: the rest goes into one more piece of a shape (padded at its end, `split_prefill`
    "Padded pieces") as soon as that wastes fewer tokens than the next smaller shape holds, else of
    the smallest shape; only the last piece is padded (docs/PERFORMANCE.md "Prefill piece shapes":
    the padding on a prompt-length mix). Unpadded: the remainder's binary digits."""
    out, r = [], n
    sizes = piece_set(chunk, padded)
    for i, size in enumerate(sizes):
        out += [size] * (r // size)
        r %= size
        smaller = sizes[i + 1] if i + 1 < len(sizes) else 0
        if padded and r and (size - r < smaller or not smaller):
            return out + [size]
    return out


def forward_logprob_rows(graphdef, params, cfg, runtime, prompt: list[int], generated: list[int],
                         chunk: int, resumed: tuple[list[int], list[int]] | None = None) -> list[np.ndarray]:
    """What the engine's logprob rows must equal: log_softmax of `model.forward`'s logits (one sequence,
    no engine) for the prompt's last token and each generated token but the last, the prompt fed in the
    exact prefill's unpadded pieces of `chunk` (exact numerics pick their elementwise kernels by a call's
    length), then one token a call.

    resumed: (prompt, generated) of an earlier turn saved as a conversation (`Request.save_to`): fed
    first the same way, then its window rings dropped and its last window replayed (`replay_window`,
    unpadded), as `Request.resume_from` restores it; `prompt` then starts with that turn's last token
    (which never went through the model). Only this turn's rows are returned."""
    step = make_step(graphdef, runtime)
    cache = init_cache(cfg, 1)
    if resumed is not None:
        _, cache = _feed(step, params, cache, *resumed, chunk)
        held = list(resumed[0]) + list(resumed[1][:-1])
        n = min(cfg.window_size, len(held))
        _, cache = make_replay(graphdef, runtime)(params, jnp.asarray([held[-n:]], jnp.int32), drop_window(cache))
    return _feed(step, params, cache, prompt, generated, chunk)[0]


def _feed(step, params, cache, prompt, generated, chunk):
    """(log_softmax rows, cache) of `prompt` in unpadded pieces then `generated[:-1]` one a call."""
    start, rows = 0, []
    for n in pieces(len(prompt), chunk, padded=False):
        logits, cache, _ = step(params, jnp.asarray([prompt[start:start + n]], jnp.int32), cache, None)
        start += n
    rows.append(logits[0, -1])
    for tok in generated[:-1]:
        logits, cache, _ = step(params, jnp.asarray([[tok]], jnp.int32), cache, None)
        rows.append(logits[0, -1])
    return [np.asarray(jax.nn.log_softmax(jax.device_get(r.astype(jnp.float32)))) for r in rows], cache


def span_rows(spans, lo: int, hi: int, size: int | None = None):
    """Rows lo..hi of a prompt's image spans as a batch of one, padded with no-span rows to `size`
    positions (a padded piece), or None (no spans, or none in range)."""
    if spans is None or not np.any(np.asarray(spans[1])[lo:hi] >= 0):
        return None
    rows, types = np.asarray(spans[0])[lo:hi], np.asarray(spans[1])[lo:hi]
    pad = (size or len(types)) - len(types)
    rows = np.concatenate([rows, np.zeros((pad, *rows.shape[1:]), rows.dtype)])
    types = np.concatenate([types, np.full(pad, -1, types.dtype)])
    return span_operands(rows[None], types[None])


def span_operands(rows, types):
    """(rows [B, T, dim] bf16, token types [B, T] int32) on the device as a step takes them, cast on
    the host: `jnp.asarray` would cast on the device, one small program per new piece shape that no
    warm-up runs (an image prompt's first piece of a shape compiled twice after ready)."""
    return jax.device_put(np.asarray(rows, jnp.bfloat16)), jax.device_put(np.asarray(types, np.int32))


@dataclass
class Drafting:
    """The programs only an engine with a drafter has (`serving.speculation`)."""

    draft: Callable  # (params, rings, anchor, newest, banned) -> greedy drafts [B, K]
    draft_sampled: Callable  # (..., sampler operands) -> (drafts, the drafter's probabilities)
    verify: Callable  # (params, tokens [B, K+1], cache, ids) -> (logits, pending writes, taps)
    commit: Callable  # (params, cache, pending, taps, rings, history, chunk, n) -> (cache, rings, history)
    targets: Callable  # the sampler's token at each verified position
    reject: Callable  # rejection sampling: (tokens, accepted drafts)
    position: Callable  # (logits [B, K+1, V], j) -> logits [B, V]: j traced, one program for every j


@dataclass
class Steps:
    """The compiled steps of one engine (see the module doc). `rings` is None without a drafter."""

    # a piece's `valid` [B]: its first `valid` tokens are real, the rest padding (`pieces`)
    prefill: Callable  # (params, tokens, cache, rings, ids, spans, valid) -> (logits [1, V], cache, rings)
    encode: Callable  # (params, tokens, cache, buffers, ids, spans, valid) -> (cache, buffers)
    finish: Callable  # (params, buffers, cache, rings, floor, ids, vl) -> (logits [1, V], cache, rings)
    replay: Callable  # (params, tokens, cache, ids, spans, valid) -> (logits [1, V], cache)
    decode: Callable  # (params, tokens [B, 1], cache, rings, active, ids) -> (logits [B, V], cache, rings)
    insert: Callable  # (table, row, slot) -> table with row written at slot
    # (params, patches, n_vit_h, n_vit_w) -> (aligner rows [cells, dim], {"image_start", "image_end",
    # "image_newline"}): one program per patch grid, compiled on a grid's first image
    image: Callable
    drafting: Drafting | None


def _last(logits, valid):
    """Each row's logits at its last real position: [B, T, V] -> [B, V]."""
    return jnp.take_along_axis(logits, (valid - 1)[:, None, None], 1)[:, 0]


def _write_rings(model, rings, taps, start, n, mode: str):
    """The drafter's rings with the taps of n positions from `start` written in (None stays None)."""
    if rings is None:
        return None
    return dspark.write_rings(model, rings, dspark.main_x(model, taps, mode), start, n, mode)


def build_steps(graphdef, runtime, plan, tail: int, constrain, k: int, trace=contextlib.nullcontext) -> Steps:
    """The engine's steps (module doc): `plan` is the decode plan, `tail` Graph B's length,
    `constrain` the placement's in-step layout, `k` the drafts per step (0: no drafter), `trace` the
    context each step is traced in (the placement's: on a mesh its kernels run per device)."""
    gd, rt, mode = graphdef, runtime, runtime.mode

    def jit(fn, **options):
        @functools.wraps(fn)
        def traced(*args, **kwargs):
            with trace():
                return fn(*args, **kwargs)

        return jax.jit(traced, compiler_options=COMPILER_OPTIONS, **options)

    def keep(buf, new, valid):  # the newest `tail` real positions: the buffer's, then the piece's first `valid`
        return jax.lax.dynamic_slice_in_dim(jnp.concatenate([buf, new], 1), valid[0], tail, 1)

    @functools.partial(jit, donate_argnums=(2, 3))
    def prefill(params, tokens, cache, rings, ids, spans, valid):
        model = nnx.merge(gd, params)
        start = cache["length"]
        logits, cache, aux = exact_prefill(model, tokens, cache, runtime=rt, engram_ids=ids, spans=spans,
                                           taps=rings is not None, valid=valid)
        rings = _write_rings(model, rings, aux.get("main_hidden"), start, valid, mode)
        return constrain(_last(logits, valid)), constrain(cache), rings

    @functools.partial(jit, donate_argnums=(2, 3))
    def encode(params, tokens, cache, buffers, ids, spans, valid):
        """Graph A's piece; with a drafter the buffers also keep the tail's taps of the encoder's
        target layers. One row (the engine prefills alone): `valid` [1]."""
        out = encoder_pass(nnx.merge(gd, params), tokens, cache, runtime=rt, engram_ids=ids, spans=spans,
                           taps="taps" in buffers, valid=valid)
        new = {"h": out[0], "pre": out[1], **({"taps": out[3]} if "taps" in buffers else {})}
        return constrain(out[2]), jax.tree.map(lambda b, n: keep(b, n, valid), buffers, new)

    @functools.partial(jit, donate_argnums=(2, 3))
    def finish(params, buffers, cache, rings, floor, ids, vl):
        """Graph B over the tail; with a drafter its taps and the encoder's of the tail go into the
        rings (the newest W positions: all a ring holds)."""
        model = nnx.merge(gd, params)
        start = cache["length"] - tail
        logits, cache, aux = decoder_pass(model, buffers["h"], buffers["pre"], cache, start=start, floor=floor,
                                          runtime=rt, engram_ids=ids, vl=vl, taps=rings is not None)
        if rings is not None:
            taps = jnp.concatenate([buffers["taps"], aux["main_hidden"]], -1)
            rings = _write_rings(model, rings, taps, start, jnp.full(start.shape, tail, jnp.int32), mode)
        return constrain(logits[:, -1]), constrain(cache), rings

    @functools.partial(jit, donate_argnums=(2,))
    def replay(params, tokens, cache, ids, spans, valid):
        logits, cache = replay_window(nnx.merge(gd, params), tokens, cache, runtime=rt, engram_ids=ids, spans=spans,
                                      valid=valid)
        return constrain(_last(logits, valid)), constrain(cache)

    @functools.partial(jit, donate_argnums=(2, 3))
    def decode(params, tokens, cache, rings, active, ids):
        """One token per slot; with a drafter its taps go into the rings, so a slot's rings hold
        every position it has cached (what a stored conversation keeps for its next turn)."""
        model = nnx.merge(gd, params)
        start = cache["length"]
        logits, cache, aux = decode_step(model, tokens, cache, plan, engram_ids=ids, active=active,
                                         taps=rings is not None)
        rings = _write_rings(model, rings, aux.get("main_hidden"), start, active.astype(jnp.int32), mode)
        return constrain(logits[:, -1]), constrain(cache), rings

    @functools.partial(jax.jit, donate_argnums=(0,))
    def insert(table, row, slot):
        return constrain(insert_row(table, row, slot))

    @functools.partial(jit, static_argnums=(2, 3))
    def image(params, patches, n_vit_h, n_vit_w):
        model = nnx.merge(gd, params)
        delimiters = {name: getattr(model, name)[...] for name in ("image_start", "image_end", "image_newline")}
        return constrain((encode_image(model, patches, n_vit_h, n_vit_w, mode)[1], delimiters))

    drafting = _drafting(gd, mode, plan, k, jit, constrain) if k else None
    return Steps(prefill, encode, finish, replay, decode, insert, image, drafting)


def _drafting(gd, mode: str, plan, k: int, jit, constrain) -> Drafting:
    verify_plan = dataclasses.replace(plan, writes="pending")

    @jit
    def verify(params, tokens, cache, ids):
        logits, _, aux = decode_step(nnx.merge(gd, params), tokens, cache, verify_plan, engram_ids=ids, taps=True)
        return constrain(logits), aux["pending"], aux["main_hidden"]

    @functools.partial(jit, donate_argnums=(4, 5))
    def commit_step(params, cache, pending, taps, rings, history, chunk, n):
        model = nnx.merge(gd, params)
        rings = _write_rings(model, rings, taps, pending["start"], n, mode)
        return constrain(commit(model.cfg, cache, pending, n)), rings, speculation.count(history, chunk, n)

    return Drafting(draft=jit(speculation.draft_fn(gd, mode, k)), draft_sampled=jit(speculation.draft_sampled_fn(gd, mode, k)),
                    verify=verify, commit=commit_step, targets=jit(speculation.targets_fn(k)),
                    reject=jit(speculation.rejection_fn(k)), position=jax.jit(lambda logits, j: logits[:, j]))
