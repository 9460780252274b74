"""The one layer body: `block_step` and the loop over it (the weights the kernels read are made
once at load, in `dsv41_jax.model.kernel_weights`).

What differs between the drivers (model.forward, the engine's steps, split prefill, replay) is
data, never a copy of the body:
- `Plan` (`model/plan.py`): static and hashable (part of every jit key): the resolved `Runtime`
  (numerics, kernel choice, index-key mode), which writes the global caches get, and the scoring
  variants serving uses.
- `Span` (`model/plan.py`): traced: RoPE positions, the chunk start, Engram ids, a window floor,
  image-span mask.
- `LayerState`: what one layer hands the next: the stream, its pre-mix, the store and the `Carry`
  (what later layers take from earlier ones: index sources' top-k, the pool).
- a `Store` (`model/store.py`): the cache behind the questions the body asks (window rows, global
  writes, index keys, top-k width, compressed rows); serving's `QuantStore` and training's
  `FakeQuantStore` answer them. The body asks nothing else of a store.
- probes (`dsv41_jax.model.probe`): static observers with their traced `probe_inputs`; the body
  shows them its intermediates (`probe.see(l, AttnSeen(...))`) and they name what they record
  (golden-check's names live in the probe); `NO_PROBE` traces to nothing.

block_step's only `if`s on structure test the layer's role (the architecture) or the plan.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.layers import fast_index  # the packed scoring variant (Plan.packed_scoring)
from dsv41_jax.layers.basic import matmul
from dsv41_jax.layers.indexer import candidate_pool, select_topk
from dsv41_jax.layers.mhc_site import collapse, expand
from dsv41_jax.layers.rope import apply_rope, cos_sin, layer_rope
from dsv41_jax.model.cache import oracle_column_order
from dsv41_jax.model import stack
from dsv41_jax.model.plan import Plan, Span
from dsv41_jax.model.probe import (NO_PROBE, AttnSeen, EngramSeen, FfnSeen, FinalSeen, PoolSeen, Probe, ScoresSeen,
                                   SourceSeen, merge_records)
from dsv41_jax.model.store import QuantStore, Store
from dsv41_jax.numerics import gemm, kv_layout, quant
from dsv41_jax.numerics.sparse_attention import sparse_attention

# The drivers build the body's inputs as body.Plan, body.Span and body.QuantStore.
__all__ = ["Carry", "LayerState", "Plan", "QuantStore", "Span", "Store", "block_step", "layer_runs", "remat_step",
           "run_layers", "scan_run"]


class Carry(NamedTuple):
    """What later layers read from earlier ones (traced)."""

    topk: dict  # {index source layer: [B, T, K] selected compressed positions}
    pool: jax.Array | None = None  # [B, T, G] candidate pool mask of the candidate source
    pool_blocks: tuple | None = None  # (block ids, valid) of the pool, ascending (pool_scoring)


class LayerState(NamedTuple):
    """What one layer hands the next."""

    h: jax.Array  # [B, T, hc, d] the residual stream, hc copies
    pre: jax.Array  # [B, T, hc] the last FFN site's pre-mix: the next attention site collapses h with it
    store: Store  # the cache, as the body sees it (a Python object: a store is never a jit output)
    carry: Carry

    @classmethod
    def first(cls, h, pre, store: Store, carry: Carry | None = None) -> "LayerState":
        """The state entering the first layer a driver runs (no carry unless it continues one)."""
        return cls(h, pre, store, Carry({}) if carry is None else carry)


def embed(model, tokens: jax.Array, spans: tuple | None = None):
    """(h [B,T,hc,d], pre [B,T,hc]): the embedding (image-span rows swapped in) in every copy, and
    the one-hot first pre-mix. spans: optional (rows [B,T,dim], token_types [B,T]), type >= 0 in a span."""
    cfg = model.cfg
    B, T = tokens.shape
    h = model.embed[...][tokens]
    if spans is not None:
        h = jnp.where((spans[1] >= 0)[..., None], spans[0].astype(h.dtype), h)
    h = jnp.broadcast_to(h[:, :, None, :], (B, T, cfg.hc_mult, cfg.dim))
    pre = jnp.zeros((B, T, cfg.hc_mult), jnp.float32).at[..., 0].set(1.0)
    return h, pre


def head(model, h: jax.Array, pre: jax.Array, mode: str, probe: Probe = NO_PROBE):
    """Collapse with the last pre-mix, final norm, fp32 head: (logits [B,T,V], records)."""
    final = collapse(h, pre)
    rec = probe.see(-1, FinalSeen(final))
    x = model.norm(final, mode)
    return matmul(x.astype(jnp.float32), model.head[...].astype(jnp.float32), "btd,vd->btv", jnp.float32, mode), rec


def engram_site(cfg, block, h, span: Span, plan: Plan, probe: Probe = NO_PROBE):
    """The layer's Engram (if any): (h, records). The gate is shut at image-span positions."""
    if block.engram is None:
        return h, {}
    l = block.layer
    if span.engram_ids is None:
        raise ValueError(f"layer {l} has Engram: pass engram_ids (see dsv41_jax.engram.hashing.hash_ids)")
    h_in = h
    h, gate = block.engram(h, span.engram_ids[:, :, cfg.engram_layer_ids.index(l)], plan.runtime.mode)
    if span.vl is not None:  # the reference shuts the gate at image-span positions
        h = jnp.where(span.vl[..., None, None], h_in, h)
        gate = jnp.where(span.vl[..., None], 0.0, gate)
    return h, probe.see(l, EngramSeen(gate))


