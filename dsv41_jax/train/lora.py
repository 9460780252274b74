"""Low-rank adapters on the attention and expert projections, for users who cannot afford
full fine-tuning.

An adapter adds (alpha / r) * B @ A to a frozen master weight ([out, in]; stacked experts
[E, out, in] get one adapter per expert). It is merged *before* the weight's fake-quant, so
the forward sees exactly the weight that `export` quantizes: a QAT-trained LoRA survives the
export to FP8/FP4 unchanged.
"""
from __future__ import annotations

import re

import jax
import jax.numpy as jnp

# attention projections and expert (routed + shared) projections
TARGETS = re.compile(r"^layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight|ffn\.experts\.w[123]|ffn\.shared_experts\.w[123]\.weight)$")


def lora_targets(master_shapes: dict) -> list[str]:
    return sorted(k for k in master_shapes if TARGETS.match(k))


def init_lora(master_shapes: dict, rank: int, seed: int = 0) -> dict:
    """{key.lora_a: [..., r, in] ~ N(0, 1/in), key.lora_b: [..., out, r] = 0} for every target."""
    if rank <= 0:
        raise ValueError(f"LoRA rank must be positive, got {rank}")
    out = {}
    key = jax.random.key(seed)
    for i, k in enumerate(lora_targets(master_shapes)):
        shape = tuple(master_shapes[k].shape)
        *lead, n_out, n_in = shape
        a = jax.random.normal(jax.random.fold_in(key, i), (*lead, rank, n_in), jnp.float32) / jnp.sqrt(n_in)
        out[f"{k}.lora_a"] = a
        out[f"{k}.lora_b"] = jnp.zeros((*lead, n_out, rank), jnp.float32)
    return out


def apply_lora(master: dict, lora: dict, scale: float) -> dict:
    """Masters with every adapter merged in (differentiable in both)."""
    if not lora:
        return master
    out = dict(master)
    for name, a in lora.items():
        if not name.endswith(".lora_a"):
            continue
        k = name[: -len(".lora_a")]
        b = lora[k + ".lora_b"]
        out[k] = master[k] + jnp.float32(scale) * jnp.einsum("...or,...ri->...oi", b, a)
    return out
