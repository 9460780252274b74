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

from dsv41_jax.config import ModelConfig
from dsv41_jax.engram.hashing import EngramLayout
from dsv41_jax.layers.attention import Attention
from dsv41_jax.layers.basic import KeyStream, RMSNorm
from dsv41_jax.layers.engram import Engram
from dsv41_jax.layers.mhc_site import HyperSite
from dsv41_jax.layers.moe import MoE
from dsv41_jax.runtime import Runtime, compiler_options
from dsv41_jax.vision.tower import Aligner, ViT
from dsv41_jax.model import block as body
from dsv41_jax.model import stack
from dsv41_jax.model.cache import init_cache  # noqa: F401 (re-exported: the drivers' import)
from dsv41_jax.model.dspark import build_stages
from dsv41_jax.model.probe import NO_PROBE, GoldenProbe, Probes, TapProbe


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
    T = tokens.shape[1]
    start = cache["length"]
    span = body.Span.at(start, T, engram_ids=engram_ids, vl=None if spans is None else spans[1] >= 0)
    probe = GoldenProbe(collect)
    if cfg.has_dspark:
        probe = Probes(probe, TapProbe(cfg.dspark_target_layer_ids))
    probe_inputs = {**(forced or {}), "replay": replay}
    h, pre = body.embed(model, tokens, spans)
    state, rec = body.run_layers(model, body.LayerState.first(h, pre, body.QuantStore(cfg, cache)), span,
                                 body.Plan.resolve(runtime), range(cfg.n_layers), probe, probe_inputs)
    logits, final = body.head(model, state.h, state.pre, runtime.mode, probe)
    new_cache = state.store.cache
    new_cache["length"] = start + T
    # topk_own / experts_own: the model's own choices before any forced decision replaced them
    aux = {k: rec.get(k, {}) for k in ("topk", "experts", "topk_agree", "experts_agree", "topk_own", "experts_own")}
    aux["trace"] = {**rec.get("trace", {}), **final.get("trace", {})}
    if "tap" in rec:  # DSpark: the stream entering each target layer, after its Engram
        aux["main_hidden"] = TapProbe.hidden(rec)
    return logits, new_cache, aux


def stack_layers(graphdef, params, plan: body.Plan, taps: bool = False):
    """(graphdef, params) of the same model with each run of layers that `plan`'s steps scan held
    stacked (`stack.LayerStack`): made once, at load (`serving.placement`), so each step slices its
    argument instead of stacking the run's weights per call. taps: the steps tap DSpark's target
    layers (`forward` for a config with the drafter, a speculating engine's steps), which run on
    their own, so they are left out of the stacks. Pure (params in, params out); works on abstract
    params; unchanged when the plan scans nothing (`Runtime.scan_layers` off)."""
    model = nnx.merge(graphdef, params, copy=True)  # fresh Variables (the same arrays): params stay as they are
    cfg = model.cfg
    probe = TapProbe(cfg.dspark_target_layer_ids) if taps else NO_PROBE
    runs = [r for r in body.layer_runs(model, range(cfg.n_layers), plan, probe) if len(r) > 1]
    if not runs:
        return graphdef, params
    for run in runs:
        first = model.layers[run[0]]
        nnx.update(first, jax.tree.map(stack.stack_leaves, *(nnx.state(model.layers[l]) for l in run)))
        held = stack.LayerStack(first, run)
        for l in run:
            model.layers[l] = held
    return nnx.split(model)


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
    @functools.partial(jax.jit, compiler_options=compiler_options(runtime.mode))
    def step(params, tokens, cache, engram_ids=None, forced=None, replay=None, spans=None):
        model = nnx.merge(graphdef, params)
        return forward(model, tokens, cache, runtime=runtime, engram_ids=engram_ids, forced=forced,
                       collect=collect, replay=replay, spans=spans)

    return step
