"""Speculative decoding inside the engine (issue 26 item 1): DSpark drafts per slot, one target
verify forward per step with pending writes, a commit of each slot's accepted prefix.

One engine step with speculation, for slots at positions L_i holding their next input g_i:
1. draft: `dspark.draft` over every slot's rings (greedy drafts d1..dK, K <= the drafter's block);
2. verify: the engine's decode step over [g_i, d1..dK] (slots that do not speculate run
   [g_i, 0, ..]: their first query sees only g_i) with `Plan.writes="pending"` and DSpark taps;
3. targets: the engine's own sampler (`sampling.sample`: penalties, logit_bias, top-k/top-p,
   temperature, the slot's seed and draw counter) at every verify position j, with the history
   counting g, d1..dj: exactly the token plain decoding would draw there if d1..dj were its tokens;
4. accept: the longest prefix of drafts equal to the targets, then the next target (the bonus);
   cut at a stop token or max_tokens (`accept`);
5. commit: `split_prefill.commit` of each slot's kept inputs (n_i = tokens emitted; 1 for a slot
   that does not speculate, 0 for an empty one), their taps into the DSpark rings, their tokens
   into the sampling history (`count`).

Acceptance by matching the target's own draw keeps plain decoding's output token for token, at
any temperature (the draws use the same keys): greedy acceptance at T = 0, and at T > 0 a valid
but less accepting rule than rejection sampling.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.model import dspark
from dsv41_jax.serving.sampling import sample


def can_speculate(req, generated: int, remaining_positions: int, k: int) -> bool:
    """Whether a slot speculates this step: the request allows it, no constrained decoding (its
    grammar advances token by token on the host), no forced tokens (tests), at least two tokens
    left to emit and room for the verify chunk."""
    return (req.speculate and req.constraint is None and not req.forced_tokens
            and req.sampling.max_tokens - generated >= 2 and remaining_positions >= k + 1)


def accept(drafts: np.ndarray, targets: np.ndarray, stop_tokens, room: int) -> tuple[list[int], int]:
    """(the tokens a slot emits, drafts accepted): targets[0], then targets[j] while
    drafts[j-1] == targets[j-1] (drafts [K], targets [K+1]), cut after a stop token and to `room`
    tokens. The count is taken before the cut (what the drafter achieved, for the metrics)."""
    out = [int(targets[0])]
    for j in range(1, len(drafts) + 1):
        if int(drafts[j - 1]) != int(targets[j - 1]):
            break
        out.append(int(targets[j]))
    accepted = len(out) - 1
    for j, t in enumerate(out):
        if t in stop_tokens:
            out = out[:j + 1]
            break
    return out[:room], accepted


def summary(stats: dict) -> dict:
    """An engine's `spec_stats` with the mean acceptance length: tokens per speculating slot-step
    ((accepted drafts + the bonus token) / slot-steps, accepted counted before any stop cut)."""
    n = stats["slot_steps"]
    return {**stats, "mean_acceptance_length": (stats["accepted"] + n) / n if n else 0.0}


def draft_fn(graphdef, mode: str, k: int):
    """(params, rings, anchor [B], newest [B]) -> greedy drafts [B, k]."""
    def run(params, rings, anchor, newest):
        ids, _, _, _ = dspark.draft(nnx.merge(graphdef, params), rings, anchor, newest, mode=mode)
        return ids[:, 1:k + 1]

    return run


def targets_fn(k: int):
    """(logits [B, k+1, V], sampling arrays, drawn [B], history, chunk [B, k+1], active, banned, masks)
    -> the sampler's token at each verify position [B, k+1] (history advanced by the chunk's tokens)."""
    def run(logits, params, drawn, history, chunk, active, banned, masks):
        out = []
        for j in range(k + 1):
            t, history = sample(logits[:, j], params, drawn + j, history, chunk[:, j], active, banned, masks)
            out.append(t)
        return jnp.stack(out, 1)

    return run


def count(history: dict, chunk: jax.Array, n: jax.Array) -> dict:
    """The sampling history with each row's first n [B] chunk tokens counted (what n plain steps count)."""
    rows = jnp.arange(chunk.shape[0])
    counts, seen = history["counts"], history["seen"]
    for j in range(chunk.shape[1]):
        on = j < n
        counts = counts.at[rows, chunk[:, j]].add(on.astype(counts.dtype))
        seen = seen.at[rows, chunk[:, j]].set(seen[rows, chunk[:, j]] | on)
    return {"counts": counts, "seen": seen}