def attn_input(block, h, pre, plan: Plan):
    """The attention's input: the stream collapsed with the layer's pre-mix, normed."""
    return block.attn_norm(collapse(h, pre), plan.runtime.mode)


def write_source(block, x, span: Span, store: Store, plan: Plan, probe: Probe = NO_PROBE):
    """A KV source's global writes for the chunk (compressor groups, their index keys and their FP4
    compressed entries; docs/REFERENCE.md §3 "Compressor", "Indexer"): records."""
    cfg, attn, l = store.cfg, block.attn, block.layer
    m = block.role.ratio
    freqs = layer_rope(cfg, m)
    lat, gids, state, rows = attn.compressor.groups(x, span.start, store.compressor_state(l), plan.runtime.mode)
    lat, gpos, gids = store.groups(l, m, lat, gids, span)
    gcos, gsin = cos_sin(gpos, freqs)
    keys = attn.indexer.keys(store.key_source(lat), gcos, gsin, plan.runtime.mode) if attn.indexer is not None else None
    store.write_source(l, state, gids, apply_rope(lat, gcos, gsin, cfg.rope_head_dim), keys, rows)
    return probe.see(l, SourceSeen(lat, gids, store, attn.indexer is not None))


def index_scores(attn, store, x, qr, keys, cos, sin, visible, plan: Plan, how: str = "xla", pool=None):
    """Index scores [B, T, G] of the chunk's queries (x, qr) against an index source's keys: the one
    place the indexer scores, for full-width selection, in-pool Reindex scoring and the probes'
    scoring at sampled positions (training's indexer KL). docs/REFERENCE.md §3 "Indexer".

    how: "xla"    keys are bf16 [B, G, Di]; the query side goes through the store (the fake-quant
                  store stops its gradients, so the indexer KL trains the indexer alone);
         "packed" keys are the packed FP4 `IndexKeys` (fast numerics reads them without decoding);
         "kernel" keys are the quantized container the Pallas indexer reads; pool: the Reuse
                  candidate mask, or None.
    """
    if how == "kernel":
        # selection needs no gradient and a kernel has none: the indexer's weights and inputs enter it
        # stopped (a no-op when serving; in training only the indexer KL's XLA scoring trains them)
        graphdef, state = nnx.split(attn.indexer)
        indexer = nnx.merge(graphdef, jax.tree.map(jax.lax.stop_gradient, state))
        x, qr = (jax.lax.stop_gradient(a) for a in store.index_inputs(x, qr))
        return indexer.scores_pallas(x, qr, keys, cos, sin, visible, plan.runtime, pool)
    if how == "packed":
        return fast_index.scores_packed(attn.indexer, x, qr, keys, cos, sin, visible)
    if how != "xla":
        raise ValueError(f"index_scores: how={how!r}; use 'xla', 'packed' or 'kernel'")
    return attn.indexer.scores(*store.index_inputs(x, qr), keys, cos, sin, visible, plan.runtime.mode)


