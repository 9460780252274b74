"""A forward over a range of layers, with the knobs serving needs (docs/REFERENCE.md §5).

The layer body lives in `dsv41_jax.model.block` (issue 20); `run_layers` here keeps its old
signature as a shim over `block.run_layers`:

- a layer range, entered and left through the residual stream (h, pre);
- `floor`: window slots at positions below `floor[b]` are empty. Graph B of the split prefill
  and the replay after a prefix-cache restore see only the tail they run over;
- `write_globals=False`: KV sources read the global caches but do not write them (replay);
- `lean=True`: decode-sized chunks gather the selected compressed rows (and, for in-pool
  Reindex layers, only the pool's index keys) instead of dequantizing whole caches, so the
  step's work does not grow with the context except for the indexer's scoring.
"""
from __future__ import annotations

import jax

from dsv41_jax.model import block as body
from dsv41_jax.model.block import _E2M1_PAIRS, decode_index_keys, embed  # noqa: F401 (the drivers' imports)
from dsv41_jax.runtime import Runtime


def head(model, h: jax.Array, pre: jax.Array, mode: str) -> jax.Array:
    """Collapse with the last pre-mix, final norm, fp32 head: logits [B,T,V]."""
    return body.head(model, h, pre, mode)[0]


def project_ced(model, h: jax.Array, pre: jax.Array, start: jax.Array, cache: dict, runtime: Runtime,
                engram_ids: jax.Array | None = None, vl: jax.Array | None = None) -> dict:
    """Graph A's last step (docs/REFERENCE.md §5): the first decoder layer's attention input from the encoder
    output (after that layer's Engram, if it has one, shut at image-span positions `vl`), and its
    global writes only. Its compressed KV and index keys come out exact."""
    cfg = model.cfg
    block = model.layers[cfg.decoder_start]
    plan = body.Plan.resolve(runtime)
    span = body.Span.at(start, h.shape[1], engram_ids=engram_ids, vl=vl)
    store = body.QuantStore(cfg, cache)
    h, _ = body.engram_site(cfg, block, h, span, plan)
    body.write_source(block, body.attn_input(block, h, pre, plan), span, store, plan)
    return store.cache


def run_layers(model, h: jax.Array, pre: jax.Array, cache: dict, *, start: jax.Array, layers: range,
               runtime: Runtime = Runtime(), engram_ids: jax.Array | None = None, floor: jax.Array | None = None,
               write_globals: bool = True, lean: bool = False, collect_topk: bool = False,
               packed_index: bool = True, vl: jax.Array | None = None):
    """Run `layers` over a chunk whose first token sits at position start[b]. Returns
    (h, pre, cache, aux) with aux = {"topk": {layer: [B,T,K]}, "pool": mask or None}.

    packed_index (lean fast mode only): score the packed index keys with
    `fast_index.scores_packed` (head weights folded into the query, no intermediate bf16
    rounding); False keeps `Indexer.scores`' reference rounding points, and the lean step then
    equals `model.forward` bit for bit. Exact mode always uses `Indexer.scores`.
    vl: optional bool [B,T], image-span positions (Engram shut, the MoE routes with `bias_vl`).

    The cache's `length` is not touched (callers own it). The attention and indexer run their
    kernels when runtime.impl is "pallas", as model.forward does.
    """
    plan = body.Plan.resolve(runtime, writes="all" if write_globals else "window",
                             pool_scoring=lean, packed_scoring=lean and packed_index)
    span = body.Span.at(start, h.shape[1], engram_ids=engram_ids, floor=floor, vl=vl)
    h, pre, store, carry, records = body.run_layers(model, h, pre, body.QuantStore(model.cfg, cache), span, plan,
                                                    layers)
    return h, pre, store.cache, {"topk": records.get("topk", {}) if collect_topk else {}, "pool": carry.pool}
