"""Tokens per second and an MFU estimate.

Model FLOPs per trained token = 6 x (active parameters a token touches, without the
embedding lookup) + 12 x layers x heads x head_dim x (attended slots: window + top-k).
The routed experts count k of E; Engram tables count only the rows looked up. Peak FLOP/s
come from a table of accelerator kinds (dense bf16) or the user; MFU is None when unknown
(e.g. on CPU).
"""
from __future__ import annotations

import jax
from dsv41_jax.model.info import model_info

# dense bf16 peak FLOP/s per chip (vendor figures)
PEAK_BF16 = {
    "tpu v4": 275e12, "tpu v5 lite": 197e12, "tpu v5e": 197e12, "tpu v5p": 459e12, "tpu v6 lite": 918e12,
    "tpu v6e": 918e12, "h100": 989e12, "h200": 989e12, "a100": 312e12, "b200": 2250e12,
}


def flops_per_token(cfg, seq_len: int) -> float:
    info = model_info(cfg)
    active = info["active_params_decode"] - cfg.dim  # the embedding row is a lookup
    slots = cfg.window_size + min(cfg.index_topk, seq_len)
    return 6.0 * active + 12.0 * cfg.n_layers * cfg.n_heads * cfg.head_dim * min(slots, seq_len)


def peak_flops(override: float | None = None) -> float | None:
    """Peak FLOP/s of all devices together, or None if the device kind is unknown."""
    if override:
        return override * jax.device_count()
    kind = jax.devices()[0].device_kind.lower()
    for name, peak in PEAK_BF16.items():
        if name in kind:
            return peak * jax.device_count()
    return None


def mfu(tokens_per_s: float, fpt: float, peak: float | None) -> float | None:
    return None if not peak else tokens_per_s * fpt / peak
