"""The optimizer: AdamW (default) or optax's Muon, warmup + cosine decay, global-norm clipping,
and per-group learning rates (docs/REFERENCE.md §7: tables and embeddings may need their own).

Groups, by parameter key:
  embed   - the token embedding;
  engram  - the Engram tables (sparse rows; typically a larger rate);
  no_decay- vectors (norm gains, sinks, mHC base/scale): no weight decay;
  default - the matrices; under `optimizer="muon"` these take Muon, the rest AdamW.
The router bias is not an optimizer parameter (see `losses.bias_update`).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import optax


@dataclass(frozen=True)
class OptimConfig:
    optimizer: str = "adamw"  # "adamw" | "muon"
    lr: float = 3e-4
    warmup_steps: int = 100
    total_steps: int = 1000
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    clip_norm: float = 1.0
    lr_embed_mult: float = 1.0
    lr_engram_mult: float = 5.0

    def __post_init__(self):
        if self.optimizer not in ("adamw", "muon"):
            raise ValueError(f"optimizer must be 'adamw' or 'muon', got {self.optimizer!r}")
        if self.lr <= 0 or self.total_steps <= 0 or self.warmup_steps < 0:
            raise ValueError(f"need lr > 0, total_steps > 0, warmup_steps >= 0; got {self.lr}, {self.total_steps}, {self.warmup_steps}")


def schedule(c: OptimConfig, mult: float = 1.0):
    """Linear warmup to lr*mult, then cosine decay to min_lr_ratio of it at total_steps."""
    peak = c.lr * mult
    warm = min(c.warmup_steps, max(c.total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(0.0, peak, warm, max(c.total_steps, warm + 1), peak * c.min_lr_ratio)


def param_group(key: str, ndim: int) -> str:
    if key == "embed":
        return "embed"
    if key.endswith("engram.embed"):
        return "engram"
    if ndim <= 1:
        return "no_decay"
    return "default"


def labels(params: dict, optimizer: str = "adamw") -> dict:
    out = {}
    for k, v in params.items():
        g = param_group(k, len(v.shape))
        out[k] = "muon" if (g == "default" and optimizer == "muon") else g
    return out


def make_optimizer(c: OptimConfig, params: dict) -> optax.GradientTransformation:
    """clip -> per-group (AdamW | Muon) with its own schedule. `params` may be abstract."""
    def adamw(mult, wd):
        return optax.adamw(schedule(c, mult), b1=c.b1, b2=c.b2, eps=c.eps, weight_decay=wd)

    groups = {
        "embed": adamw(c.lr_embed_mult, 0.0),
        "engram": adamw(c.lr_engram_mult, 0.0),
        "no_decay": adamw(1.0, 0.0),
        "default": adamw(1.0, c.weight_decay),
    }
    if c.optimizer == "muon":
        from optax.contrib import MuonDimensionNumbers, muon

        # y = x W^T with W [.., out, in]: contract over `in`; stacked experts are batch dims
        dims = MuonDimensionNumbers(reduction_axis=-1, output_axis=-2)
        groups["muon"] = muon(schedule(c), weight_decay=c.weight_decay, adam_b1=c.b1, adam_b2=c.b2,
                              muon_weight_dimension_numbers=lambda p: jax.tree.map(lambda _: dims, p))
    tx = optax.multi_transform(groups, labels(params, c.optimizer))
    return optax.chain(optax.clip_by_global_norm(c.clip_norm), tx) if c.clip_norm > 0 else tx
