"""The compressor: pools `ratio` consecutive tokens into one KV latent (docs/REFERENCE.md §3, KV sources only).

Works on a chunk of tokens that continues a sequence at per-row start positions, so prefill,
chunked prefill and single-token decode are one code path. The tokens of a group that is not
yet complete wait in an explicit state (kv and gate scores per slot) that is returned.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from dsv41_jax.layers.basic import QLinear, RMSNorm


class Compressor(nnx.Module):
    """ratio > 1: softmax-gated pooling in fp32 over each group; ratio 1: a plain bf16 projection."""

    def __init__(self, cfg, ratio: int, *, rngs: nnx.Rngs):
        self.ratio = ratio
        wdtype = jnp.float32 if ratio > 1 else jnp.bfloat16
        self.wkv = QLinear(cfg.dim, cfg.head_dim, "dense", rngs=rngs, dtype=wdtype)
        self.wgate = QLinear(cfg.dim, cfg.head_dim, "dense", rngs=rngs, dtype=wdtype, std=2 / cfg.dim ** 0.5) if ratio > 1 else None
        self.norm = RMSNorm(cfg.head_dim, cfg.norm_eps)

    def groups(self, x: jax.Array, start: jax.Array, state: dict | None, mode: str):
        """Pool the groups that complete inside this chunk.

        x: [B, T, dim] (attention input), start: [B] position of x[:, 0].
        Returns (latents [B, J, head_dim] bf16, group_ids [B, J] (-1 where the group is not
        complete), new_state, rows). Group j covers positions [g*ratio, (g+1)*ratio). rows: the
        chunk's per-position (kv, score) [B, T, head_dim] fp32 (None at ratio 1), from which
        `partial_state` rebuilds the state after any prefix of the chunk (a speculative commit).
        """
        B, T, _ = x.shape
        m = self.ratio
        if m == 1:
            lat = self.norm(self.wkv(x, mode), mode)
            return lat, start[:, None] + jnp.arange(T)[None], state, None
        xf = x.astype(jnp.float32)
        kv = self.wkv(xf, mode, out_dtype=jnp.float32)
        score = self.wgate(xf, mode, out_dtype=jnp.float32)
        J = (T + m - 1) // m + 1  # groups touched, plus one so the trailing partial group exists
        g0 = start // m
        gid = g0[:, None] + jnp.arange(J)[None]  # [B, J]
        pos = gid[:, :, None] * m + jnp.arange(m)[None, None]  # [B, J, m]
        rel = pos - start[:, None, None]
        from_state = rel < 0
        from_chunk = (rel >= 0) & (rel < T)
        ci = jnp.clip(rel, 0, T - 1)
        flat = ci.reshape(B, J * m)[..., None]
        kv_c = jnp.take_along_axis(kv, flat, axis=1).reshape(B, J, m, -1)
        sc_c = jnp.take_along_axis(score, flat, axis=1).reshape(B, J, m, -1)
        slot = pos % m
        kv_s = jnp.take_along_axis(state["kv"][:, None], slot[..., None], axis=2)
        sc_s = jnp.take_along_axis(state["score"][:, None], slot[..., None], axis=2)
        kvm = jnp.where(from_chunk[..., None], kv_c, jnp.where(from_state[..., None], kv_s, 0.0))
        scm = jnp.where(from_chunk[..., None], sc_c, jnp.where(from_state[..., None], sc_s, -jnp.inf))
        end = start + T
        complete = (gid + 1) * m <= end[:, None]
        w = jax.nn.softmax(jnp.where(complete[..., None, None], scm, 0.0), axis=2)
        pooled = jnp.sum(kvm * w, axis=2)  # fp32, as the reference pools
        lat = self.norm(pooled.astype(jnp.bfloat16), mode)
        return lat, jnp.where(complete, gid, -1), partial_state(kv, score, start, state, end, m), (kv, score)


def partial_state(kv: jax.Array, score: jax.Array, start: jax.Array, state: dict, end: jax.Array, m: int) -> dict:
    """The compressor state after the chunk's positions [start, end) (end <= start + T): the partial
    group holding position `end`, its slots from the old state (positions < start), the chunk's rows
    kv/score [B, T, D] (positions < end), else empty (0, -inf). Only selects, so any `end` gives the
    bits a chunk ending there computes."""
    T = kv.shape[1]
    pos = (end // m)[:, None] * m + jnp.arange(m)[None]  # [B, m] the group's positions
    rel = pos - start[:, None]
    from_chunk = ((rel >= 0) & (pos < end[:, None]))[..., None]
    from_state = (rel < 0)[..., None]  # the old state holds this group's earlier slots (same group as start)
    ci = jnp.clip(rel, 0, T - 1)[..., None]
    slot = (pos % m)[..., None]

    def pick(rows, old, empty):
        chunk = jnp.take_along_axis(rows, ci, axis=1)
        prior = jnp.take_along_axis(old, slot, axis=1)
        return jnp.where(from_chunk, chunk, jnp.where(from_state, prior, empty))

    return {"kv": pick(kv, state["kv"], 0.0), "score": pick(score, state["score"], -jnp.inf)}


def empty_state(batch: int, ratio: int, head_dim: int) -> dict:
    return {"kv": jnp.zeros((batch, ratio, head_dim), jnp.float32),
            "score": jnp.full((batch, ratio, head_dim), -jnp.inf, jnp.float32)}