def select(block, x, qr, cos, sin, visible, store: Store, carry: Carry, plan: Plan, probe: Probe, probe_inputs):
    """An index source's top-k: (sel [B,T,K], carry, records)."""
    cfg, attn, role, l = store.cfg, block.attn, block.role, block.layer
    src, mode = role.kv_source, plan.runtime.mode
    width = store.topk_width(src)
    pool_scoring = plan.pool_scoring and not plan.runtime.index_k_quirk
    packed = pool_scoring and plan.packed_scoring and mode == "fast"
    P = cfg.candidate_topk_blocks * cfg.candidate_block_size
    rec, pool, pool_blocks = {}, carry.pool, carry.pool_blocks
    if (role.uses_candidates and pool_scoring and pool_blocks is not None
            and width <= P < store.stored_index_keys(src).packed.shape[1]):
        s, cand = _pool_scores(attn, store, x, qr, cos, sin, store.stored_index_keys(src), *pool_blocks,
                               cfg.candidate_block_size, visible, plan, packed)
        sel = _pool_select(s, cand, visible, width)
    else:
        ikeys = store.index_key_container(role, plan) if plan.kernel_mode is not None else None
        if ikeys is not None:
            scores = index_scores(attn, store, x, qr, ikeys, cos, sin, visible, plan, "kernel",
                                  pool if role.uses_candidates else None)
        elif packed:
            scores = index_scores(attn, store, x, qr, store.stored_index_keys(src), cos, sin, visible, plan, "packed")
        else:
            if pool_scoring:
                keys_bf16 = decode_index_keys(store.stored_index_keys(src))
            else:
                keys_bf16 = store.index_keys(role, plan)
            scores = index_scores(attn, store, x, qr, keys_bf16, cos, sin, visible, plan)
        scores = store.mask_scores(src, scores)
        if role.is_candidate_source:
            pool, block_scores = candidate_pool(scores, store.pool_visible(src, visible), cfg.candidate_topk_blocks,
                                                cfg.candidate_block_size)
            rec = probe.see(l, PoolSeen(pool, block_scores))
            if pool_scoring:
                vals, bidx = jax.lax.top_k(block_scores, min(cfg.candidate_topk_blocks, block_scores.shape[-1]))
                order = jnp.argsort(bidx, -1)
                pool_blocks = (jnp.take_along_axis(bidx, order, -1), jnp.take_along_axis(vals > -jnp.inf, order, -1))
        elif role.uses_candidates:
            scores = jnp.where(pool, scores, -jnp.inf)
        sel = store.restrict(src, select_topk(scores, visible, width))
        sel, r = probe.decide("topk", l, sel, scores, probe_inputs)
        rec = merge_records(rec, r, probe.see(l, ScoresSeen(scores)))
    return sel, Carry({**carry.topk, l: sel}, pool, pool_blocks), rec


def attn_in(block, h, pre, positions, ratio: int, cfg, plan: Plan):
    """The attention site's inputs: (x, qr, q, cos, sin, this chunk's window rows (unquantized: the
    store keeps them in its format), the site's mHC mixes (pre, post, comb)). A DSpark stage is a
    layer of ratio 0."""
    mode = plan.runtime.mode
    mixes = block.hc_attn.mixes(h, mode)
    x = attn_input(block, h, pre, plan)
    cos, sin = cos_sin(positions, layer_rope(cfg, ratio))
    qr, q = block.attn.queries(x, cos, sin, mode)
    return x, qr, q, cos, sin, window_rows(block.attn, x, cos, sin, mode), mixes


