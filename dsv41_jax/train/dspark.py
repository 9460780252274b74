"""Training the DSpark drafter (`dsv41 train --dspark`): the backbone frozen, the mtp.* stages trained
on the target's own hidden states and distributions.

Source: DeepSeek's DeepSpec repository (github.com/deepseek-ai/DeepSpec; paper arXiv 2606.19348):
`deepspec/modeling/dspark/common.py` (anchor sampling, eval mask), `deepspec/modeling/dspark/qwen3/modeling.py`
(the training forward: one block per anchor, teacher-forced Markov ids, target logits aligned to the
block), `deepspec/modeling/dspark/loss.py` (the losses) and `deepspec/trainer/dspark_trainer.py`
(online mode: the target's taps recomputed every step). Reimplemented here, not copied:

  * per row, `anchors` positions a are drawn uniformly among those whose first label (token a+1) is
    supervised; a block [token a, noise, ...] at positions a .. a+bs-1 sees the target's main_x rows
    of the W positions before a in its own document (the ring a serving drafter holds when token a is
    the anchor) and predicts tokens a+1 .. a+bs;
  * eval mask: a label counts while it is inside the row, in the anchor's document and supervised,
    and only as a contiguous prefix (cumulative product), like DeepSpec's `build_eval_mask`;
  * loss weights: the eval mask times exp(-j / gamma) at block position j (gamma > 0: positional decay);
  * losses, each a weighted mean over the weights: cross-entropy of the draft logits (Markov bias on
    the true previous token) on the labels; the L1 distance sum_v |p_draft - p_target| with p_target
    the target's softmax at the aligned position a+j; BCE-with-logits of the confidence head against
    the per-position acceptance rate 1 - L1/2 (clamped to [0, 1], no gradient into the target);
    total = ce_weight * CE + l1_weight * L1 + confidence_weight * BCE (DeepSpec's default config:
    0.1, 0.9, 1.0, gamma 4);
  * metric tau = 1 + sum_j prod_{i<=j} accept_i over valid blocks: the expected acceptance length
    under those per-position acceptance rates (DeepSpec's "tau_probabilistic").
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from dsv41_jax.layers.mhc_site import collapse
from dsv41_jax.layers.rope import cos_sin, layer_rope
from dsv41_jax.model import block as body, dspark
from dsv41_jax.model.probe import NO_PROBE
from dsv41_jax.numerics import quant
from dsv41_jax.train import losses

sg = jax.lax.stop_gradient


@dataclass(frozen=True)
class DSparkLoss:
    """The drafter objective's weights (DeepSpec's dspark config defaults)."""

    anchors: int = 16  # blocks per row and step
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    confidence_weight: float = 1.0
    decay_gamma: float = 4.0  # 0: no positional decay

    def __post_init__(self):
        if self.anchors < 1:
            raise ValueError(f"dspark anchors must be >= 1, got {self.anchors}")
        if min(self.ce_weight, self.l1_weight, self.confidence_weight, self.decay_gamma) < 0:
            raise ValueError(f"dspark loss weights and decay gamma must be >= 0, got {self}")


def is_drafter_key(key: str) -> bool:
    """A master key of the drafter's stages (stored as mtp.{k}.*)."""
    return key.startswith("mtp.")


# ------------------------------------------------------------------------------------- losses
def _bce_with_logits(x, z):
    """Binary cross-entropy of logit x against probability z (the stable form)."""
    return jnp.maximum(x, 0.0) - x * z + jnp.log1p(jnp.exp(-jnp.abs(x)))


def loss_weights(eval_mask: jax.Array, decay_gamma: float) -> jax.Array:
    """eval_mask [..., bs] as float, times exp(-j / gamma) when gamma > 0."""
    w = eval_mask.astype(jnp.float32)
    if decay_gamma > 0:
        w = w * jnp.exp(-jnp.arange(w.shape[-1], dtype=jnp.float32) / jnp.float32(decay_gamma))
    return w


