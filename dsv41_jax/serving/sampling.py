"""Per-request sampling on device: greedy, temperature, top-k, top-p, seeded, with banned ids.

Every slot of a batch carries its own parameters, so one compiled sampler serves a mixed batch.
The random key of a draw depends only on the request's seed and how many tokens it has drawn,
so a request samples the same tokens alone or in any batch, in any slot.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1 switch those filters off.
    docs/REFERENCE.md §9 recommends temperature 1.0, top_p 0.95 for the released model."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    max_tokens: int = 64
    stop_tokens: tuple[int, ...] = ()

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        object.__setattr__(self, "stop_tokens", tuple(int(t) for t in self.stop_tokens))


def banned_mask(vocab_size: int, banned_ids) -> np.ndarray:
    """Boolean [V] mask of ids never to sample (e.g. `dsv41_jax.text.tokenizer.sentinel_ids`)."""
    mask = np.zeros((vocab_size,), bool)
    ids = np.asarray(list(banned_ids), np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"banned id {int(ids.max() if ids.max() >= vocab_size else ids.min())} is outside the vocabulary "
                         f"[0, {vocab_size})")
    mask[ids] = True
    return mask


def slot_arrays(params: list[SamplingParams | None]) -> dict[str, np.ndarray]:
    """Per-slot parameter arrays for `sample` (empty slots sample greedily, results unused)."""
    p = [sp or SamplingParams() for sp in params]
    return {"temperature": np.array([s.temperature for s in p], np.float32),
            "top_p": np.array([s.top_p for s in p], np.float32),
            "top_k": np.array([s.top_k for s in p], np.int32),
            "seed": np.array([s.seed for s in p], np.uint32)}


@jax.jit
def sample(logits: jax.Array, temperature, top_p, top_k, seed, drawn, banned) -> jax.Array:
    """Next token per row of logits [B, V] (fp32). drawn [B]: tokens this request drew so far."""
    logits = jnp.where(banned[None], -jnp.inf, logits.astype(jnp.float32))
    greedy = jnp.argmax(logits, -1).astype(jnp.int32)
    t = jnp.where(temperature > 0, temperature, 1.0)
    z = logits / t[:, None]
    order = jnp.argsort(-z, axis=-1, stable=True)
    zs = jnp.take_along_axis(z, order, -1)
    rank = jnp.arange(z.shape[-1])[None]
    zs = jnp.where((top_k[:, None] > 0) & (rank >= top_k[:, None]), -jnp.inf, zs)
    probs = jax.nn.softmax(zs, -1)
    before = jnp.cumsum(probs, -1) - probs  # mass strictly above this token
    zs = jnp.where((before < top_p[:, None]) | (rank == 0), zs, -jnp.inf)

    def draw(s, n, row):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), s), n)
        return jax.random.categorical(key, row)

    pick = jax.vmap(draw)(seed, drawn, zs)
    sampled = jnp.take_along_axis(order, pick[:, None], -1)[:, 0].astype(jnp.int32)
    return jnp.where(temperature > 0, sampled, greedy)
