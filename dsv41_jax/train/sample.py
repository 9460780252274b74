"""A small sampler over the served model, used by the demo to show that an exported checkpoint
generates. The prompt is fed one token at a time too, so the whole run compiles one step
(a separate prefill shape would double the compile time, which dominates on CPU)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.model.transformer import check_inputs, init_cache, make_step


def generate(model, prompt_ids: list[int], max_new: int, *, temperature: float = 0.0, seed: int = 0,
             engram=None, stop_ids=()) -> list[int]:
    """Continue one prompt; greedy at temperature 0. engram: (layout, token map) or None."""
    cfg = model.cfg
    check_inputs(cfg, np.asarray([prompt_ids]), np.zeros(1, np.int32))
    max_new = min(max_new, cfg.max_seq_len - len(prompt_ids))
    graphdef, params = nnx.split(model)
    step = make_step(graphdef)
    cache = init_cache(cfg, 1)
    rng = np.random.default_rng(seed)
    history = None
    out: list[int] = []
    feed = list(prompt_ids)
    while len(out) < max_new:
        chunk = np.asarray([[feed.pop(0)]], np.int64)
        ids = None
        if engram is not None:
            from dsv41_jax.engram.hashing import hash_ids, next_history

            layout, token_map = engram
            ids = jnp.asarray(hash_ids(layout, token_map, chunk, history).astype(np.int32))
            history = next_history(layout, chunk, history)
        logits, cache, _ = step(params, jnp.asarray(chunk, jnp.int32), cache, ids)
        if feed:
            continue
        last = np.asarray(jax.device_get(logits[0, -1]), np.float64)
        if temperature > 0:
            p = np.exp((last - last.max()) / temperature)
            nxt = int(rng.choice(len(p), p=p / p.sum()))
        else:
            nxt = int(np.argmax(last))
        out.append(nxt)
        if nxt in stop_ids:
            break
        feed.append(nxt)
    return out
