"""The V4.1 backbone as a Flax NNX module, run functionally over an explicit cache.

`forward(model, tokens, cache, ...)` continues every sequence of the batch from its own
position (`cache["length"]`): prefill is a forward over an empty cache, chunked prefill a
forward over a partly filled one, decode a forward of one token. The cache goes in and comes
back; nothing is mutated. Cross-layer sharing (CSA2, docs/REFERENCE.md §2) is plain dataflow inside the
layer loop: KV sources write compressed entries and index keys, index sources publish top-k,
the candidate source publishes its pool.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.numerics import kv_layout
from dsv41_jax.config import ModelConfig
from dsv41_jax.layers.attention import Attention
from dsv41_jax.layers.basic import KeyStream, RMSNorm, matmul
from dsv41_jax.layers.engram import Engram
from dsv41_jax.layers.indexer import candidate_pool, index_key_container, select_topk
from dsv41_jax.layers.mhc_site import HyperSite, collapse, expand
from dsv41_jax.layers.moe import MoE
from dsv41_jax.layers.rope import cos_sin, layer_rope
from dsv41_jax.runtime import Runtime
from pallas_kernels.sparse_attention.dense_reference import sparse_attention
from dsv41_jax.model.cache import init_cache  # noqa: F401 (re-exported: the drivers' import)
from dsv41_jax.model.cache import index_keys_for, scatter_container, window_indices, write_ring
from dsv41_jax.model.dspark import build_stages, tap
from dsv41_jax.model.probe import tie_aware_equal


COMPILER_OPTIONS = {"xla_allow_excess_precision": False}


class Block(nnx.Module):
    """One layer: [Engram] -> mHC attention site -> mHC FFN site."""

    def __init__(self, cfg: ModelConfig, layer: int, engram_rows: int | None, *, rngs: nnx.Rngs):
        role = cfg.roles[layer]
        self.layer, self.role = layer, role
        self.attn = Attention(cfg, role, rngs=rngs)
        self.ffn = MoE(cfg, rngs=rngs)
        self.engram = Engram(cfg, engram_rows, rngs=rngs) if engram_rows is not None else None
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hc_attn = HyperSite(cfg, rngs=rngs)
        self.hc_ffn = HyperSite(cfg, rngs=rngs)


class Transformer(nnx.Module):
    """embed -> hc copies -> blocks -> collapse -> norm -> fp32 head."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | int = 0, engram_rows: tuple[int, ...] | None = None):
        self.cfg = cfg
        rngs = KeyStream(rngs)
        self.embed = nnx.Param((jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.dim), jnp.float32)).astype(jnp.bfloat16))
        rows = engram_rows if engram_rows is not None else engram_table_rows(cfg)
        self.layers = nnx.List([
            Block(cfg, l, rows[cfg.engram_layer_ids.index(l)] if l in cfg.engram_layer_ids else None, rngs=rngs)
            for l in range(cfg.n_layers)
        ])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nnx.Param((jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.dim), jnp.float32) * 2 / cfg.dim ** 0.5).astype(jnp.bfloat16))
        # DSpark stages (mtp.{k}.*); they share embed and head (dsv41_jax.model.dspark)
        self.mtp = build_stages(cfg, rngs)
        if cfg.vision_enabled:  # the VL path (docs/VISION.md); dsv41_jax.vision.merge builds the span rows
            from dsv41_jax.vision.tower import ViT, Aligner

            delim = lambda: nnx.Param(jax.random.normal(rngs.params(), (cfg.dim,), jnp.float32).astype(jnp.bfloat16))
            self.vision, self.aligner = ViT(cfg, rngs=rngs), Aligner(cfg, rngs=rngs)
            self.image_start, self.image_end, self.image_newline = delim(), delim(), delim()
        else:
            self.vision = self.aligner = self.image_start = self.image_end = self.image_newline = None


def engram_table_rows(cfg: ModelConfig) -> tuple[int, ...]:
    """Rows of each Engram table: from the config when given, else from the prime layout."""
    if not cfg.engram_layer_ids:
        return ()
    if cfg.engram_num_embeddings:
        return tuple(cfg.engram_num_embeddings)
    from dsv41_jax.engram.hashing import EngramLayout

    return EngramLayout.build(cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads, cfg.engram_head_dim,
                              cfg.engram_vocab_size, cfg.engram_compressed_vocab_size, cfg.engram_pad_id).num_embeddings


