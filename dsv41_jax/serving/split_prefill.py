"""CED split prefill, exact prefill and encoder replay (docs/REFERENCE.md §5), as pure functions of the cache.

- Graph A (`encoder_pass`): the encoder layers over every prompt token, then the first decoder
  layer's Engram (if any), pre-mix collapse, attn_norm, compressor and index-key projection
  (`project_ced`). The global cache of that layer comes out exact.
- Graph B (`decoder_pass`): the decoder layers over the tail only (the last `tail` tokens,
  window + speculative slack), with window attention truncated to the tail by `floor`.
- `exact_prefill`: every layer over every token, which is `model.forward`'s math.
- `replay_window`: after a prefix-cache restore, every layer over the last cached tokens with
  the global caches read-only, to rebuild the window rings.
- `decode_step` (the engine's, on `decode_plan`): every layer over a decode-sized chunk, the
  selected compressed rows gathered and in-pool Reindex layers scoring only the pool.

Each is a short driver of the one layer body (`dsv41_jax.model.block`): a Plan, a Span, the cache
behind a QuantStore. All functions take and return the cache; nothing is mutated. `make_*` wrap
them in `jax.jit` with the model's compiler options.

Padded pieces (`valid`): the engine runs prompts in a few fixed piece shapes (`serving.steps.pieces`),
the last one padded at its end. Attention is causal and a compressed group is visible only once
complete, so no real position reads a padding one; the padding's cache writes are dropped by running
the piece with pending writes and committing the first `valid` positions (`commit`: what a piece of
only those tokens writes). The real positions' results are those of an unpadded piece.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.model import block as body
from dsv41_jax.model.probe import NO_PROBE, Probe, TapProbe
from dsv41_jax.runtime import COMPILER_OPTIONS
from dsv41_jax.runtime import Runtime


def check_splittable(cfg) -> None:
    """Graph B never writes global caches, so no KV source may follow the first decoder layer."""
    d = cfg.decoder_start
    if d >= cfg.n_layers:
        raise ValueError("split prefill needs a ratio-1 KV source (the CED projection); this config has none "
                         "(decoder_start == n_layers): use exact_prefill=True")
    later = [s for s in cfg.kv_source_layers if s > d]
    if later:
        raise ValueError(f"split prefill: KV source layers {later} come after the first decoder layer {d}; their "
                         "global caches would only see the tail. Use exact_prefill=True for this config")


def _slice_ids(engram_ids, lo: int, hi: int):
    return None if engram_ids is None else engram_ids[:, lo:hi]


def _vl(spans):
    """The image-span mask [B,T] of `spans` = (rows, token_types) (type >= 0 in a span), or None."""
    return None if spans is None else spans[1] >= 0


def _layers(model, h, pre, cache: dict, span: body.Span, plan: body.Plan, layers, collect_topk: bool = False,
            probe: Probe = NO_PROBE):
    """The body over `layers` on `cache`: (h, pre, cache, aux) with aux = {"topk": {layer: [B,T,K]} (when
    collected), "pool": the candidate pool mask or None} and, with a `TapProbe`, "main_hidden" (DSpark's
    taps). A "pending" plan returns `cache` as it came and the chunk's writes in aux["pending"] (apply
    a prefix with `commit`)."""
    pending = plan.writes == "pending"
    store = (body.QuantStore.pending_for if pending else body.QuantStore)(model.cfg, cache, *([span.start] if pending
                                                                                             else []))
    (h, pre, store, carry), records = body.run_layers(model, body.LayerState.first(h, pre, store), span, plan, layers,
                                                      probe)
    aux = {"topk": records.get("topk", {}) if collect_topk else {}, "pool": carry.pool}
    if "tap" in records:
        aux["main_hidden"] = TapProbe.hidden(records)
    if pending:
        aux["pending"] = store.pending
        return h, pre, cache, aux
    return h, pre, store.cache, aux


def project_ced(model, h: jax.Array, pre: jax.Array, span: body.Span, cache: dict, plan: body.Plan) -> dict:
    """Graph A's last step (docs/REFERENCE.md §5): the first decoder layer's attention input from the encoder
    output (after that layer's Engram, if it has one, shut at image-span positions), and its global
    writes only. Its compressed KV and index keys come out exact. With a "pending" plan: the cache as
    it came, and the writes in the returned dict's "pending" (`_project_ced`)."""
    return _project_ced(model, h, pre, span, _store(model.cfg, cache, span, plan), plan).cache


def _store(cfg, cache: dict, span: body.Span, plan: body.Plan) -> body.QuantStore:
    if plan.writes == "pending":
        return body.QuantStore.pending_for(cfg, cache, span.start)
    return body.QuantStore(cfg, cache)


def _project_ced(model, h, pre, span: body.Span, store: body.QuantStore, plan: body.Plan) -> body.QuantStore:
    cfg = model.cfg
    block = model.layers[cfg.decoder_start]
    with body.fp8_linears(plan):  # the layer's FP8 linears as run_layers runs them (kernel_params' word views)
        h, _ = body.engram_site(cfg, block, h, span, plan)
        body.write_source(block, body.attn_input(block, h, pre, plan), span, store, plan)
    return store


def _writes(valid) -> str:
    """The plan's writes for a piece: pending (then `commit` of the first `valid`) when padded."""
    return "all" if valid is None else "pending"


def _taps(aux: dict, h: jax.Array) -> jax.Array:
    """aux's DSpark taps, or an empty [B, T, 0] when none of the target layers ran in this pass."""
    got = aux.get("main_hidden")
    return jnp.zeros((*h.shape[:2], 0), h.dtype) if got is None else got


def _split_taps(model, taps: bool):
    return TapProbe(model.cfg.dspark_target_layer_ids) if taps else NO_PROBE


def encoder_pass(model, tokens: jax.Array, cache: dict, *, runtime: Runtime = Runtime(), engram_ids=None,
                 spans=None, taps: bool = False, valid=None):
    """Graph A over one chunk continuing from cache["length"]: returns (h, pre, cache), the encoder
    output [B,T,hc,d] / pre-mix [B,T,hc] and the cache with its length advanced by T.
    spans: optional (rows [B,T,dim], token_types [B,T]) image spans, as `model.forward` takes them.
    taps: also return the DSpark taps of the target layers among the encoder's, [B, T, n_enc * d]
    (n_enc may be 0), as a fourth value: `decoder_pass(taps=True)` gives the others.
    valid [B]: the chunk's first `valid` tokens are real, the rest padding (module doc): the cache
    advances by `valid`; h and pre hold every position (the padding's are garbage)."""
    cfg = model.cfg
    start = cache["length"]
    plan = body.Plan.resolve(runtime, writes=_writes(valid))
    span = body.Span.at(start, tokens.shape[1], engram_ids=engram_ids, vl=_vl(spans))
    h, pre = body.embed(model, tokens, spans)
    h, pre, out, aux = _layers(model, h, pre, cache, span, plan, range(cfg.decoder_start),
                               probe=_split_taps(model, taps))
    if valid is None:
        cache = project_ced(model, h, pre, span, out, plan)
        cache["length"] = start + tokens.shape[1]
    else:
        ced = _project_ced(model, h, pre, span, _store(cfg, cache, span, plan), plan).pending
        pending = {**aux["pending"], "sources": {**aux["pending"]["sources"], **ced["sources"]}}
        cache = commit(cfg, cache, pending, valid)
    return (h, pre, cache, _taps(aux, h)) if taps else (h, pre, cache)


def decoder_pass(model, h: jax.Array, pre: jax.Array, cache: dict, *, start: jax.Array, floor: jax.Array,
                 runtime: Runtime = Runtime(), engram_ids=None, collect_topk: bool = False, vl=None,
                 taps: bool = False):
    """Graph B over one piece of the tail (positions start[b]..): returns (logits [B,T,V], cache, aux).
    Window slots below floor[b] are empty; the global caches are only read. vl: the tail's
    image-span mask [B,T] (or None). taps: aux["main_hidden"] holds the DSpark taps of the target
    layers among the decoder's, [B, T, n_dec * d] (n_dec may be 0)."""
    cfg = model.cfg
    plan = body.Plan.resolve(runtime, writes="window")
    span = body.Span.at(start, h.shape[1], engram_ids=engram_ids, floor=floor, vl=vl)
    h, pre, cache, aux = _layers(model, h, pre, cache, span, plan, range(cfg.decoder_start, cfg.n_layers), collect_topk,
                                 _split_taps(model, taps))
    if taps:
        aux["main_hidden"] = _taps(aux, h)
    return body.head(model, h, pre, plan.runtime.mode)[0], cache, aux


def tail_floor(start: jax.Array, n_new: int, tail: int) -> jax.Array:
    """First position Graph B's window may see: the tail start when the chunk is longer than the
    tail, else 0 (the decoder rings already hold everything before the chunk)."""
    if n_new > tail:
        return start + (n_new - tail)
    return jnp.zeros_like(start)


def split_prefill(model, tokens: jax.Array, cache: dict, *, tail: int | None = None, runtime: Runtime = Runtime(),
                  engram_ids=None, collect_topk: bool = False, spans=None, taps: bool = False):
    """Graph A over all of `tokens`, Graph B over the last min(T, tail) of them.

    tail defaults to the window. Returns (logits of the tail positions [B, min(T, tail), V], cache, aux).
    With T <= tail the result is exact_prefill's, bit for bit. taps: aux["main_hidden"] holds the
    tail positions' DSpark taps (Graph A's target layers, then Graph B's, in layer order).
    """
    cfg = model.cfg
    check_splittable(cfg)
    tail = cfg.window_size if tail is None else tail
    if tail < cfg.window_size:
        raise ValueError(f"tail={tail} is shorter than the window ({cfg.window_size}); the last token's window "
                         "would be truncated")
    B, T = tokens.shape
    start = cache["length"]
    h, pre, cache, *enc = encoder_pass(model, tokens, cache, runtime=runtime, engram_ids=engram_ids, spans=spans,
                                       taps=taps)
    n_t = min(T, tail)
    floor = tail_floor(start, T, tail)
    vl = _vl(spans)
    logits, cache, aux = decoder_pass(model, h[:, T - n_t:], pre[:, T - n_t:], cache, start=start + (T - n_t),
                                      floor=floor, runtime=runtime, engram_ids=_slice_ids(engram_ids, T - n_t, T),
                                      collect_topk=collect_topk, vl=None if vl is None else vl[:, T - n_t:], taps=taps)
    if taps:
        aux["main_hidden"] = jnp.concatenate([enc[0][:, T - n_t:], aux["main_hidden"]], -1)
    return logits, cache, aux


def exact_prefill(model, tokens: jax.Array, cache: dict, *, runtime: Runtime = Runtime(), engram_ids=None,
                  collect_topk: bool = False, spans=None, taps: bool = False, valid=None):
    """Every layer over every token (model.forward's math): (logits [B,T,V], cache, aux).
    spans: optional image spans (rows, token_types), as `model.forward` takes them. taps: DSpark's
    taps in aux["main_hidden"] (as `decode_step`). valid [B]: only the first `valid` tokens are
    real (module doc): the cache advances by `valid`, the padding's logits are garbage."""
    cfg = model.cfg
    start = cache["length"]
    plan = body.Plan.resolve(runtime, writes=_writes(valid))
    span = body.Span.at(start, tokens.shape[1], engram_ids=engram_ids, vl=_vl(spans))
    h, pre = body.embed(model, tokens, spans)
    h, pre, out, aux = _layers(model, h, pre, cache, span, plan, range(cfg.n_layers), collect_topk,
                               TapProbe(cfg.dspark_target_layer_ids) if taps else NO_PROBE)
    if valid is None:
        out["length"] = start + tokens.shape[1]
    else:
        out = commit(cfg, cache, aux.pop("pending"), valid)
    return body.head(model, h, pre, plan.runtime.mode)[0], out, aux


def replay_window(model, tokens: jax.Array, cache: dict, *, runtime: Runtime = Runtime(), engram_ids=None,
                  spans=None, valid=None):
    """Encoder replay (docs/REFERENCE.md §5 "Prefix-cache hit"): rerun the last T cached tokens (positions
    length-T ..) through every layer, window truncated to them, global caches read-only.
    spans: the image spans of those T positions (rows, token_types), as when they were prefilled.
    valid [B]: only the first `valid` of the T tokens are real, the last `valid` cached ones (T at most
    the window): the padding after them writes no ring slot.
    Returns (logits [B,T,V], cache) with the window rings rebuilt and the length unchanged."""
    cfg = model.cfg
    T, W = tokens.shape[1], cfg.window_size
    n = jnp.full((tokens.shape[0],), T, jnp.int32) if valid is None else valid
    start = cache["length"] - n  # callers check that the cache holds n positions (host side)
    plan = body.Plan.resolve(runtime, writes="window")
    span = body.Span.at(start, T, engram_ids=engram_ids, floor=start, vl=_vl(spans))
    h, pre = body.embed(model, tokens, spans)
    h, pre, out, _ = _layers(model, h, pre, cache, span, plan, range(cfg.n_layers))
    if valid is not None:
        if T > W:
            raise ValueError(f"a padded replay covers at most the window ({W}), got {T} tokens")
        j = (jnp.arange(W)[None] - start[:, None]) % W  # the piece index that wrote each ring slot
        padding = (j >= valid[:, None]) & (j < T)
        out["window"] = [jax.tree.map(lambda new, old: jnp.where(padding[:, :, None], old, new), ring, before)
                         for ring, before in zip(out["window"], cache["window"])]
    return body.head(model, h, pre, plan.runtime.mode)[0], out


def decode_plan(runtime: Runtime = Runtime(), packed: bool = True) -> body.Plan:
    """The engine's decode plan: in-pool scoring, selected compressed rows gathered, and (packed, fast
    mode) the packed index scoring `fast_index.scores_packed` (XLA math); the attention and the
    full-width indexer run their kernels when runtime.impl is "pallas" (exact mode: equal to the
    XLA math bit for bit, tests/serving/test_serving.py). packed=False keeps `Indexer.scores`' rounding
    points: the step then equals model.forward's bit for bit."""
    return body.Plan.resolve(runtime, pool_scoring=True, packed_scoring=packed)


def decode_step(model, tokens: jax.Array, cache: dict, plan: body.Plan, *, engram_ids=None, layers=None,
                active=None, collect_topk: bool = False, taps: bool = False):
    """The engine's decode step over a chunk continuing from cache["length"] (a `decode_plan`):
    (logits [B,T,V], cache, aux) as `exact_prefill`'s. layers: a slice of the layers (cost accounting;
    default all); active [B]: rows whose length advances by T (default all). With a "pending" plan
    (speculative verify) the cache comes back unchanged and aux["pending"] holds the chunk's writes:
    `commit(cfg, cache, aux["pending"], n)` keeps each row's first n. taps: also return DSpark's taps of
    the chunk in aux["main_hidden"] [B, T, n_targets * d] (a model with a drafter)."""
    cfg = model.cfg
    start, T = cache["length"], tokens.shape[1]
    h, pre = body.embed(model, tokens)
    span = body.Span.at(start, T, engram_ids=engram_ids)
    probe = TapProbe(cfg.dspark_target_layer_ids) if taps else NO_PROBE
    h, pre, cache, aux = _layers(model, h, pre, cache, span, plan, range(cfg.n_layers) if layers is None else layers,
                                 collect_topk, probe)
    if plan.writes != "pending":
        cache["length"] = start + T if active is None else jnp.where(active, start + T, start)
    return body.head(model, h, pre, plan.runtime.mode)[0], cache, aux


def commit(cfg, cache: dict, pending: dict, n: jax.Array) -> dict:
    """`cache` (the one a "pending" chunk started from) with each row's first n [B] positions of the
    chunk's writes applied and length = start + n: the cache a plain chunk of those n tokens leaves."""
    return body.QuantStore(cfg, cache).commit(pending, n).cache


def drop_window(cache: dict) -> dict:
    """The cache with every window ring zeroed: what a restored prefix cache starts from."""
    out = dict(cache)
    out["window"] = [jax.tree.map(jnp.zeros_like, w) for w in cache["window"]]
    return out


def _jit(fn, graphdef, **static):
    @functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS)
    def run(params, tokens, cache, engram_ids=None, **traced):  # traced: spans, where the driver takes them
        return fn(nnx.merge(graphdef, params), tokens, cache, engram_ids=engram_ids, **static, **traced)

    return run


def make_split_prefill(graphdef, runtime: Runtime = Runtime(), tail: int | None = None, collect_topk: bool = False):
    """jit (params, tokens, cache, engram_ids=None, spans=None) -> split_prefill(...)."""
    return _jit(split_prefill, graphdef, runtime=runtime, tail=tail, collect_topk=collect_topk)


def make_exact_prefill(graphdef, runtime: Runtime = Runtime(), collect_topk: bool = False):
    """jit (params, tokens, cache, engram_ids=None, spans=None) -> exact_prefill(...)."""
    return _jit(exact_prefill, graphdef, runtime=runtime, collect_topk=collect_topk)


def make_replay(graphdef, runtime: Runtime = Runtime()):
    """jit (params, tokens, cache, engram_ids=None) -> replay_window(...)."""
    return _jit(replay_window, graphdef, runtime=runtime)