def window_rows(attn, x, cos, sin, mode: str):
    """The window K=V rows [B, T, D] of attention inputs x (unquantized): a layer's own, and the rows a
    DSpark stage's ring takes from the main model (`dspark.write_rings`)."""
    return attn.window_kv(x, cos, sin, mode)


def attend(attn, q, rows, idx, cfg, plan: Plan, kernel_inputs=None):
    """Sparse sink attention: the Pallas kernel on `kernel_inputs` = (window rows, window idx, compressed
    rows or None, selection or None) when given (the plan runs the kernel and the store has its
    inputs: quantized containers, or the training store's rows before quantization), else the XLA
    math over the dequantized rows [B, N, D] at idx [B, T, K] (-1 = empty)."""
    if kernel_inputs is not None:
        return attn.attend_pallas(q, *kernel_inputs, cfg.head_dim ** -0.5, plan.runtime)
    return sparse_attention(q, rows.astype(q.dtype), attn.attn_sink[...], idx, cfg.head_dim ** -0.5,
                            mode=plan.runtime.mode, keep_nonfinite=plan.runtime.check_finite)


def attn_out(attn, o, cos, sin, h, mixes, plan: Plan):
    """The attention output projected and mixed back into the stream: (a_out, h)."""
    a_out = attn.output(o, cos, sin, plan.runtime.mode)
    return a_out, expand(a_out, h, *mixes)


def ffn_site(block, h, a_pre, plan: Plan, probe: Probe = NO_PROBE, probe_inputs=None, l=None, vl=None):
    """The FFN site: (h, its pre-mix, (x, y, post, comb, MoE info), records). The MoE routes, the probe
    decides ("experts": golden-check imposes stored choices), the MoE applies the decided experts.
    l: the layer (or DSpark stage) the probe sees; vl: image-span mask (selection with `bias_vl`).
    records: {"experts": the experts run [B,T,k], "gate_scores": [B,T,E]} and the probe's."""
    mode = plan.runtime.mode
    f_pre, f_post, f_comb = block.hc_ffn.mixes(h, mode)
    x = block.ffn_norm(collapse(h, a_pre), mode)
    scores, biased, own = block.ffn.route(x, mode, vl)
    experts, rec = probe.decide("experts", l, own, biased, probe_inputs)
    y, info = block.ffn.apply(x, scores, experts, mode, plan.runtime.impl, plan.runtime.interpret)
    rec = merge_records(rec, {"experts": experts, "gate_scores": scores})
    return expand(y, h, f_post, f_comb), f_pre, (x, y, f_post, f_comb, info), rec


def block_step(block, state: LayerState, span: Span, plan: Plan, probe: Probe = NO_PROBE,
               probe_inputs=None) -> tuple[LayerState, dict]:
    """One layer over a chunk: (the state for the next layer, records).

    The caller's store is not changed (the layer writes into a copy). probe_inputs: the traced data
    the probe reads (golden-check's stored decisions, training's KL positions); None for none.
    records: {"topk": sel (compressed layers), "experts": [B,T,k], "gate_scores": [B,T,E]} and whatever the
    probe records.
    """
    h, pre, store, carry = state
    cfg, l, role, attn = store.cfg, block.layer, block.role, block.attn
    store = store.copy()
    h, rec = engram_site(cfg, block, h, span, plan, probe)
    h, pre, r = probe.enter(l, h, pre, probe_inputs)
    rec = merge_records(rec, r)
    x, qr, q, cos, sin, win_raw, (a_pre, a_post, a_comb) = attn_in(block, h, pre, span.positions, role.ratio, cfg,
                                                                   plan)
    keys, idx, win_kernel = store.window(l, win_raw, span)
    kernel = plan.kernel_mode is not None and win_kernel is not None  # the attention kernel runs
    win_kernel = win_kernel or (None, None)
    kernel_inputs = (*win_kernel, None, None)  # what the attention kernel reads

    if role.ratio:
        src = role.kv_source
        visible = store.visible(span, role.ratio)
        if role.is_kv_source and plan.writes != "window":
            rec = merge_records(rec, write_source(block, x, span, store, plan, probe))
        if role.is_index_source:
            _, carry, r = select(block, x, qr, cos, sin, visible, store, carry, plan, probe, probe_inputs)
            scoring = _scoring_context(block, store, carry, plan, x, qr, q, cos, sin, visible, keys, idx)
            rec = merge_records(rec, r, probe.scored(l, scoring, probe_inputs))
        sel = carry.topk[role.index_source]
        rec["topk"] = sel
        kernel_inputs = (*win_kernel, store.compressed(src), sel)
        if not kernel:
            keys, idx = _with_compressed(keys, idx, store, src, sel, plan)

    if plan.runtime.mode == "exact" and not kernel:
        idx = oracle_column_order(idx, span.start, span.positions.shape[1], cfg.window_size)
    o = attend(attn, q, keys, idx, cfg, plan, kernel_inputs if kernel else None)
    a_out, h = attn_out(attn, o, cos, sin, h, (a_post, a_comb), plan)
    rec = merge_records(rec, probe.see(l, AttnSeen(h, x, a_out, o, a_pre, a_post, a_comb)))

    h, f_pre, (x, y, f_post, f_comb, info), r = ffn_site(block, h, a_pre, plan, probe, probe_inputs, l, span.vl)
    rec = merge_records(rec, r, probe.see(l, FfnSeen(x, y, f_pre, f_post, f_comb, info)))
    return LayerState(h, f_pre, store, carry), rec


