"""The cache as the layer body sees it: the `Store` protocol and serving's `QuantStore`.

The body (`model/block.py`) asks a store a fixed set of questions and reads nothing else: where
this chunk's window rows are, which compressed groups a query sees, where a KV source's writes go,
which index keys a source scores, which compressed rows the attention reads. Serving answers them
from the packed cache (`QuantStore`); training answers them from one whole packed row, fake-quantized
in place (`train.forward.FakeQuantStore`). A new cache layout is a new store, never an `if` in the body.
"""
from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp

from dsv41_jax.layers import compressor
from dsv41_jax.layers.indexer import index_key_container
from dsv41_jax.model.cache import (RingStack, index_keys_for, ring_at, scatter_container, window_indices, with_ring,
                                   write_ring)
from dsv41_jax.model.plan import Plan, Span
from dsv41_jax.numerics import kv_layout


class Store(Protocol):
    """What a store answers the body (both `QuantStore` and `train.forward.FakeQuantStore` do).

    A store is used functionally: `block_step` takes a `copy()` and writes into it, so the caller's
    store is never changed. Source layers are named by their index `src`; `role` is a `LayerRole`.
    """

    cfg: object  # the ModelConfig

    def copy(self) -> "Store":
        """An independent store with the same contents (the body writes into the copy)."""

    def window(self, l: int, raw: jax.Array, span: Span) -> tuple:
        """This chunk's window K=V rows raw [B, T, D] written: (the key rows [B, N, D] the XLA
        attention reads, their indices [B, T, W] (-1 empty), (the rows the attention kernel reads,
        its indices into them) or None)."""

    def visible(self, span: Span, m: int) -> jax.Array:
        """[B, T]: how many compressed groups of ratio m each query may see."""

    def compressor_state(self, src: int):
        """The source's compressor state the chunk continues from (None for ratio 1)."""

    def groups(self, src: int, m: int, lat, gids, span: Span) -> tuple:
        """The compressor's groups as this store keeps them: (latents, RoPE positions, write group ids)."""

    def key_source(self, lat):
        """The latent the index keys are computed from."""

    def write_source(self, src: int, state, gids, entries, index_keys, rows=None) -> None:
        """A KV source's writes: compressor state, compressed entries and index keys at group ids."""

    def index_inputs(self, x, qr) -> tuple:
        """The indexer's query-side inputs (x, qr)."""

    def index_key_container(self, role, plan: Plan) -> kv_layout.IndexKeys | None:
        """The quantized index keys the indexer kernel reads for an index source (None: XLA scoring)."""

    def index_keys(self, role, plan: Plan) -> jax.Array:
        """The bf16 index keys [B, G, Di] an index source scores."""

    def stored_index_keys(self, src: int) -> kv_layout.IndexKeys:
        """The source's index keys as packed FP4 (pool scoring and packed scoring read these)."""

    def mask_scores(self, src: int, scores) -> jax.Array:
        """Index scores [B, T, G] with the groups this store hides at -inf."""

    def pool_visible(self, src: int, visible) -> jax.Array:
        """The visible length the candidate pool pins its newest block by."""

    def restrict(self, src: int, sel) -> jax.Array:
        """A top-k selection with the groups this store hides removed (-1)."""

    def compressed(self, src: int):
        """What the attention kernel reads of the source's compressed entries."""

    def compressed_rows(self, src: int) -> jax.Array:
        """The source's compressed rows [B, G, D] at their stored values."""

    def topk_width(self, src: int) -> int:
        """How many compressed positions a top-k over the source selects."""

    # A run of layers that write nothing global (`block.layer_runs`) runs as one scan: the layers' own
    # parts of the store (what `window` reads and writes), stacked on a leading layer axis, are the
    # scan's carry, each layer reading and writing its own slice of them in place.
    def stacked(self, layers) -> object:
        """The layers' own parts (a pytree, leaves on a leading layer axis; () if none are kept)."""

    def at_layer(self, l: int, parts, i) -> "Store":
        """A copy whose layer l's own part is slice i (traced) of `parts` (as `stacked` gave them)."""

    def written(self, l: int) -> tuple:
        """(the parts as the body left them (the scan's carry), what layer l wrote that the store
        keeps per layer (the scan's per-layer output))."""

    def unstacked(self, layers, parts, outputs) -> "Store":
        """A copy with the `written` parts of `layers` and their per-layer outputs (stacked) in place."""