# -------------------------------------------------------------------------------------- forward
def forward(model: Transformer, tokens: jax.Array, cache: dict, *, runtime: Runtime = Runtime(),
            engram_ids: jax.Array | None = None, forced: dict | None = None, collect: bool = False,
            replay: dict | None = None, spans: tuple | None = None):
    """Run `tokens` [B, T] on top of `cache`. Returns (logits [B,T,V] fp32, new cache, aux).

    engram_ids: [B, T, n_engram_layers, n_cols] table rows (host int64 hashing, see
      `dsv41_jax.engram.hashing`); required when the config has Engram layers.
    forced: optional {"topk": {layer: [B,T,K]}, "experts": {layer: [B,T,k]}, "impose": bool} decisions
      compared (tie-aware) with the model's own, agreement returned in aux, then imposed when
      `impose` (a traced bool, default True) holds, so free and forced runs share one compilation.
    collect: also return per-layer intermediates in aux["trace"].
    replay: optional {layer: (stream [B,T,hc,d], pre_mix [B,T,hc])} substituted as that layer's
      input (after its Engram), to replay single layers from traced inputs.
    spans: optional (rows [B, T, dim] bf16, token_types [B, T] int) from
      `dsv41_jax.vision.merge.span_rows`: at image-span positions (type >= 0) the token
      embedding is replaced by the row before the hc expansion, the MoE selects with
      `gate.bias_vl`, and Engram leaves the stream untouched (docs/VISION.md).
    """
    cfg = model.cfg
    mode = runtime.mode
    B, T = tokens.shape
    W = cfg.window_size
    start = cache["length"]
    positions = start[:, None] + jnp.arange(T)[None]
    new_cache = {"length": start + T, "window": list(cache["window"]), "compressed": dict(cache["compressed"]),
                 "index_keys": dict(cache["index_keys"]), "compressor": dict(cache["compressor"]),
                 "published": cache["published"]}
    # topk_own / experts_own: the model's own choices before any forced decision replaced them
    aux = {"topk": {}, "experts": {}, "topk_agree": {}, "experts_agree": {}, "trace": {}, "topk_own": {}, "experts_own": {}}
    trace = aux["trace"]

    h = model.embed[...][tokens]
    in_span = None
    if spans is not None:
        in_span = spans[1] >= 0
        h = jnp.where(in_span[..., None], spans[0].astype(h.dtype), h)
    h = jnp.broadcast_to(h[:, :, None, :], (B, T, cfg.hc_mult, cfg.dim))
    pre = jnp.zeros((B, T, cfg.hc_mult), jnp.float32).at[..., 0].set(1.0)
    topk_of: dict[int, jax.Array] = {}
    pool = None
    taps = []  # DSpark: the stream entering each target layer, after its Engram

    for block in model.layers:
        l, role = block.layer, block.role
        if block.engram is not None:
            if engram_ids is None:
                raise ValueError(f"layer {l} has Engram: pass engram_ids (see dsv41_jax.engram.hashing.hash_ids)")
            h_in = h
            h, gate = block.engram(h, engram_ids[:, :, cfg.engram_layer_ids.index(l)], mode)
            if in_span is not None:  # the reference shuts the gate at image-span positions
                h = jnp.where(in_span[..., None, None], h_in, h)
                gate = jnp.where(in_span[..., None], 0.0, gate)
            if collect:
                trace[f"engram.{l}.gate"] = gate
        if replay is not None and l in replay:
            h, pre = replay[l][0].astype(h.dtype), replay[l][1].astype(jnp.float32)
        if collect:
            trace[f"layer{l}.block_input"], trace[f"layer{l}.pre_mix_in"] = h, pre
        if cfg.has_dspark and l in cfg.dspark_target_layer_ids:
            taps.append(tap(h))
        a_pre, a_post, a_comb = block.hc_attn.mixes(h, mode)
        x = block.attn_norm(collapse(h, pre), mode)
        attn = block.attn
        freqs = layer_rope(cfg, role.ratio)
        cos, sin = cos_sin(positions, freqs)
        qr, q = attn.queries(x, cos, sin, mode)
        win_new = kv_layout.quantize_window(attn.window_kv(x, cos, sin, mode))
        ring = cache["window"][l]
        keys = jnp.concatenate([kv_layout.dequantize_window(ring), kv_layout.dequantize_window(win_new)], 1)
        idx = window_indices(start, T, W)
        new_cache["window"][l] = write_ring(ring, win_new, start, W)
        win_idx, comp_kv, comp_sel = idx, None, None  # what the attention kernel reads (impl="pallas")

        if role.ratio:
            m, src = role.ratio, role.kv_source
            key = f"layer{src}"
            visible = (positions + 1) // m
            if role.is_kv_source:
                state = new_cache["compressor"].get(key)
                lat, gids, state = attn.compressor.groups(x, start, state, mode)
                if state is not None:
                    new_cache["compressor"][key] = state
                gcos, gsin = cos_sin(jnp.maximum(gids, 0) * m, freqs)
                if attn.indexer is not None:
                    k_new = kv_layout.quantize_index_keys(attn.indexer.keys(lat, gcos, gsin, mode))
                    new_cache["index_keys"][key] = scatter_container(new_cache["index_keys"][key], k_new, gids)
                    produced = jnp.any(gids >= 0, axis=1)
                    new_cache["published"] = jnp.where(produced, src, new_cache["published"])
                from dsv41_jax.layers.rope import apply_rope

                entries = kv_layout.quantize_compressed(apply_rope(lat, gcos, gsin, cfg.rope_head_dim))
                new_cache["compressed"][key] = scatter_container(new_cache["compressed"][key], entries, gids)
                if collect:
                    trace[f"layer{l}.compressor_latent"], trace[f"layer{l}.compressor_gids"] = lat, gids
                    trace[f"layer{l}.compressed_kv_entries"] = kv_layout.dequantize_compressed(new_cache["compressed"][key])
                    if attn.indexer is not None:
                        trace[f"layer{l}.index_k_entries"] = kv_layout.dequantize_index_keys(new_cache["index_keys"][key])
            if role.is_index_source:
                if runtime.kernel_mode() is not None:
                    ikeys = index_key_container(cfg, new_cache, role, runtime.index_k_quirk)
                    scores = attn.indexer.scores_pallas(x, qr, ikeys, cos, sin, visible, runtime,
                                                        pool if role.uses_candidates else None)
                else:
                    keys_bf16 = index_keys_for(cfg, new_cache, role, runtime).astype(jnp.bfloat16)
                    scores = attn.indexer.scores(x, qr, keys_bf16, cos, sin, visible, mode)
                if role.is_candidate_source:
                    pool, block_scores = candidate_pool(scores, visible, cfg.candidate_topk_blocks, cfg.candidate_block_size)
                    if collect:
                        trace[f"layer{l}.candidates"], trace["candidate_block_scores"] = pool, block_scores
                elif role.uses_candidates:
                    scores = jnp.where(pool, scores, -jnp.inf)
                sel = select_topk(scores, visible, cfg.topk_width[src])
                aux["topk_own"][l] = sel
                if forced is not None and l in forced.get("topk", {}):
                    ref = forced["topk"][l]
                    ref = jnp.pad(ref, [(0, 0), (0, 0), (0, sel.shape[-1] - ref.shape[-1])], constant_values=-1)
                    aux["topk_agree"][l] = tie_aware_equal(scores, sel, ref)
                    sel = jnp.where(forced.get("impose", True), ref.astype(jnp.int32), sel)
                topk_of[l] = sel
                if collect:
                    trace[f"layer{l}.index_score"] = scores
            sel = topk_of[role.index_source]
            aux["topk"][l] = sel
            comp_kv, comp_sel = new_cache["compressed"][key], sel
            comp = kv_layout.dequantize_compressed(new_cache["compressed"][key]).astype(keys.dtype)
            off = keys.shape[1]
            keys = jnp.concatenate([keys, comp], 1)
            idx = jnp.concatenate([idx, jnp.where(sel >= 0, sel + off, -1)], -1)

        if runtime.kernel_mode() is not None:
            o = attn.attend_pallas(q, kv_layout.concat_rows(ring, win_new), win_idx, comp_kv, comp_sel,
                                   cfg.head_dim ** -0.5, runtime)
        else:
            o = sparse_attention(q, keys.astype(q.dtype), attn.attn_sink[...], idx, cfg.head_dim ** -0.5, mode=mode,
                                 keep_nonfinite=runtime.check_finite)
        a_out = attn.output(o, cos, sin, mode)
        h = expand(a_out, h, a_post, a_comb)
        if collect:
            trace.update({f"layer{l}.after_attn": h, f"layer{l}.attn_input": x, f"layer{l}.attn_output": a_out, f"layer{l}.sparse_attn_out": o,
                          f"layer{l}.hc_attn_pre": a_pre, f"layer{l}.hc_attn_post": a_post, f"layer{l}.hc_attn_comb": a_comb})

        f_pre, f_post, f_comb = block.hc_ffn.mixes(h, mode)
        x = block.ffn_norm(collapse(h, a_pre), mode)
        forced_e = None if forced is None else forced.get("experts", {}).get(l)
        y, info = block.ffn(x, mode, forced=forced_e, impl=runtime.resolved_impl(),
                            impose=True if forced is None else forced.get("impose", True), vl_mask=in_span)
        if forced_e is not None:
            biased = info["scores"] + block.ffn.gate.selection_bias(in_span)
            own = jax.lax.top_k(biased, cfg.n_activated_experts)[1]
            aux["experts_agree"][l] = tie_aware_equal(biased, own, forced_e.astype(own.dtype))
        aux["experts_own"][l] = own if forced_e is not None else info["experts"]
        aux["experts"][l] = info["experts"]
        h = expand(y, h, f_post, f_comb)
        if collect:
            trace.update({f"layer{l}.ffn_input": x, f"layer{l}.ffn_output": y, f"layer{l}.hc_ffn_pre": f_pre,
                          f"layer{l}.hc_ffn_post": f_post, f"layer{l}.hc_ffn_comb": f_comb,
                          f"layer{l}.gate_scores": info["scores"], f"layer{l}.gate_weights": info["weights"],
                          f"layer{l}.gate_indices": info["experts"]})
        pre = f_pre

    if taps:
        aux["main_hidden"] = jnp.concatenate(taps, -1)
    final = collapse(h, pre)
    if collect:
        trace["final_hidden"] = final
    x = model.norm(final, mode)
    logits = matmul(x.astype(jnp.float32), model.head[...].astype(jnp.float32), "btd,vd->btv", jnp.float32, mode)
    return logits, new_cache, aux