def _scoring_context(block, store: Store, carry: Carry, plan: Plan, x, qr, q, cos, sin, visible, win_keys, win_idx):
    """What `Probe.scored` may ask for after an index source selected (built only when asked): the
    store, the source, the attention's query and window rows, the pool and the one scoring function."""
    role = block.role
    return lambda: {
        "store": store, "src": role.kv_source, "attn": block.attn, "q": q, "win": win_keys, "win_idx": win_idx,
        "pool": carry.pool if role.uses_candidates else None,
        "score": lambda pick, k: index_scores(block.attn, store, pick(x), pick(qr), k, pick(cos), pick(sin),
                                              pick(visible), plan)}


def _with_compressed(keys, idx, store, src: int, sel, plan: Plan):
    """The attention's key rows and indices with the selected compressed rows appended: all of the
    source's rows, or (pool_scoring decode, when fewer) only the selected rows, query by query."""
    B, T, K = sel.shape
    off = keys.shape[1]
    if plan.pool_scoring and T * K < store.compressed(src).packed.shape[1]:
        comp = store.compressed(src)
        b = jnp.arange(B)[:, None, None]
        safe = jnp.maximum(sel, 0)
        rows = kv_layout.dequantize_compressed(type(comp)(*(a[b, safe] for a in comp)))
        keys = jnp.concatenate([keys, rows.astype(keys.dtype).reshape(B, T * K, -1)], 1)
        slot = off + jnp.arange(T)[:, None] * K + jnp.arange(K)[None]
        return keys, jnp.concatenate([idx, jnp.where(sel >= 0, slot[None], -1)], -1)
    rows = store.compressed_rows(src).astype(keys.dtype)
    return jnp.concatenate([keys, rows], 1), jnp.concatenate([idx, jnp.where(sel >= 0, sel + off, -1)], -1)


_E2M1_PAIRS = np.stack([quant.E2M1_VALUES[np.arange(256) & 15], quant.E2M1_VALUES[np.arange(256) >> 4]], -1)


def decode_index_keys(k: kv_layout.IndexKeys) -> jax.Array:
    """`kv_layout.dequantize_index_keys(k).astype(bf16)`, bit for bit, with one table lookup per
    byte instead of nibble arithmetic: the decode step decodes every cached key it scores, so this
    is per-position work (about 3 instead of 8 elementwise ops per key element)."""
    pairs = jnp.asarray(_E2M1_PAIRS).at[k.packed].get(mode="promise_in_bounds")  # [..., Di/2, 2] f32
    vals = pairs.reshape(*k.packed.shape[:-1], k.scales.shape[-1], -1)
    return (vals * quant.e8m0_to_float(k.scales)[..., None]).reshape(*k.packed.shape[:-1], -1).astype(jnp.bfloat16)


