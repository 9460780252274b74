"""The serving cache: its layout and the row helpers every driver shares (docs/REFERENCE.md §5).

A cache is a plain pytree: per-layer window rings, per-KV-source compressed entries, index keys
and compressor partial groups, per-sequence lengths and the last index-key publisher.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dsv41_jax.config import ModelConfig
from dsv41_jax.numerics import kv_layout
from dsv41_jax.numerics.kv_layout import LayerRing
from dsv41_jax.runtime import Runtime


def init_cache(cfg: ModelConfig, batch: int | None = None, words: bool = False, runs=()) -> dict:
    """An empty cache with fixed shapes (docs/REFERENCE.md §5): window rings, per-source compressed KV, index
    keys and compressor partial groups, per-sequence lengths. words: the KV rows held as the TPU
    kernels' word view (`kv_layout.words_of`; see `cache_form`); runs: runs of layers whose window
    rings are held stacked (`RingStack`; see `cache_form`)."""
    B = batch or cfg.max_batch_size
    cache = {
        "length": jnp.zeros((B,), jnp.int32),
        "window": [kv_layout.empty_window(B, cfg.window_size, cfg.head_dim) for _ in range(cfg.n_layers)],
        "compressed": {}, "index_keys": {}, "compressor": {},
        # which KV source's index keys were published last (only read in reference-quirk mode)
        "published": jnp.full((B,), -1, jnp.int32),
    }
    for s in cfg.kv_source_layers:
        m = cfg.compress_ratios[s]
        G = cfg.max_seq_len // m
        cache["compressed"][f"layer{s}"] = kv_layout.empty_compressed(B, G, cfg.head_dim)
        if s in cfg.index_source_layers:
            cache["index_keys"][f"layer{s}"] = kv_layout.empty_index_keys(B, G, cfg.index_head_dim)
        if m > 1:
            cache["compressor"][f"layer{s}"] = {"kv": jnp.zeros((B, m, cfg.head_dim), jnp.float32),
                                                "score": jnp.full((B, m, cfg.head_dim), -jnp.inf, jnp.float32)}
    return cache_form(cache, words, runs)


def cache_form(cache: dict, words: bool, runs=()) -> dict:
    """The cache with its KV rows (window rings, compressed KV, index keys) as the TPU kernels' word
    view (words True) or as bytes: the same bytes either way (a row's scale bytes padded to whole
    words, none at the released widths: 16 window, 32 compressed, 4 index-key scale bytes). The attention and indexer kernels read a
    word cache as it is stored; from bytes they relayout the whole cache on every call (8-bit and
    32-bit arrays are tiled differently in a TPU's memory), which is why an engine running those
    kernels keeps words (`Runtime.kv_words`).

    runs: the runs of layers (each longer than one) whose window rings are held stacked
    (`RingStack`), as the engine holds the runs its steps scan (`stack.held_runs`); () keeps one ring
    per layer (what every driver but the engine keeps, and what a cache file holds)."""
    form = kv_layout.words_of if words else kv_layout.bytes_of
    out = dict(cache)
    out["window"] = _stacked_rings([form(w) for w in unstacked_rings(cache["window"])], runs)
    out["compressed"] = {k: form(c) for k, c in cache["compressed"].items()}
    out["index_keys"] = {k: form(c) for k, c in cache["index_keys"].items()}
    return out


# ---------------------------------------------------------------------------- stacked window rings
# A scanned run of layers (`block.scan_run`) reads and writes its layers' rings on a leading layer
# axis. Stacked inside each program, that is a copy of the run's rings per call; the engine instead
# holds each run's rings stacked (made with the cache), and the scan carries the stack, each layer
# writing its rows into it in place and the attention kernel reading its layer of it
# (`kv_layout.LayerRing`).
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RingStack:
    """The window rings of the layers `run` on a leading layer axis (each leaf [L, B, W, ...]): held at
    cache["window"][run[0]], with None at the run's other layers."""

    rings: object  # a window container (`kv_layout.WindowKV` or its word view), stacked
    run: tuple = dataclasses.field(metadata={"static": True})


def _stacked_rings(window: list, runs) -> list:
    out = list(window)
    for run in runs:
        if len(run) > 1:
            out[run[0]] = RingStack(jax.tree.map(lambda *a: jnp.stack(a), *(window[l] for l in run)), tuple(run))
            for l in run[1:]:
                out[l] = None
    return out


def unstacked_rings(window: list) -> list:
    """A cache's window rings with one ring per layer (each `RingStack` split into its layers')."""
    out = list(window)
    for w in window:
        if isinstance(w, RingStack):
            for i, l in enumerate(w.run):
                out[l] = jax.tree.map(lambda a, i=i: a[i], w.rings)
    return out


def ring_at(window: list, l: int):
    """Layer l's ring: its own, or a `LayerRing` of the `RingStack` holding it."""
    w = window[l]
    if w is not None and not isinstance(w, RingStack):
        return w
    held = next(s for s in window if isinstance(s, RingStack) and l in s.run)
    return LayerRing(held.rings, jnp.int32(held.run.index(l)))


def with_ring(window: list, l: int, ring) -> list:
    """`window` with layer l's ring `ring` (as `ring_at` gave it, written)."""
    out = list(window)
    w = window[l]
    if w is not None and not isinstance(w, RingStack):
        out[l] = ring
        return out
    i = next(i for i, s in enumerate(window) if isinstance(s, RingStack) and l in s.run)
    out[i] = RingStack(ring.rings, window[i].run)
    return out


def insert_row(table: dict, row: dict, slot) -> dict:
    """A cache `table` with the one-row cache `row` (of the same form) written at batch row `slot`
    (the batch axis is 1 in a `RingStack`'s leaves, 0 elsewhere)."""
    def put(axis):
        return lambda a, r: jax.lax.dynamic_update_index_in_dim(
            a, jax.lax.index_in_dim(r, 0, axis, keepdims=False).astype(a.dtype), slot, axis)

    def one(a, r):
        if isinstance(a, RingStack):
            return RingStack(jax.tree.map(put(1), a.rings, r.rings), a.run)
        return jax.tree.map(put(0), a, r)

    return jax.tree.map(one, table, row, is_leaf=lambda x: isinstance(x, RingStack))


def scatter_rows(buf: jax.Array, rows: jax.Array, idx: jax.Array) -> jax.Array:
    """buf [B, N, ...] with rows [B, J, ...] written at idx [B, J] (idx < 0 dropped)."""
    N = buf.shape[1]
    idx = jnp.where(idx < 0, N, idx)  # out of range -> dropped
    b = jnp.arange(buf.shape[0])[:, None]
    return buf.at[b, idx].set(rows.astype(buf.dtype), mode="drop")


def scatter_container(c, rows, idx):
    """Container c with the container rows written at idx (rows converted to c's form first). c may
    be a `LayerRing`: the rows go into its layer of the stack, in place."""
    if isinstance(c, LayerRing):
        return LayerRing(type(c.rings)(*(_scatter_layer(a, r, idx, c.layer) for a, r in
                                         zip(c.rings, kv_layout.like(c.rings, rows)))), c.layer)
    return type(c)(*(scatter_rows(a, r, idx) for a, r in zip(c, kv_layout.like(c, rows))))


def _scatter_layer(buf: jax.Array, rows: jax.Array, idx: jax.Array, layer) -> jax.Array:
    """buf [L, B, N, ...] with rows [B, J, ...] written at [layer, b, idx [B, J]] (idx < 0 dropped)."""
    N = buf.shape[2]
    idx = jnp.where(idx < 0, N, idx)
    b = jnp.arange(buf.shape[1])[:, None]
    return buf.at[layer, b, idx].set(rows.astype(buf.dtype), mode="drop")


def window_indices(start, T, W):
    """Per query: W slots of [ring (W) ++ chunk (T)], oldest position first; -1 where none."""
    pos = start[:, None] + jnp.arange(T)[None]  # [B, T]
    p = pos[..., None] - (W - 1) + jnp.arange(W)  # [B, T, W]
    in_chunk = p >= start[:, None, None]
    idx = jnp.where(in_chunk, W + p - start[:, None, None], p % W)
    return jnp.where(p >= 0, idx, -1).astype(jnp.int32)


def oracle_column_order(idx, start, T: int, W: int):
    """Attention indices idx [B, T, W + K] (the window's W columns as `window_indices` lists them,
    right-aligned, then K compressed columns, valid first) in the reference's column order.

    The reference lists a prefill from position 0 as min(T, W) window columns, valid ones first,
    then the compressed columns; every other call (decode) as we do. Exact mode's sparse attention
    runs its online softmax over blocks of 64 columns, so which entries share a block is part of its
    result (within a block the order is not: the block's sums are exact). Rows at start 0 move
    their window entries left and the compressed ones to column min(T, W); other rows are unchanged."""
    K = idx.shape[-1] - W
    ww = min(T, W)
    n_win = jnp.sum(idx[..., :W] >= 0, axis=-1, keepdims=True)
    c = jnp.arange(W + K)
    pad = W + K  # an appended -1 column
    src = jnp.where(c < n_win, W - n_win + c, jnp.where(c < ww, pad, jnp.where(c < ww + K, W + c - ww, pad)))
    padded = jnp.concatenate([idx, jnp.full(idx.shape[:2] + (1,), -1, idx.dtype)], -1)
    return jnp.where((start == 0)[:, None, None], jnp.take_along_axis(padded, src, -1), idx)


def write_ring(ring: kv_layout.WindowKV, new: kv_layout.WindowKV, start, W) -> kv_layout.WindowKV:
    """Write the chunk's last min(T, W) window entries into ring slots pos % W."""
    T = new.values.shape[1]
    keep = min(T, W)
    pos = start[:, None] + jnp.arange(T - keep, T)[None]
    sl = jax.tree.map(lambda a: a[:, T - keep:], new)
    return scatter_container(ring, sl, pos % W)


def index_keys_for(cfg: ModelConfig, cache: dict, role, runtime: Runtime) -> jax.Array:
    """The index keys an index source scores (dequantized [B, G, Di]).

    Intended: its own KV source's keys. Reference quirk (docs/REFERENCE.md §6): whatever KV source published
    last, truncated/padded to this layer's cache length.
    """
    own = kv_layout.dequantize_index_keys(cache["index_keys"][f"layer{role.kv_source}"])
    if not runtime.index_k_quirk:
        return own
    G = own.shape[1]
    out = own
    for s in cfg.index_kv_sources:
        if s == role.kv_source:
            continue
        other = kv_layout.dequantize_index_keys(cache["index_keys"][f"layer{s}"])
        other = other[:, :G] if other.shape[1] >= G else jnp.pad(other, ((0, 0), (0, G - other.shape[1]), (0, 0)))
        out = jnp.where((cache["published"] == s)[:, None, None], other, out)
    return out
