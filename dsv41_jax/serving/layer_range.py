"""A forward over a range of layers, with the knobs serving needs (docs/REFERENCE.md §5).

`model.forward` runs every layer over a chunk. The CED split, encoder replay and a lean decode
step need three things it does not offer, so this module re-states its per-layer body (same
operations in the same order, so the results are bitwise equal; `tests/test_serving.py` checks
it) with:

- a layer range, entered and left through the residual stream (h, pre);
- `floor`: window slots at positions below `floor[b]` are empty. Graph B of the split prefill
  and the replay after a prefix-cache restore see only the tail they run over;
- `write_global=False`: KV sources read the global caches but do not write them (replay);
- `lean=True`: decode-sized chunks gather the selected compressed rows (and, for in-pool
  Reindex layers, only the pool's index keys) instead of dequantizing whole caches, so the
  step's work does not grow with the context except for the indexer's scoring.

The proposed refactor that would let `model.forward` share this body is described in
`docs/SERVING.md` ("run_layer refactor").
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dsv41_jax.numerics import kv_layout, quant
from dsv41_jax.layers.indexer import candidate_pool, select_topk
from dsv41_jax.layers.mhc_site import collapse, expand
from dsv41_jax.layers.rope import apply_rope, cos_sin, layer_rope
from dsv41_jax.model.cache import index_keys_for, scatter_container, window_indices, write_ring
from dsv41_jax.runtime import Runtime
from dsv41_jax.serving import fast_index
from pallas_kernels.sparse_attention.dense_reference import sparse_attention


def embed(model, tokens: jax.Array):
    """(h [B,T,hc,d], pre [B,T,hc]): the embedding in every copy, and the one-hot first pre-mix."""
    cfg = model.cfg
    B, T = tokens.shape
    h = model.embed[...][tokens]
    h = jnp.broadcast_to(h[:, :, None, :], (B, T, cfg.hc_mult, cfg.dim))
    pre = jnp.zeros((B, T, cfg.hc_mult), jnp.float32).at[..., 0].set(1.0)
    return h, pre


def head(model, h: jax.Array, pre: jax.Array, mode: str) -> jax.Array:
    """Collapse with the last pre-mix, final norm, fp32 head: logits [B,T,V]."""
    from dsv41_jax.layers.basic import matmul

    x = model.norm(collapse(h, pre), mode)
    return matmul(x.astype(jnp.float32), model.head[...].astype(jnp.float32), "btd,vd->btv", jnp.float32, mode)


def copy_cache(cache: dict) -> dict:
    """A shallow copy whose per-layer containers can be replaced without touching the input."""
    return {"length": cache["length"], "window": list(cache["window"]), "compressed": dict(cache["compressed"]),
            "index_keys": dict(cache["index_keys"]), "compressor": dict(cache["compressor"]),
            "published": cache["published"]}


def topk_width(cfg, cache: dict, src: int) -> int:
    """min(index_topk, entries the cache holds): equals cfg.topk_width at capacity cfg.max_seq_len."""
    return min(cfg.index_topk, int(cache["compressed"][f"layer{src}"].packed.shape[1]))


def write_global(model, layer: int, x: jax.Array, start: jax.Array, cache: dict, runtime: Runtime) -> None:
    """A KV source's global writes for a chunk (in place on the dict `cache`): compressor groups,
    their index keys and their FP4 compressed entries (docs/REFERENCE.md §3 "Compressor", "Indexer")."""
    cfg = model.cfg
    block = model.layers[layer]
    attn, role = block.attn, block.role
    m, key, mode = role.ratio, f"layer{layer}", runtime.mode
    freqs = layer_rope(cfg, m)
    state = cache["compressor"].get(key)
    lat, gids, state = attn.compressor.groups(x, start, state, mode)
    if state is not None:
        cache["compressor"][key] = state
    gcos, gsin = cos_sin(jnp.maximum(gids, 0) * m, freqs)
    if attn.indexer is not None:
        k_new = kv_layout.quantize_index_keys(attn.indexer.keys(lat, gcos, gsin, mode))
        cache["index_keys"][key] = scatter_container(cache["index_keys"][key], k_new, gids)
        produced = jnp.any(gids >= 0, axis=1)
        cache["published"] = jnp.where(produced, layer, cache["published"])
    entries = kv_layout.quantize_compressed(apply_rope(lat, gcos, gsin, cfg.rope_head_dim))
    cache["compressed"][key] = scatter_container(cache["compressed"][key], entries, gids)


def project_ced(model, h: jax.Array, pre: jax.Array, start: jax.Array, cache: dict, runtime: Runtime,
                engram_ids: jax.Array | None = None) -> dict:
    """Graph A's last step (docs/REFERENCE.md §5): the first decoder layer's attention input from the encoder
    output (after that layer's Engram, if it has one), and its global writes only. Its
    compressed KV and index keys come out exact."""
    cfg = model.cfg
    d = cfg.decoder_start
    block = model.layers[d]
    if block.engram is not None:
        if engram_ids is None:
            raise ValueError(f"layer {d} has Engram: pass engram_ids (see dsv41_jax.engram.hashing.hash_ids)")
        h, _ = block.engram(h, engram_ids[:, :, cfg.engram_layer_ids.index(d)], runtime.mode)
    x = block.attn_norm(collapse(h, pre), runtime.mode)
    cache = copy_cache(cache)
    write_global(model, d, x, start, cache, runtime)
    return cache


_E2M1_PAIRS = np.stack([quant.E2M1_VALUES[np.arange(256) & 15], quant.E2M1_VALUES[np.arange(256) >> 4]], -1)


def decode_index_keys(k: kv_layout.IndexKeys) -> jax.Array:
    """`kv_layout.dequantize_index_keys(k).astype(bf16)`, bit for bit, with one table lookup per
    byte instead of nibble arithmetic: the decode step decodes every cached key it scores, so this
    is per-position work (about 3 instead of 8 elementwise ops per key element)."""
    pairs = jnp.asarray(_E2M1_PAIRS).at[k.packed].get(mode="promise_in_bounds")  # [..., Di/2, 2] f32
    vals = pairs.reshape(*k.packed.shape[:-1], k.scales.shape[-1], -1)
    return (vals * quant.e8m0_to_float(k.scales)[..., None]).reshape(*k.packed.shape[:-1], -1).astype(jnp.bfloat16)


def _lean_pool_scores(attn, x, qr, cos, sin, keys_cache: kv_layout.IndexKeys, pool_blocks, block_valid,
                      block: int, visible, mode, packed: bool = False):
    """In-pool Reindex scores over the pool's positions only (decode): [B,T,P] and positions [B,T,P].

    Positions come block by block in ascending order, so a top-k over them breaks ties toward
    the lower position exactly like the full-width top-k does.
    """
    B, T = x.shape[:2]
    G = keys_cache.packed.shape[1]
    pos = pool_blocks[..., None] * block + jnp.arange(block)  # [B,T,nb,block]
    valid = block_valid[..., None] & (pos < G)
    pos = pos.reshape(B, T, -1)
    valid = valid.reshape(B, T, -1)
    safe = jnp.where(valid, pos, 0)
    b = jnp.arange(B)[:, None, None]
    rows = kv_layout.IndexKeys(keys_cache.packed[b, safe], keys_cache.scales[b, safe])
    P = rows.packed.shape[2]
    # score one query against its own gathered keys: fold T into the batch
    flat = lambda a: a.reshape(B * T, 1, *a.shape[2:])
    full = jnp.full((B * T, 1), P, jnp.int32)
    if packed:
        rows = kv_layout.IndexKeys(*(a.reshape(B * T, P, -1) for a in rows))
        s = fast_index.scores_packed(attn.indexer, flat(x), flat(qr), rows, flat(cos), flat(sin), full)
    else:
        keys = decode_index_keys(rows)  # [B,T,P,Di]
        s = attn.indexer.scores(flat(x), flat(qr), keys.reshape(B * T, P, -1), flat(cos), flat(sin), full, mode)
    s = s.reshape(B, T, P)
    ok = valid & (pos < visible[..., None])
    return jnp.where(ok, s, -jnp.inf), jnp.where(valid, pos, G)


def _lean_select(scores, positions, visible, k: int):
    """Top-k over gathered candidates, mapped back to positions, ascending, -1 where unreachable."""
    vals, j = jax.lax.top_k(scores, k)
    pos = jnp.take_along_axis(positions, j, -1)
    pos = jnp.sort(jnp.where(vals > -jnp.inf, pos, jnp.iinfo(jnp.int32).max), -1)
    return jnp.where(pos < visible[..., None], pos, -1).astype(jnp.int32)


def run_layers(model, h: jax.Array, pre: jax.Array, cache: dict, *, start: jax.Array, layers: range,
               runtime: Runtime = Runtime(), engram_ids: jax.Array | None = None, floor: jax.Array | None = None,
               write_globals: bool = True, lean: bool = False, collect_topk: bool = False,
               packed_index: bool = True):
    """Run `layers` over a chunk whose first token sits at position start[b]. Returns
    (h, pre, cache, aux) with aux = {"topk": {layer: [B,T,K]}, "pool": mask or None}.

    packed_index (lean fast mode only): score the packed index keys with
    `fast_index.scores_packed` (head weights folded into the query, no intermediate bf16
    rounding); False keeps `Indexer.scores`' reference rounding points, and the lean step then
    equals `model.forward` bit for bit. Exact mode always uses `Indexer.scores`.

    The cache's `length` is not touched (callers own it). Mirrors `model.forward`'s layer body.
    """
    cfg = model.cfg
    mode = runtime.mode
    B, T = h.shape[:2]
    W = cfg.window_size
    positions = start[:, None] + jnp.arange(T)[None]
    new_cache = copy_cache(cache)
    aux = {"topk": {}, "pool": None}
    topk_of: dict[int, jax.Array] = {}
    pool = pool_idx = None
    lean_pool = lean and not runtime.index_k_quirk
    packed = lean_pool and packed_index and mode == "fast"
    for l in layers:
        block = model.layers[l]
        role = block.role
        if block.engram is not None:
            if engram_ids is None:
                raise ValueError(f"layer {l} has Engram: pass engram_ids (see dsv41_jax.engram.hashing.hash_ids)")
            h, _ = block.engram(h, engram_ids[:, :, cfg.engram_layer_ids.index(l)], mode)
        a_pre, a_post, a_comb = block.hc_attn.mixes(h, mode)
        x = block.attn_norm(collapse(h, pre), runtime.mode)
        attn = block.attn
        freqs = layer_rope(cfg, role.ratio)
        cos, sin = cos_sin(positions, freqs)
        qr, q = attn.queries(x, cos, sin, mode)
        win_new = kv_layout.quantize_window(attn.window_kv(x, cos, sin, mode))
        ring = cache["window"][l]
        keys = jnp.concatenate([kv_layout.dequantize_window(ring), kv_layout.dequantize_window(win_new)], 1)
        idx = window_indices(start, T, W)
        if floor is not None:
            p = positions[..., None] - (W - 1) + jnp.arange(W)
            idx = jnp.where(p >= floor[:, None, None], idx, -1)
        new_cache["window"][l] = write_ring(ring, win_new, start, W)

        if role.ratio:
            m, src = role.ratio, role.kv_source
            key = f"layer{src}"
            visible = (positions + 1) // m
            if role.is_kv_source and write_globals:
                write_global(model, l, x, start, new_cache, runtime)
            if role.is_index_source:
                width = topk_width(cfg, new_cache, src)
                P = cfg.candidate_topk_blocks * cfg.candidate_block_size
                G = new_cache["index_keys"][key].packed.shape[1]
                if role.uses_candidates and lean_pool and pool_idx is not None and width <= P < G:
                    s, cand = _lean_pool_scores(attn, x, qr, cos, sin, new_cache["index_keys"][key], *pool_idx,
                                                cfg.candidate_block_size, visible, mode, packed)
                    sel = _lean_select(s, cand, visible, width)
                else:
                    if packed:
                        scores = fast_index.scores_packed(attn.indexer, x, qr, new_cache["index_keys"][key], cos, sin, visible)
                    else:
                        if lean_pool:
                            keys_bf16 = decode_index_keys(new_cache["index_keys"][key])
                        else:
                            keys_bf16 = index_keys_for(cfg, new_cache, role, runtime).astype(jnp.bfloat16)
                        scores = attn.indexer.scores(x, qr, keys_bf16, cos, sin, visible, mode)
                    if role.is_candidate_source:
                        pool, block_scores = candidate_pool(scores, visible, cfg.candidate_topk_blocks, cfg.candidate_block_size)
                        if lean_pool:
                            vals, bidx = jax.lax.top_k(block_scores, min(cfg.candidate_topk_blocks, block_scores.shape[-1]))
                            order = jnp.argsort(bidx, -1)
                            pool_idx = (jnp.take_along_axis(bidx, order, -1), jnp.take_along_axis(vals > -jnp.inf, order, -1))
                    elif role.uses_candidates:
                        scores = jnp.where(pool, scores, -jnp.inf)
                    sel = select_topk(scores, visible, width)
                topk_of[l] = sel
            sel = topk_of[role.index_source]
            if collect_topk:
                aux["topk"][l] = sel
            off = keys.shape[1]
            K = sel.shape[-1]
            if lean and T * K < new_cache["compressed"][key].packed.shape[1]:
                # decode: dequantize only the selected rows, laid out query by query
                c = new_cache["compressed"][key]
                b = jnp.arange(B)[:, None, None]
                safe = jnp.maximum(sel, 0)
                rows = kv_layout.dequantize_compressed(kv_layout.CompressedKV(c.packed[b, safe], c.scales[b, safe]))
                keys = jnp.concatenate([keys, rows.astype(keys.dtype).reshape(B, T * K, -1)], 1)
                slot = off + jnp.arange(T)[:, None] * K + jnp.arange(K)[None]
                idx = jnp.concatenate([idx, jnp.where(sel >= 0, slot[None], -1)], -1)
            else:
                comp = kv_layout.dequantize_compressed(new_cache["compressed"][key]).astype(keys.dtype)
                keys = jnp.concatenate([keys, comp], 1)
                idx = jnp.concatenate([idx, jnp.where(sel >= 0, sel + off, -1)], -1)

        o = sparse_attention(q, keys.astype(q.dtype), attn.attn_sink[...], idx, cfg.head_dim ** -0.5, mode=mode,
                             keep_nonfinite=runtime.check_finite)
        a_out = attn.output(o, cos, sin, mode)
        h = expand(a_out, h, a_post, a_comb)
        f_pre, f_post, f_comb = block.hc_ffn.mixes(h, mode)
        x = block.ffn_norm(collapse(h, a_pre), mode)
        y, _ = block.ffn(x, mode, impl=runtime.resolved_impl())
        h = expand(y, h, f_post, f_comb)
        pre = f_pre
    aux["pool"] = pool
    return h, pre, new_cache, aux
