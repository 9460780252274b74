"""DSpark, V4.1's speculative drafter: three window-only stages over the target model's taps.

What it computes (docs/ARCHITECTURE.md "DSpark"): the mean over the hc copies of the residual
stream entering each target layer is concatenated ("taps", `main_hidden`) and projected to
`main_x` = main_norm(main_proj(taps)). Every stage keeps a ring of window keys made from `main_x`
(its own wkv / kv_norm / RoPE / FP8, exactly a backbone window cache). A draft block is
[g, noise, ..., noise] at positions i+1 ... i+block_size after the ring's newest position i; each
stage is a full mHC block (attention + MoE) whose queries see the ring and all block tokens (no
causal mask inside the block). The last stage's output goes through the shared head; a Markov
head adds a bias from the previous token, so drafts are chosen one after another; a confidence
head scores each position.

State is explicit and functional: `init_state` makes the rings, `write_rings` commits main_x rows
of positions the caller says are final (accepted), `draft` reads the rings and writes nothing.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.config import LayerRole, ModelConfig
from dsv41_jax.layers.attention import Attention
from dsv41_jax.layers.basic import QLinear, RMSNorm, matmul, weight_kind
from dsv41_jax.layers.mhc_site import HyperSite, collapse
from dsv41_jax.layers.moe import MoE
from dsv41_jax.layers.rope import cos_sin, layer_rope
from dsv41_jax.model import block as body
from dsv41_jax.model.cache import scatter_container
from dsv41_jax.model.probe import NO_PROBE, GoldenProbe, tap
from dsv41_jax.numerics import kv_layout
from dsv41_jax.runtime import Runtime


class DSparkUnavailable(ValueError):
    """Speculative decoding was asked of a model that has no DSpark drafter."""


def require_dspark(model) -> None:
    """Refuse speculative decoding clearly when the model carries no drafter."""
    cfg = model.cfg
    if getattr(model, "mtp", None) is None or not cfg.has_dspark:
        raise DSparkUnavailable(
            f"speculative decoding needs the DSpark drafter, but this model has none (n_mtp_layers={cfg.n_mtp_layers}, "
            f"dspark_block_size={cfg.dspark_block_size}); load a checkpoint that ships the mtp.* tensors, or decode "
            f"without --speculative")


def stage_role(cfg: ModelConfig, stage: int) -> LayerRole:
    """A DSpark stage's attention role: sliding window only, no compressed KV."""
    return LayerRole(layer=cfg.n_layers + stage, kind="swa", half="decoder", ratio=0, kv_source=None,
                     index_source=None, is_kv_source=False, is_index_source=False, is_candidate_source=False,
                     uses_candidates=False, has_engram=False)


class Table(nnx.Module):
    """A lookup table / projection matrix [rows, width] stored as `weight` (bf16)."""

    def __init__(self, rows: int, width: int, std: float, *, rngs):
        self.weight = nnx.Param((jax.random.normal(rngs.params(), (rows, width), jnp.float32) * std).astype(jnp.bfloat16))


class MarkovHead(nnx.Module):
    """Bias on the next draft's logits from the previous token: head(embed(token)), no norm."""

    def __init__(self, cfg: ModelConfig, *, rngs):
        r = cfg.dspark_markov_rank
        self.embed = Table(cfg.vocab_size, r, 1.0, rngs=rngs)
        self.head = Table(cfg.vocab_size, r, 1 / math.sqrt(r), rngs=rngs)

    def __call__(self, ids, mode):
        """(bias [B, V] fp32, embedding [B, r] bf16) of token ids [B]."""
        e = self.embed.weight[...][ids]
        bias = matmul(e.astype(jnp.float32), self.head.weight[...].astype(jnp.float32), "bd,vd->bv", jnp.float32, mode)
        return bias, e


