"""Cache capacity buckets: the global caches are allocated at a power-of-two capacity.

Compiled steps depend on the cache's shapes, so a cache sized to each sequence's exact length
would recompile at every new length. Capacities are powers of two instead (at least
`minimum`, a multiple of every compress ratio); a sequence that outgrows its bucket moves to
the next one, so a context growing to 1M tokens compiles about log2(1M / minimum) step variants.
The per-row layout is the packed byte layout of `kv_layout` (288 B compressed rows, 68 B index
keys, 528 B window rows); a per-sequence page table over fixed-size pages would bound memory
waste further and is left as an open point (docs/SERVING.md).
"""
from __future__ import annotations

import math

import jax.numpy as jnp

from dsv41_jax.config import ModelConfig
from dsv41_jax.model.transformer import init_cache


def capacity_for(cfg: ModelConfig, n_tokens: int, minimum: int = 256, maximum: int | None = None) -> int:
    """The smallest bucket (power of two >= minimum) that holds n_tokens positions."""
    maximum = cfg.max_seq_len if maximum is None else maximum
    if n_tokens > maximum:
        raise ValueError(f"a sequence of {n_tokens} tokens exceeds the engine's max_seq_len={maximum}; "
                         "raise max_seq_len (engine argument or config) or shorten the request")
    step = math.lcm(*(cfg.compress_ratios[s] for s in cfg.kv_source_layers)) if cfg.kv_source_layers else 1
    cap = max(minimum, step, 1)
    cap = 1 << (cap - 1).bit_length()
    while cap < n_tokens:
        cap *= 2
    return cap


def empty_cache(cfg: ModelConfig, batch: int, capacity: int, words: bool = False, runs=()) -> dict:
    """A fresh cache for `batch` sequences at `capacity` positions (the model's init_cache); words: its
    KV rows as the TPU kernels' word view (`Runtime.kv_words`, `model.cache.cache_form`); runs: the
    runs of layers whose window rings it holds stacked (`model.cache.RingStack`)."""
    return init_cache(cfg.replace(max_seq_len=capacity), batch, words, runs)


def capacity_of(cfg: ModelConfig, cache: dict) -> int:
    """Positions the global caches hold (from the first KV source's entries)."""
    if not cfg.kv_source_layers:
        return cfg.max_seq_len
    s = cfg.kv_source_layers[0]
    return int(cache["compressed"][f"layer{s}"].packed.shape[1]) * cfg.compress_ratios[s]


def resize_cache(cfg: ModelConfig, cache: dict, capacity: int) -> dict:
    """The cache at another capacity: entries are kept, new rows are empty, dropped rows must be unused
    (the caller checks that every length fits)."""
    def fit(container, m):
        G = capacity // m

        def one(a):
            if a.shape[1] >= G:
                return a[:, :G]
            pad = [(0, 0)] * a.ndim
            pad[1] = (0, G - a.shape[1])
            return jnp.pad(a, pad)

        return type(container)(*(one(a) for a in container))

    out = dict(cache)
    out["compressed"] = {k: fit(v, cfg.compress_ratios[int(k[5:])]) for k, v in cache["compressed"].items()}
    out["index_keys"] = {k: fit(v, cfg.compress_ratios[int(k[5:])]) for k, v in cache["index_keys"].items()}
    return out