# ------------------------------------------------------------------------------- host-side API
def check_inputs(cfg: ModelConfig, tokens: np.ndarray, lengths: np.ndarray) -> None:
    """Clear errors for bad input, before anything is traced."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tokens.shape}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= cfg.vocab_size):
        bad = int(tokens.min() if tokens.min() < 0 else tokens.max())
        raise ValueError(f"token id {bad} is out of range for vocab_size {cfg.vocab_size}")
    end = int(np.max(np.asarray(lengths))) + tokens.shape[1]
    if end > cfg.max_seq_len:
        raise ValueError(f"sequence would reach {end} tokens but the cache holds max_seq_len={cfg.max_seq_len}; "
                         f"build the config with a larger max_seq_len (e.g. cfg.replace(max_seq_len=...))")


def make_step(graphdef, runtime: Runtime = Runtime(), collect: bool = False):
    """A jitted pure step: (params, tokens, cache, engram_ids, forced, replay, spans) -> (logits, cache, aux)."""

    # bf16 rounding points are model semantics (they move FP8/FP4 roundings and top-k): forbid
    # XLA from keeping excess precision across them.
    @functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS)
    def step(params, tokens, cache, engram_ids=None, forced=None, replay=None, spans=None):
        model = nnx.merge(graphdef, params)
        return forward(model, tokens, cache, runtime=runtime, engram_ids=engram_ids, forced=forced,
                       collect=collect, replay=replay, spans=spans)

    return step