class ConfidenceHead(nnx.Module):
    """One fp32 logit per block position from [stage output (un-normed), Markov embedding]."""

    def __init__(self, cfg: ModelConfig, *, rngs):
        self.proj = QLinear(cfg.dim + cfg.dspark_markov_rank, 1, "dense", rngs=rngs)

    def __call__(self, x, markov_embed, mode):
        h = jnp.concatenate([x, markov_embed.astype(x.dtype)], -1).astype(jnp.float32)
        return matmul(h, self.proj.weight[...].astype(jnp.float32), "...k,ok->...o", jnp.float32, mode)[..., 0]


class DSparkStage(nnx.Module):
    """One stage (stored as mtp.{k}.*): the backbone block of a window-only layer with its own MoE
    size; stage 0 owns the tap projection, the last stage the norm, Markov and confidence heads."""

    def __init__(self, cfg: ModelConfig, stage: int, *, rngs):
        routed, active = cfg.dspark_moe
        moe_cfg = dataclasses.replace(cfg, n_routed_experts=routed, n_activated_experts=active)
        self.stage = stage
        self.attn = Attention(cfg, stage_role(cfg, stage), rngs=rngs)
        self.ffn = MoE(moe_cfg, rngs=rngs)
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.hc_attn = HyperSite(cfg, rngs=rngs)
        self.hc_ffn = HyperSite(cfg, rngs=rngs)
        first, last = stage == 0, stage == cfg.n_mtp_layers - 1
        fan_in = cfg.dim * len(cfg.dspark_target_layer_ids)
        self.main_proj = QLinear(fan_in, cfg.dim, weight_kind(cfg), rngs=rngs) if first else None
        self.main_norm = RMSNorm(cfg.dim, cfg.norm_eps) if first else None
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps) if last else None
        self.markov_head = MarkovHead(cfg, rngs=rngs) if last else None
        self.confidence_head = ConfidenceHead(cfg, rngs=rngs) if last else None


def build_stages(cfg: ModelConfig, rngs) -> nnx.List | None:
    return nnx.List([DSparkStage(cfg, k, rngs=rngs) for k in range(cfg.n_mtp_layers)]) if cfg.has_dspark else None


def main_x(model, taps: jax.Array, mode: str) -> jax.Array:
    """main_norm(main_proj(taps)): [B, T, n_targets * d] -> [B, T, d] bf16."""
    s0 = model.mtp[0]
    return s0.main_norm(s0.main_proj(taps, mode), mode)


# ----------------------------------------------------------------------------------- state
def init_state(cfg: ModelConfig, batch: int) -> dict:
    """Each stage's window ring of main_x keys (FP8 + scales, as a backbone window cache)."""
    return {"rings": [kv_layout.empty_window(batch, cfg.window_size, cfg.head_dim) for _ in range(cfg.n_mtp_layers)]}


def _stage_keys(stage: DSparkStage, x, positions, cfg, mode) -> kv_layout.WindowKV:
    cos, sin = cos_sin(positions, layer_rope(cfg, 0))
    return kv_layout.quantize_window(body.window_rows(stage.attn, x, cos, sin, mode))


def write_rings(model, state: dict, mx: jax.Array, start: jax.Array, n_valid: jax.Array, mode: str) -> dict:
    """Commit main_x rows [B, T, d] of positions start .. start+n_valid-1 (per row) into every ring.

    Rows at or after n_valid are not written (not accepted, or padding); of the valid rows only
    the newest `window` ones are, so no slot is written twice.
    """

    cfg = model.cfg
    W, T = cfg.window_size, mx.shape[1]
    j = jnp.arange(T)[None]
    positions = start[:, None] + j
    keep = (j < n_valid[:, None]) & (j >= n_valid[:, None] - W)
    slots = jnp.where(keep, positions % W, -1)
    rings = [scatter_container(ring, _stage_keys(stage, mx, positions, cfg, mode), slots)
             for stage, ring in zip(model.mtp, state["rings"])]
    return {**state, "rings": rings}


