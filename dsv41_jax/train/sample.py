"""A small sampler over the served model (prefill, then one token at a time on the cache),
used by the demo to show that an exported checkpoint generates."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.model import check_inputs, init_cache, make_step


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
    chunk = np.asarray([prompt_ids], np.int64)
    out: list[int] = []
    for _ in range(max_new):
        ids = None
        if engram is not None:
            from dsv41_jax.engram_hash import hash_ids, next_history

            layout, token_map = engram
            ids = jnp.asarray(hash_ids(layout, token_map, chunk, history).astype(np.int32))
            history = next_history(layout, chunk, history)
        logits, cache, _ = step(params, jnp.asarray(chunk, jnp.int32), cache, ids)
        last = np.asarray(jax.device_get(logits[0, -1]), np.float64)
        if temperature > 0:
            p = np.exp((last - last.max()) / temperature)
            nxt = int(rng.choice(len(p), p=p / p.sum()))
        else:
            nxt = int(np.argmax(last))
        out.append(nxt)
        if nxt in stop_ids:
            break
        chunk = np.asarray([[nxt]], np.int64)
    return out