def dspark_losses(draft_logits, target_logits, labels, eval_mask, confidence, keep, obj: DSparkLoss):
    """(total, metrics) of one batch of blocks.

    draft_logits, target_logits [N, bs, V] fp32 (target: the frozen model at the aligned positions);
    labels [N, bs] int; eval_mask [N, bs] bool; confidence [N, bs] fp32 logits; keep [N] bool (real blocks).
    """
    w = loss_weights(eval_mask, obj.decay_gamma)
    den = jnp.sum(w) + 1e-6  # DeepSpec's denominator guard
    logp = jax.nn.log_softmax(draft_logits, -1)
    ce = jnp.sum(-jnp.take_along_axis(logp, labels[..., None], -1)[..., 0] * w) / den
    l1_tok = jnp.sum(jnp.abs(jnp.exp(logp) - jax.nn.softmax(sg(target_logits), -1)), -1)
    l1 = jnp.sum(l1_tok * w) / den
    accept = jnp.clip(1.0 - 0.5 * l1_tok, 0.0, 1.0)
    bce = jnp.sum(_bce_with_logits(confidence, sg(accept)) * w) / den
    total = obj.ce_weight * ce + obj.l1_weight * l1 + obj.confidence_weight * bce
    valid = eval_mask.astype(jnp.float32)
    blocks = (keep & jnp.any(eval_mask, -1)).astype(jnp.float32)
    tau = 1.0 + jnp.sum(jnp.cumprod(sg(accept) * valid, -1), -1)
    metrics = {"loss": total, "ce": ce, "l1": l1, "confidence_bce": bce,
               "tau": jnp.sum(tau * blocks) / jnp.maximum(jnp.sum(blocks), 1.0),
               "accept_rate": jnp.sum(sg(accept) * valid) / jnp.maximum(jnp.sum(valid), 1.0),
               "tokens": jnp.sum(valid)}
    return total, metrics


# --------------------------------------------------------------------------------- sampling
def sample_anchors(rng, loss_mask: jax.Array, n: int):
    """(anchors [B, n] int32 sorted, keep [B, n] bool): n distinct positions a per row drawn uniformly
    among those with a supervised first label (loss_mask[a], the mask of token a+1); rows with fewer
    candidates keep only theirs (the rest point at 0 and are masked)."""
    B, T = loss_mask.shape
    cand = loss_mask > 0
    r = jnp.where(cand, jax.random.uniform(rng, (B, T)), 2.0)
    order = jnp.argsort(r, axis=-1)[:, :n] if n <= T else jnp.argsort(r, axis=-1)
    picked = jnp.take_along_axis(cand, order, -1)
    anchors = jnp.sort(jnp.where(picked, order, T), -1)  # unpicked sort last
    keep = anchors < T
    if anchors.shape[1] < n:
        pad = n - anchors.shape[1]
        anchors = jnp.pad(anchors, ((0, 0), (0, pad)), constant_values=T)
        keep = jnp.pad(keep, ((0, 0), (0, pad)))
    return jnp.where(keep, anchors, 0).astype(jnp.int32), keep


def block_targets(batch: dict, anchors: jax.Array, keep: jax.Array, bs: int):
    """(labels [B, A, bs], aligned target positions [B, A, bs], eval_mask [B, A, bs]).

    Slot j of anchor a predicts token a+1+j (batch["targets"][a+j]), against the target's
    distribution at position a+j; it counts while a+j is in the row and the anchor's document and
    supervised, as a contiguous prefix."""
    T = batch["tokens"].shape[1]
    idx = anchors[..., None] + jnp.arange(bs)  # [B, A, bs]
    inside = idx < T
    safe = jnp.minimum(idx, T - 1)
    take = lambda a: jax.vmap(lambda row, i: row[i])(a, safe)
    same_doc = take(batch["positions"]) == take(batch["positions"])[..., :1] + jnp.arange(bs)
    ok = inside & same_doc & (take(batch["loss_mask"]) > 0) & keep[..., None]
    eval_mask = jnp.cumprod(ok.astype(jnp.int32), -1).astype(bool)
    return take(batch["targets"]), safe, eval_mask