# ----------------------------------------------------------------------------------- draft
def _block_indices(newest: jax.Array, W: int, bs: int) -> jax.Array:
    """Per row: ring slots 0 .. n-1 (n = min(W, newest+1)), the bs block tokens right after them, as the
    reference lists them (`get_dspark_topk_idxs`; exact mode's attention sums in 64-column blocks, so
    the columns matter), then -1 up to the fixed width W + bs."""
    c = jnp.arange(W + bs)[None]
    n = jnp.minimum(W, newest[:, None] + 1)
    idx = jnp.where(c < n, c, jnp.where(c < n + bs, W + c - n, -1))
    return jnp.broadcast_to(idx[:, None, :], (newest.shape[0], bs, W + bs)).astype(jnp.int32)


def _fp8_rows(rows: jax.Array) -> jax.Array:
    """Window rows at their stored FP8 values (quantize, then read back), as a ring holds them."""
    return kv_layout.dequantize_window(kv_layout.quantize_window(rows))


def stage_forward(stage: DSparkStage, h, pre, ring_rows, newest, cfg, mode, probe, probe_inputs, trace, impl,
                   fp8_rows=_fp8_rows, ring_len=None):
    """One stage over the block stream h [B, bs, hc, d]: the layer body's stage functions (a window-only
    layer) over the read-only ring rows [B, W, D] (dequantized) plus the block, every block token seeing
    the whole block. probe, probe_inputs: the FFN site's probe and its traced inputs (golden-check
    imposes stored stage experts);
    fp8_rows: how the block's own rows take their FP8 values (training passes the straight-through
    fake quantization); ring_len [B]: valid ring rows (default min(W, newest + 1));
    returns (h, pre, info, records)."""
    bs = h.shape[1]
    plan = body.Plan.resolve(Runtime(mode=mode, impl=impl))  # impl and interpret decided in one place
    positions = newest[:, None] + 1 + jnp.arange(bs)[None]
    x, _, q, cos, sin, blk, (a_pre, a_post, a_comb) = body.attn_in(stage, h, pre, positions, 0, cfg, plan)
    keys = jnp.concatenate([ring_rows, fp8_rows(blk)], 1)
    idx = _block_indices(newest if ring_len is None else ring_len - 1, ring_rows.shape[1], bs)
    o = body.attend(stage.attn, q, keys, idx, cfg, plan)
    a_out, h_attn = body.attn_out(stage.attn, o, cos, sin, h, (a_post, a_comb), plan)
    out, f_pre, (xf, y, f_post, f_comb, info), rec = body.ffn_site(stage, h_attn, a_pre, plan, probe, probe_inputs,
                                                                    stage.stage)
    if trace is not None:
        p = f"stage{stage.stage}."
        trace.update({p + "block_input": h, p + "pre_mix_in": pre, p + "hc_attn_pre": a_pre, p + "hc_attn_post": a_post,
                      p + "hc_attn_comb": a_comb, p + "attn_input": x, p + "sparse_attn_out": o, p + "attn_topk_idxs": idx,
                      p + "attn_kv": keys, p + "attn_output": a_out, p + "ffn_input": xf, p + "hc_ffn_pre": f_pre,
                      p + "hc_ffn_post": f_post, p + "hc_ffn_comb": f_comb, p + "gate_scores": info["scores"],
                      p + "gate_weights": info["weights"], p + "gate_indices": info["experts"], p + "ffn_output": y})
    return out, f_pre, info, rec


def block_stream(model, anchor: jax.Array):
    """A block's input for anchors [B]: (embeddings [B, bs, d] of [anchor, noise, ...], the stream h
    [B, bs, hc, d] (the embedding in every copy), its pre-mix [B, bs, hc] (copy 0))."""
    cfg = model.cfg
    B, bs = anchor.shape[0], cfg.dspark_block_size
    block = jnp.full((B, bs), cfg.dspark_noise_token_id, jnp.int32).at[:, 0].set(anchor.astype(jnp.int32))
    e = model.embed[...][block]
    h = jnp.broadcast_to(e[:, :, None, :], (B, bs, cfg.hc_mult, cfg.dim))
    pre = jnp.zeros((B, bs, cfg.hc_mult), jnp.float32).at[..., 0].set(1.0)
    return e, h, pre