def _pool_scores(attn, store, x, qr, cos, sin, keys_cache: kv_layout.IndexKeys, pool_blocks, block_valid,
                 block: int, visible, plan: Plan, packed: bool = False):
    """In-pool Reindex scores over the pool's positions only (Plan.pool_scoring): [B,T,P] and positions [B,T,P].

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
    rows = kv_layout.bytes_of(type(keys_cache)(*(a[b, safe] for a in keys_cache)))  # the gathered rows only
    P = rows.packed.shape[2]
    # score one query against its own gathered keys: fold T into the batch
    flat = lambda a: a.reshape(B * T, 1, *a.shape[2:])
    full = jnp.full((B * T, 1), P, jnp.int32)
    if packed:
        rows = kv_layout.IndexKeys(*(a.reshape(B * T, P, -1) for a in rows))
        s = index_scores(attn, store, flat(x), flat(qr), rows, flat(cos), flat(sin), full, plan, "packed")
    else:
        keys = decode_index_keys(rows)  # [B,T,P,Di]
        s = index_scores(attn, store, flat(x), flat(qr), keys.reshape(B * T, P, -1), flat(cos), flat(sin), full, plan)
    s = s.reshape(B, T, P)
    ok = valid & (pos < visible[..., None])
    return jnp.where(ok, s, -jnp.inf), jnp.where(valid, pos, G)


def _pool_select(scores, positions, visible, k: int):
    """Top-k over gathered candidates, mapped back to positions, ascending, -1 where unreachable."""
    vals, j = jax.lax.top_k(scores, k)
    pos = jnp.take_along_axis(positions, j, -1)
    pos = jnp.sort(jnp.where(vals > -jnp.inf, pos, jnp.iinfo(jnp.int32).max), -1)
    return jnp.where(pos < visible[..., None], pos, -1).astype(jnp.int32)


def run_layers(model, state: LayerState, span: Span, plan: Plan, layers, probe: Probe = NO_PROBE,
               probe_inputs=None, remat: bool = False, layout=None) -> tuple[LayerState, dict]:
    """`block_step` over `layers` (the one loop): (the state after the last, records) with
    records = {kind: {layer: value}} and the probes' traces merged into records["trace"]. Each run of
    `layer_runs` longer than one layer is one `jax.lax.scan` of the same body (`scan_run`).

    remat: each layer under `jax.checkpoint` (`remat_step`), for a driver that differentiates the loop.
    layout: a function of a layer's module applied where the layer runs (training on a mesh: its
    weights gathered whole over the FSDP axes, `train.mesh.layer_layout`); None (serving): none."""
    records: dict = {}
    if remat:
        step = functools.partial(remat_step, layout=layout)
    else:
        step = block_step if layout is None else (lambda block, *args: block_step(layout(block), *args))
    with fp8_linears(plan):
        for run in layer_runs(model, layers, plan, probe, probe_inputs):
            if len(run) == 1:
                state, rec = step(stack.layer(model, run[0]), state, span, plan, probe, probe_inputs)
                recs = {run[0]: rec}
            else:
                state, recs = scan_run(model, state, span, plan, run, probe, probe_inputs, step)
            for l, rec in recs.items():
                for k, v in rec.items():
                    if k == "trace":
                        records.setdefault("trace", {}).update(v)
                    else:
                        records.setdefault(k, {})[l] = v
    return state, records


def layer_runs(model, layers, plan: Plan, probe: Probe = NO_PROBE, probe_inputs=None) -> list[tuple[int, ...]]:
    """`layers` cut into runs, in order: consecutive layers that compile to one body form a run (same
    role but for the layer number, no Engram, parameters of the same shapes, no probe follows them),
    and only layers that change nothing but the stream and their own window (SWA, Reuse: no global
    write, no top-k, no pool) join one; every other layer is a run of one. With
    `Runtime.scan_layers` False every layer is a run of one."""
    def kind(l):
        block, role = model.layers[l], model.cfg.roles[l]
        engram = not isinstance(block, stack.LayerStack) and block.engram is not None
        if (not plan.runtime.scan_layers or engram or role.is_kv_source or role.is_index_source
                or probe.follows(l, probe_inputs)):
            return None
        shapes = stack.layer_shapes(model, l)
        return dataclasses.replace(role, layer=0), jax.tree.structure(shapes), jax.tree.leaves(shapes)

    runs: list[list[int]] = []
    prev = None
    for l in layers:
        k = kind(l)
        if runs and k is not None and k == prev and runs[-1][-1] == l - 1:
            runs[-1].append(l)
        else:
            runs.append([l])
        prev = k
    return [tuple(r) for r in runs]


def remat_step(block, state: LayerState, span: Span, plan: Plan, probe: Probe = NO_PROBE,
               probe_inputs=None, layout=None) -> tuple[LayerState, dict]:
    """`block_step` under `jax.checkpoint`, saving nothing inside the layer: the backward recomputes
    the layer from its input state. Without it a differentiated loop keeps every layer's
    intermediates to the backward at once, the weights as each GEMM read them among them
    (fake-quantized, gathered over the FSDP axis). The store must be a pytree (training's is).
    layout (`run_layers`) is applied inside the checkpoint: what it makes is recomputed too."""
    def run(s):
        return block_step(block if layout is None else layout(block), s, span, plan, probe, probe_inputs)

    return jax.checkpoint(run)(state)


def scan_run(model, state: LayerState, span: Span, plan: Plan, run, probe: Probe = NO_PROBE,
             probe_inputs=None, step=block_step) -> tuple[LayerState, dict]:
    """`block_step` over a run of `layer_runs` as one `jax.lax.scan`: the run's first module with each
    layer's parameters (`stack.run_params`: a slice of the stack the engine holds, made once at load,
    else stacked here, per program), the store seeing each layer's own part (its window) as the
    first layer's: the layers' parts stacked (`Store.stacked`: the stack the engine's cache holds,
    else stacked here) are the scan's carry, each layer writing its own slice in place. The run's
    layers write nothing else and leave the carry as it is, so the rest of the store and the carry
    are the scan's constants. `step`: `block_step` or `remat_step`.
    Returns (the state after the run, {layer: records})."""
    l0 = run[0]
    graphdef, params = stack.run_params(model, run)
    h, pre, store, carry = state

    def one(stream, x):
        h, pre, parts = stream
        p, i = x
        inputs = LayerState(h, pre, store.at_layer(l0, parts, i), carry)
        out, rec = step(stack.at_layer(graphdef, p, l0, model.cfg), inputs, span, plan, probe, probe_inputs)
        parts, kept = out.store.written(l0)
        return (out.h, out.pre, parts), (kept, rec)

    (h, pre, parts), (kept, recs) = jax.lax.scan(one, (h, pre, store.stacked(run)),
                                                 (params, jnp.arange(len(run), dtype=jnp.int32)))
    per_layer = {l: jax.tree.map(lambda a, i=i: a[i], recs) for i, l in enumerate(run)}
    return LayerState(h, pre, store.unstacked(run, parts, kept), carry), per_layer


def fp8_linears(plan: Plan):
    """The context the layers' FP8 linears run in under `plan` (`gemm.fp8_kernel`): every driver of a
    layer's linears (`run_layers`, split prefill's `project_ced`) enters it."""
    return gemm.fp8_kernel(_fp8_kernel(plan))


def _fp8_kernel(plan: Plan):
    """The dense FP8 linears' GEMM for `plan`: the FP8 block GEMM kernel (it reads the stored E4M3
    tiles and dequantizes in registers) when the plan says so (`Runtime.fp8_kernel`: impl "pallas",
    fast numerics, compiled kernels by default), else None (the XLA math, which dequantizes the whole
    weight per call; exact mode always: the kernel has none)."""
    if not plan.runtime.fp8_kernel:
        return None
    from pallas_kernels import fp8_block_gemm  # noqa: WPS433 (optional dependency on the kernels)

    return lambda x, w, s: fp8_block_gemm(x, w, s, impl="pallas", interpret=plan.runtime.interpret)
