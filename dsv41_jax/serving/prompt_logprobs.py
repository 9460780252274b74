"""The logprobs of a prompt's own tokens (`/v1/completions` with `echo`), as evaluation harnesses
ask for them (lm-eval's loglikelihood tasks: `echo: true`, `logprobs`, `max_tokens` 0 or 1).

Token i's logprob is log_softmax of the logits at position i - 1, evaluated at token i; the first
token has none. Every layer runs over every prompt token (exact prefill, model.forward's math): the
CED split computes no logits before the prompt's last window. The prompt goes through in the
engine's prefill pieces (`steps.pieces`: a few fixed shapes, the last one padded), on a cache of its
own (the batch's slots are untouched), so one program per piece shape serves every length; the
log-softmax, the target gather and the top entries are computed on the device, so only
[n] + [n, TOP] numbers per piece come back. Raw logits: unlike sampled tokens, no id is banned
(a prompt may hold the sentinels a reply never may).
"""
from __future__ import annotations

import functools
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.runtime import COMPILER_OPTIONS
from dsv41_jax.serving.prefill import piece_inputs
from dsv41_jax.serving.split_prefill import exact_prefill

TOP = 20  # the most top_logprobs a request may ask for (OpenAI's bound)
# engine -> its jitted scoring step, built on the engine's first echo request (and gone with the engine)
_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _program(engine):
    fn = _PROGRAMS.get(engine)
    if fn is None:
        gd, rt = engine.graphdef, engine.runtime
        # on a mesh: the cache keeps the preset's layout, and the logits are gathered whole before
        # the log-softmax (its sum over a row split on `tensor` would add the shards in another
        # order than one device does), as the engine's own steps return them; the scores come back
        # replicated, so every process (serving across processes) can read them
        fix = engine.placement.constrain
        trace = engine.placement.trace  # on a mesh its kernels run per device, as in the engine's steps

        @functools.partial(jax.jit, donate_argnums=(2,), compiler_options=COMPILER_OPTIONS)
        def fn(params, tokens, cache, ids, targets, valid):
            with trace():
                logits, cache, _ = exact_prefill(nnx.merge(gd, params), tokens, cache, runtime=rt, engram_ids=ids,
                                                 valid=valid)
            lp = jax.nn.log_softmax(fix(logits[0]).astype(jnp.float32), -1)  # [n, V]
            target = jnp.take_along_axis(lp, jnp.maximum(targets, 0)[:, None], -1)[:, 0]
            top_lp, top_ids = jax.lax.top_k(lp, min(TOP, lp.shape[-1]))
            return fix((target, top_lp, top_ids)) + (fix(cache),)

        _PROGRAMS[engine] = fn
    return fn


def prompt_logprobs(engine, prompt: list[int]) -> tuple[list[float | None], list[list[tuple[int, float]]]]:
    """(logprob of each prompt token given the tokens before it, None for the first;
    the TOP most likely (id, logprob) at each position, [] for the first) on a `serving.engine.Engine`
    (`Engine.prompt_logprobs` calls this). Call from the engine's thread."""
    if not prompt:
        raise ValueError("empty prompt: nothing to score")
    step = _program(engine)
    cache = engine.empty(1)
    lps: list[float | None] = [None]
    tops: list[list[tuple[int, float]]] = [[]]
    for done, size, chunk, params, ids, valid in piece_inputs(engine, [], prompt):
        # the prompt's last position predicts no prompt token, nor do the padding's
        targets = prompt[done + 1:done + int(valid[0]) + 1]
        targets = targets + [-1] * (size - len(targets))
        target, top_lp, top_ids, cache = step(params, chunk, cache, ids, jnp.asarray(targets, jnp.int32), valid)
        target, top_lp, top_ids = np.asarray(target), np.asarray(top_lp), np.asarray(top_ids)
        for j, t in enumerate(targets):
            if t >= 0:
                lps.append(float(target[j]))
                tops.append([(int(i), float(v)) for i, v in zip(top_ids[j], top_lp[j])])
    return lps, tops
