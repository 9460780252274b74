"""The engine's prefill driver: one request alone on a one-row cache, through the compiled steps.

A prompt no longer than the tail (or any prompt with `exact_prefill`) runs the exact prefill in
pieces of a few fixed shapes (`steps.pieces`, the last one padded in fast numerics); a longer one runs Graph A (`encode`) over
its pieces and Graph B (`finish`) once over the tail (docs/ARCHITECTURE.md "Split prefill"). A
stored conversation first replays its last window (`resume`). The engine (`engine.py`) schedules;
this module only calls its steps, on the engine's placement and Engram tables.
"""
from __future__ import annotations

import jax.numpy as jnp

from dsv41_jax.model import dspark
from dsv41_jax.serving import prefix_cache
from dsv41_jax.serving.request import Request
from dsv41_jax.serving.steps import pieces, span_rows


def prefill_request(engine, req: Request) -> tuple:
    """(last-position logits [1,V], one-row cache, all tokens, cached, rings or None): the request's
    prefill on `engine`. rings: its DSpark rings when it may speculate on a speculating engine (new
    ones, or those stored with its conversation), else None. The steps take rings on every
    speculating engine (one program per step): a request without its own runs with fresh ones,
    then dropped."""
    rings = None
    if engine.K and req.speculate:
        rings = (dspark.init_state(engine.cfg, 1) if req.resume_from is None else
                 prefix_cache.load_rings(req.resume_from, engine.cfg, fingerprint=engine.fingerprint))
        rings = None if rings is None else engine.placed(rings)
    own = rings is not None
    rings = rings if own else row_state(engine)
    tokens: list[int] = []
    logits = None
    if req.resume_from is not None:
        logits, cache, tokens = resume(engine, req)
    else:
        cache = engine.empty(1)
    new = [int(t) for t in req.prompt]
    if new:
        run = prefill_exact if engine.exact or len(new) <= engine.tail else prefill_split
        logits, cache, rings = run(engine, tokens, new, req.spans, cache, rings)
    return logits, cache, tokens + new, len(tokens), rings if own else None


def resume(engine, req: Request):
    """(logits, one-row cache, stored tokens) of a stored conversation, its last window replayed
    (padded to the window in fast numerics: one replay shape)."""
    cache, stored = prefix_cache.load_prefix(req.resume_from, engine.cfg, capacity=engine.capacity,
                                             fingerprint=engine.fingerprint)
    cache = engine.placed(engine.cache_form(cache))  # a file holds bytes, one ring per layer
    tokens = [int(t) for t in stored]
    n = min(engine.cfg.window_size, len(tokens))
    W = engine.cfg.window_size if engine.padded else n
    window = tokens[-n:] + [0] * (W - n)
    params, ids = engine.step_inputs(engine.engram_ids(tokens[:-n], window))
    logits, cache = engine.steps.replay(params, jnp.asarray([window], jnp.int32), cache, ids,
                                        span_rows(req.history_spans, len(tokens) - n, len(tokens), W),
                                        jnp.asarray([n], jnp.int32))
    return logits, cache, tokens


def piece_inputs(engine, history: list[int], new: list[int]):
    """Each piece of `new` (after `history`) as a step takes it: (first token's index in new, its
    shape, token ids [1, shape] padded with 0, params, Engram ids, valid [1])."""
    done = 0
    for size in pieces(len(new), engine.prefill_chunk, engine.padded):
        chunk = new[done:done + size]
        padded = chunk + [0] * (size - len(chunk))
        params, ids = engine.step_inputs(engine.engram_ids(history + new[:done], padded))
        yield done, size, jnp.asarray([padded], jnp.int32), params, ids, jnp.asarray([len(chunk)], jnp.int32)
        done += size


def prefill_exact(engine, tokens: list[int], new: list[int], spans, cache: dict, rings):
    """Every layer over the new tokens `new` after `tokens`, piece by piece: (logits, cache, rings)."""
    logits = None
    for done, size, chunk, params, ids, valid in piece_inputs(engine, tokens, new):
        logits, cache, rings = engine.steps.prefill(params, chunk, cache, rings, ids,
                                                    span_rows(spans, done, done + size, size), valid)
    return logits, cache, rings


def prefill_split(engine, tokens: list[int], new: list[int], spans, cache: dict, rings):
    """Graph A over the new tokens piece by piece, then Graph B over the tail: (logits, cache, rings)."""
    buffers = prefill_buffers(engine)
    for done, size, chunk, params, ids, valid in piece_inputs(engine, tokens, new):
        cache, buffers = engine.steps.encode(params, chunk, cache, buffers, ids,
                                             span_rows(spans, done, done + size, size), valid)
    floor = jnp.full((1,), len(tokens) + len(new) - engine.tail, jnp.int32)
    tail_spans = span_rows(spans, len(new) - engine.tail, len(new))
    params, ids = engine.step_inputs(engine.engram_ids(tokens + new[:-engine.tail], new[-engine.tail:]))
    vl = None if tail_spans is None else tail_spans[1] >= 0
    return engine.steps.finish(params, buffers, cache, rings, floor, ids, vl)


def prefill_buffers(engine) -> dict:
    """Graph A's buffers, empty and placed: the newest `tail` positions' hidden state and
    pre-mix, and with a drafter the taps of its target layers before the first decoder layer."""
    cfg, tail = engine.cfg, engine.tail
    buffers = {"h": jnp.zeros((1, tail, cfg.hc_mult, cfg.dim), jnp.bfloat16),
               "pre": jnp.zeros((1, tail, cfg.hc_mult), jnp.float32)}
    if engine.K:
        width = cfg.dim * sum(l < cfg.decoder_start for l in cfg.dspark_target_layer_ids)
        buffers["taps"] = jnp.zeros((1, tail, width), jnp.bfloat16)
    return engine.placed(buffers)


def row_state(engine):
    """A one-row drafter state for a prefill, placed (None without a drafter)."""
    return engine.placed(dspark.init_state(engine.cfg, 1)) if engine.K else None