def draft(model, state: dict, anchor: jax.Array, newest: jax.Array, *, mode: str = "exact", choose=None,
          forced: dict | None = None, collect: bool = False, impl: str = "xla"):
    """Draft one block after ring position `newest` [B], anchored on token `anchor` [B] (the token at newest+1).

    choose(j, logits [B, V]) -> ids [B] picks draft j+1 from its Markov-adjusted logits
    (default: argmax, the reference at temperature 0). forced: optional {"experts": {stage: [B,bs,k]},
    "ids": [B, bs+1], "impose": bool}: stored expert choices and draft ids (the Markov chain then
    conditions on the stored ids), compared tie-aware, imposed where `impose` holds.
    Returns (ids [B, bs+1] = [anchor, d1..], logits [B, bs, V] fp32, confidence [B, bs] fp32, aux);
    aux: per stage the experts run [B, bs, k] and the biased gate scores they were chosen on [B, bs, E]
    (golden-check's fast report compares a flipped choice with its margin), the agreement flags, traces.
    """

    cfg = model.cfg
    bs = cfg.dspark_block_size
    impose = True if forced is None else forced.get("impose", True)
    probe = NO_PROBE if forced is None else GoldenProbe()  # compares and imposes forced["experts"][stage]
    aux = {"experts": {}, "biased_scores": {}, "experts_agree": {}, "trace": {}}
    trace = aux["trace"] if collect else None
    e, h, pre = block_stream(model, anchor)
    for stage, ring in zip(model.mtp, state["rings"]):
        h, pre, _, rec = stage_forward(stage, h, pre, kv_layout.dequantize_window(ring), newest, cfg, mode, probe,
                                        forced, trace, impl)
        aux["experts"][stage.stage] = rec["experts"]
        aux["biased_scores"][stage.stage] = rec["gate_scores"] + stage.ffn.gate.selection_bias()
        if "experts_agree" in rec:
            aux["experts_agree"][stage.stage] = rec["experts_agree"]
    last = model.mtp[-1]
    x = collapse(h, pre)
    normed = last.norm(x, mode)
    base = matmul(normed.astype(jnp.float32), model.head[...].astype(jnp.float32), "btd,vd->btv", jnp.float32, mode)
    choose = choose or (lambda j, lg: jnp.argmax(lg, -1).astype(jnp.int32))
    ids = [anchor.astype(jnp.int32)]
    logits, biases, embeds = [], [], []
    for j in range(bs):
        bias, emb = last.markov_head(ids[j], mode)
        lj = base[:, j] + bias
        nxt = choose(j, lj)
        if forced is not None and "ids" in forced:
            nxt = jnp.where(impose, forced["ids"][:, j + 1].astype(jnp.int32), nxt)
        logits.append(lj), biases.append(bias), embeds.append(emb), ids.append(nxt)
    logits, markov_embed = jnp.stack(logits, 1), jnp.stack(embeds, 1)
    confidence = last.confidence_head(x, markov_embed, mode)
    if collect:
        trace.update({"final_hidden": x, "final_normed": normed, "final_pre_mix": pre, "base_logits": base,
                      "markov_bias": jnp.stack(biases, 1), "markov_embed": markov_embed, "block_tokens_embed": e})
    return jnp.stack(ids, 1), logits, confidence, aux


def survival(confidence: jax.Array) -> jax.Array:
    """Prefix-survival probability per block position: cumulative product of sigmoid(confidence)."""
    return jnp.cumprod(jax.nn.sigmoid(confidence.astype(jnp.float32)), axis=-1)


__all__ = ["DSparkStage", "DSparkUnavailable", "block_stream", "build_stages", "draft", "init_state", "main_x", "require_dspark",
           "survival", "tap", "write_rings"]