class QuantStore:
    """The serving cache (docs/REFERENCE.md §5) as the body sees it: packed FP8/FP4 rows.

    pending: None, or (a "pending" plan's store, `QuantStore.pending_for`) the chunk's writes as
    they are made: {"start": [B], "window": {layer: new rows [B,T]}, "sources": {layer: {"gids",
    "entries", "index_keys", "rows", "state"}}}, which `commit` applies to the cache the chunk
    started from, for an accepted prefix of each row.
    """

    def __init__(self, cfg, cache: dict, pending: dict | None = None):
        self.cfg = cfg
        self.cache = {"length": cache["length"], "window": list(cache["window"]),
                      "compressed": dict(cache["compressed"]), "index_keys": dict(cache["index_keys"]),
                      "compressor": dict(cache["compressor"]), "published": cache["published"]}
        self.pending = None if pending is None else {"start": pending["start"], "window": dict(pending["window"]),
                                                     "sources": dict(pending["sources"])}

    @classmethod
    def pending_for(cls, cfg, cache: dict, start: jax.Array) -> "QuantStore":
        """A store that records the writes of a chunk starting at `start` (Plan.writes == "pending")."""
        return cls(cfg, cache, {"start": start, "window": {}, "sources": {}})

    def copy(self) -> "QuantStore":
        return QuantStore(self.cfg, self.cache, self.pending)

    def window(self, l: int, raw: jax.Array, span: Span):
        """This chunk's window rows [B, T, D] in (stored FP8): (rows [B, W+T, D] dequantized, idx [B, T, W],
        (the packed rows for the kernel, its indices)). The ring keeps the chunk's last W rows.

        The kernel reads [ring ++ chunk] at idx, except for one token (decode): then it reads the ring
        as written, at the same rows: the new row sits in slot start % W, whose old row (position
        start - W) no query of the chunk sees, so no ring is copied per step (a layer of stacked
        rings, `LayerRing`, is read where it lies)."""
        W, T = self.cfg.window_size, span.positions.shape[1]
        held = ring_at(self.cache["window"], l)
        ring = kv_layout.ring_rows(held)
        new = kv_layout.quantize_window(raw)
        rows = jnp.concatenate([kv_layout.dequantize_window(ring), kv_layout.dequantize_window(new)], 1)
        idx = window_indices(span.start, T, W)
        if span.floor is not None:
            p = span.positions[..., None] - (W - 1) + jnp.arange(W)
            idx = jnp.where(p >= span.floor[:, None, None], idx, -1)
        written = write_ring(held, new, span.start, W)
        self.cache["window"] = with_ring(self.cache["window"], l, written)
        if self.pending is not None:
            self.pending["window"][l] = new
        if T == 1:
            ring_idx = jnp.where(idx >= W, (span.start[:, None, None] + idx - W) % W, idx)
            return rows, idx, (written, ring_idx)
        return rows, idx, (kv_layout.concat_rows(ring, new), idx)

    def visible(self, span: Span, m: int) -> jax.Array:
        """[B, T] compressed groups complete by each query (docs/REFERENCE.md §3)."""
        return (span.positions + 1) // m

    def groups(self, src: int, m: int, lat, gids, span: Span):
        """(latents, their RoPE positions, write group ids): a group sits at its first token's position."""
        return lat, jnp.maximum(gids, 0) * m, gids

    def key_source(self, lat):
        """The latent the index keys are computed from."""
        return lat

    def index_inputs(self, x, qr):
        """The indexer's query-side inputs (x, qr)."""
        return x, qr

    def index_key_container(self, role, plan: Plan) -> kv_layout.IndexKeys:
        """The quantized index keys the indexer kernel reads for an index source."""
        return index_key_container(self.cfg, self.cache, role, plan.runtime.index_k_quirk)

    def index_keys(self, role, plan: Plan) -> jax.Array:
        """The bf16 index keys [B, G, Di] an index source scores (intended or the reference's quirk)."""
        return index_keys_for(self.cfg, self.cache, role, plan.runtime).astype(jnp.bfloat16)

    def stored_index_keys(self, src: int) -> kv_layout.IndexKeys:
        """The source's own index keys as stored (packed FP4): what pool scoring gathers from."""
        return self.cache["index_keys"][f"layer{src}"]

    def mask_scores(self, src: int, scores):
        return scores

    def pool_visible(self, src: int, visible):
        """The visible length the candidate pool pins its newest block by."""
        return visible

    def restrict(self, src: int, sel):
        """A top-k selection with the groups this store hides removed (none: visibility is a length)."""
        return sel

    def compressed(self, src: int):
        """The source's compressed container (what the attention kernel reads)."""
        return self.cache["compressed"][f"layer{src}"]

    def compressed_rows(self, src: int) -> jax.Array:
        """The source's compressed rows [B, G, D], dequantized."""
        return kv_layout.dequantize_compressed(self.cache["compressed"][f"layer{src}"])

    def compressor_state(self, src: int):
        return self.cache["compressor"].get(f"layer{src}")

    def write_source(self, src: int, state, gids, entries, index_keys, rows=None) -> None:
        """A KV source's global writes: compressor state, FP4 index keys (and who published last),
        FP8 compressed entries, at group ids `gids` (-1 = none). rows: the compressor's per-position
        (kv, score) of the chunk (a pending store keeps them to rebuild the state of a prefix)."""
        key = f"layer{src}"
        old_state = self.cache["compressor"].get(key)
        entries = kv_layout.quantize_compressed(entries)
        k_new = None if index_keys is None else kv_layout.quantize_index_keys(index_keys)
        if self.pending is not None:
            self.pending["sources"][src] = {"gids": gids, "entries": entries, "index_keys": k_new, "rows": rows,
                                            "state": old_state}
        self._apply_writes(src, state, gids, entries, k_new)

    def _apply_writes(self, src: int, state, gids, entries, k_new) -> None:
        key = f"layer{src}"
        if state is not None:
            self.cache["compressor"][key] = state
        if k_new is not None:
            self.cache["index_keys"][key] = scatter_container(self.cache["index_keys"][key], k_new, gids)
            produced = jnp.any(gids >= 0, axis=1)
            self.cache["published"] = jnp.where(produced, src, self.cache["published"])
        self.cache["compressed"][key] = scatter_container(self.cache["compressed"][key], entries, gids)

    def commit(self, pending: dict, n: jax.Array) -> "QuantStore":
        """The store with the first n [B] positions of a pending chunk's writes applied (this store
        must hold the cache the chunk started from): exactly what a chunk of those n tokens writes
        (window slots, the compressor groups complete by start + n, their entries and index keys,
        who published last, the partial group after them), and length = start + n."""
        cfg, out = self.cfg, QuantStore(self.cfg, self.cache)
        start = pending["start"]
        end = start + n
        W = cfg.window_size
        for l, new in pending["window"].items():
            j = jnp.arange(new.values.shape[1])[None]
            keep = (j < n[:, None]) & (j >= n[:, None] - W)  # a chunk of n keeps its last min(n, W) rows
            slots = jnp.where(keep, (start[:, None] + j) % W, -1)
            ring = scatter_container(ring_at(out.cache["window"], l), new, slots)
            out.cache["window"] = with_ring(out.cache["window"], l, ring)
        for src in sorted(pending["sources"]):  # in layer order: the last producer publishes
            p = pending["sources"][src]
            m = cfg.compress_ratios[src]
            gids = jnp.where((p["gids"] >= 0) & ((p["gids"] + 1) * m <= end[:, None]), p["gids"], -1)
            state = None
            if p["state"] is not None:
                state = compressor.partial_state(*p["rows"], start, p["state"], end, m)
                state = jax.tree.map(lambda new, old: jnp.where((n > 0)[:, None, None], new, old), state, p["state"])
            out._apply_writes(src, state, gids, p["entries"], p["index_keys"])
        out.cache["length"] = end
        return out

    def topk_width(self, src: int) -> int:
        """min(index_topk, rows the cache holds): the one width formula (cfg.topk_width at full capacity)."""
        return min(self.cfg.index_topk, int(self.cache["compressed"][f"layer{src}"].packed.shape[1]))

    def stacked(self, layers):
        """The layers' window rings on a leading layer axis: the cache's own stack when it holds these
        layers stacked (`RingStack`: no copy), else stacked here (a copy per call)."""
        layers = tuple(layers)
        w = self.cache["window"][layers[0]]
        if isinstance(w, RingStack) and w.run == layers:
            return w.rings
        rings = (kv_layout.ring_rows(ring_at(self.cache["window"], l)) for l in layers)
        return jax.tree.map(lambda *a: jnp.stack(a), *rings)

    def at_layer(self, l: int, parts, i) -> "QuantStore":
        out = self.copy()
        out.cache["window"][l] = kv_layout.LayerRing(parts, i)
        return out

    def written(self, l: int):
        """(the stacked rings as written, the chunk's new rows of layer l a pending store keeps, or None)."""
        return self.cache["window"][l].rings, None if self.pending is None else self.pending["window"][l]

    def unstacked(self, layers, parts, outputs) -> "QuantStore":
        out = self.copy()
        layers = tuple(layers)
        w = out.cache["window"][layers[0]]
        if isinstance(w, RingStack) and w.run == layers:
            out.cache["window"][layers[0]] = RingStack(parts, layers)
        else:
            for i, l in enumerate(layers):
                ring = jax.tree.map(lambda a, i=i: a[i], parts)
                held = ring_at(out.cache["window"], l)
                if isinstance(held, kv_layout.LayerRing):  # part of a run the cache holds stacked: put back there
                    put = lambda a, r, i=held.layer: jax.lax.dynamic_update_index_in_dim(a, r, i, 0)  # noqa: E731
                    ring = kv_layout.LayerRing(jax.tree.map(put, held.rings, ring), held.layer)
                out.cache["window"] = with_ring(out.cache["window"], l, ring)
        if out.pending is not None:
            for i, l in enumerate(layers):
                out.pending["window"][l] = jax.tree.map(lambda a, i=i: a[i], outputs)
        return out