# ----------------------------------------------------------------------------------- forward
def block_forward(model, mx: jax.Array, batch: dict, anchors: jax.Array, prev_ids: jax.Array, mode: str = "fast"):
    """The drafter over one block per anchor, teacher-forced: (logits [N, bs, V] fp32 with the Markov
    bias of the true previous tokens prev_ids [B, A, bs], confidence [N, bs], MoE records per stage).

    mx [B, T, d]: main_x of the target's taps over the rows. A block's ring is the (at most W) rows
    before its anchor in the anchor's document, at their straight-through FP8 values; RoPE
    positions are document-relative, as a serving drafter sees its one sequence."""
    cfg = model.cfg
    W, bs = cfg.window_size, cfg.dspark_block_size
    B, A = anchors.shape
    N = B * A
    positions = batch["positions"]
    pos_a = jnp.take_along_axis(positions, anchors, 1)  # the anchor's position in its document
    n_ring = jnp.minimum(W, pos_a)
    s = jnp.arange(W)
    ridx = jnp.where(s < n_ring[..., None], anchors[..., None] - n_ring[..., None] + s, 0)  # [B, A, W]
    anchor_ids = jnp.take_along_axis(batch["tokens"], anchors, 1).reshape(N)
    _, h, pre = dspark.block_stream(model, anchor_ids)
    cos, sin = cos_sin(positions, layer_rope(cfg, 0))
    fake = lambda r: quant.fake_fp8_act(r, 32)
    records = {}
    for stage in model.mtp:
        rows = fake(body.window_rows(stage.attn, mx, cos, sin, mode))  # [B, T, D]
        ring = jax.vmap(lambda r, i: r[i])(rows, ridx).reshape(N, W, -1)
        h, pre, _, rec = dspark.stage_forward(stage, h, pre, ring, pos_a.reshape(N) - 1, cfg, mode, NO_PROBE, None,
                                               None, "xla", fp8_rows=fake, ring_len=n_ring.reshape(N))
        records[stage.stage] = rec
    last = model.mtp[-1]
    x = collapse(h, pre)
    base = jnp.einsum("ntd,vd->ntv", last.norm(x, mode).astype(jnp.float32), model.head[...].astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)
    prev = prev_ids.reshape(N * bs)
    bias, emb = last.markov_head(prev, mode)
    logits = base + bias.reshape(N, bs, -1)
    confidence = last.confidence_head(x, emb.reshape(N, bs, -1), mode)
    return logits, confidence, records


def drafter_loss(model, batch: dict, taps: jax.Array, target_logits: jax.Array, rng, obj: DSparkLoss,
                 mode: str = "fast"):
    """(total, (metrics, expert loads per stage)) of the drafter on one batch; taps [B, T, n*d] and
    target_logits [B, T, V] come from the frozen backbone's forward over the same rows."""
    cfg = model.cfg
    bs = cfg.dspark_block_size
    anchors, keep = sample_anchors(rng, batch["loss_mask"], obj.anchors)
    labels, aligned, eval_mask = block_targets(batch, anchors, keep, bs)
    anchor_ids = jnp.take_along_axis(batch["tokens"], anchors, 1)
    prev_ids = jnp.concatenate([anchor_ids[..., None], labels[..., :-1]], -1)  # DeepSpec: [anchor, labels[:-1]]
    mx = dspark.main_x(model, sg(taps), mode)
    logits, confidence, records = block_forward(model, mx, batch, anchors, prev_ids, mode)
    tl = jax.vmap(lambda row, i: row[i])(sg(target_logits), aligned)  # [B, A, bs, V]
    N = anchors.size
    total, metrics = dspark_losses(logits, tl.reshape(N, bs, -1), labels.reshape(N, bs), eval_mask.reshape(N, bs),
                                   confidence, keep.reshape(N), obj)

    E = cfg.dspark_moe[0]
    valid = jnp.broadcast_to(keep.reshape(N, 1), (N, bs))
    loads = {k: losses.expert_load(rec["experts"], valid, E) for k, rec in records.items()}
    metrics["load_imbalance"] = jnp.mean(jnp.stack([losses.load_imbalance(v) for v in loads.values()]))
    return total, (metrics, loads)


__all__ = ["DSparkLoss", "block_forward", "block_targets", "drafter_loss", "dspark_losses", "is_drafter_key",
           "loss_weights", "sample_anchors"]
