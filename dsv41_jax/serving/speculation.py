"""Speculative decoding inside the engine: DSpark drafts per slot, one target
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

Two acceptance rules at T > 0 (`Engine(spec_acceptance=...)`; at T = 0 both are greedy):
- "rejection" (the default: lossless at any temperature): the drafts are sampled from the drafter's processed
  distribution q (`draft_sampled_fn`) and accepted by standard rejection sampling against the
  target's processed p (`rejection_fn`). The output follows the target distribution exactly and
  accepts a draft with probability 1 - TV(p, q), but its tokens are not those plain decoding
  draws with the same seed (other random streams).
- "match": steps 3-4 above, a draft is accepted when it equals the target's own draw (same keys
  as plain decoding). The output equals plain decoding token for token at any temperature (for
  reproducing a seeded non-speculative run), and accepts only when the greedy draft happens to be
  the drawn token.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.model import dspark
from dsv41_jax.serving.sampling import draw_key, processed, sample


def can_speculate(req, generated: int, remaining_positions: int, k: int) -> bool:
    """Whether a slot speculates this step: the request allows it, no constrained decoding (its
    grammar advances token by token on the host), no forced tokens (tests), at least two tokens
    left to emit and room for the verify chunk."""
    return (req.speculate and req.constraint is None and not req.forced_tokens
            and req.sampling.max_tokens - generated >= 2 and remaining_positions >= k + 1)


def accept(drafts: np.ndarray, targets: np.ndarray, stop_tokens, room: int) -> tuple[list[int], int]:
    """The "match" rule: (the tokens a slot emits, drafts accepted): targets[0], then targets[j]
    while drafts[j-1] == targets[j-1] (drafts [K], targets [K+1]), cut after a stop token and to
    `room` tokens. The count is taken before the cut (what the drafter achieved, for the metrics)."""
    out = [int(targets[0])]
    for j in range(1, len(drafts) + 1):
        if int(drafts[j - 1]) != int(targets[j - 1]):
            break
        out.append(int(targets[j]))
    return cut(out, stop_tokens, room), len(out) - 1


def cut(tokens: list[int], stop_tokens, room: int) -> list[int]:
    """`tokens` up to and including the first stop token, at most `room` of them."""
    for j, t in enumerate(tokens):
        if t in stop_tokens:
            return tokens[:j + 1][:room]
    return tokens[:room]


def summary(stats: dict) -> dict:
    """An engine's `spec_stats` with the mean acceptance length: tokens per speculating slot-step
    ((accepted drafts + the bonus token) / slot-steps, accepted counted before any stop cut)."""
    n = stats["slot_steps"]
    return {**stats, "mean_acceptance_length": (stats["accepted"] + n) / n if n else 0.0}


def allowed_argmax(logits, banned):
    """The argmax of logits [B, V] over the ids not `banned` [V]."""
    return jnp.argmax(jnp.where(banned, -jnp.inf, logits), -1).astype(jnp.int32)


def draft_fn(graphdef, mode: str, k: int):
    """(params, rings, anchor [B], newest [B], banned [V]) -> greedy drafts [B, k]: the argmax over
    the ids the sampler may draw (a banned id could never be accepted, and one beyond the tokenizer
    has no Engram hash for the verify step)."""
    def run(params, rings, anchor, newest, banned):
        ids, _, _, _ = dspark.draft(nnx.merge(graphdef, params), rings, anchor, newest, mode=mode,
                                    choose=lambda j, lg: allowed_argmax(lg, banned))
        return ids[:, 1:k + 1]

    return run


def draft_sampled_fn(graphdef, mode: str, k: int):
    """(params, rings, anchor [B], newest [B], sampling arrays, drawn [B], history, banned, masks)
    -> (drafts [B, k], q [B, k, V]) for rejection sampling: at T > 0 draft j+1 is drawn from q_j,
    the drafter's Markov-adjusted logits processed as the target's (`sampling.processed`:
    penalties and bias with the history counting g, d1..dj, masks, temperature, top-k, top-p; key
    stream 1 at the slot's draw count + j); at T = 0 the argmax, as `draft_fn`. The Markov head
    conditions each position on the id drawn before it (`dspark.draft`'s `choose`)."""
    def run(params, rings, anchor, newest, arrays, drawn, history, banned, masks):
        carry = {"history": history, "last": anchor.astype(jnp.int32), "q": []}
        active = jnp.ones(anchor.shape, bool)

        def choose(j, lg):
            q, carry["history"] = processed(lg, arrays, carry["history"], carry["last"], active, banned, masks)
            pick = jax.vmap(lambda s, n, row: jax.random.categorical(draw_key(1, s, n), row))(
                arrays["seed"], drawn + j, jnp.log(q)).astype(jnp.int32)
            nxt = jnp.where(arrays["temperature"] > 0, pick, allowed_argmax(lg, banned))
            carry["q"].append(q)
            carry["last"] = nxt
            return nxt

        ids, _, _, _ = dspark.draft(nnx.merge(graphdef, params), rings, anchor, newest, mode=mode, choose=choose)
        return ids[:, 1:k + 1], jnp.stack(carry["q"][:k], 1)

    return run


def rejection_fn(k: int):
    """(logits [B, k+1, V], sampling arrays, drawn, history, chunk [B, k+1] = [g, d1..dk], active,
    banned, masks, q [B, k, V]) -> (tokens [B, k+1], accepted a [B]): standard speculative rejection
    sampling (Leviathan et al. 2023, arXiv 2211.17192, Algorithm 1; Chen et al. 2023, arXiv
    2302.01318) on the processed distributions. p_j = what `sample` would draw from after
    g, d1..dj (`sampling.processed`); d_{j+1} is accepted with probability min(1, p_j(d)/q_j(d))
    (u < p/q, key stream 2), up to the first rejection at a; then one token from
    normalise(max(p_a - q_a, 0)) (p_k after k acceptances; p_a where the residual is empty; key
    stream 3). tokens[:, :a] = d1..da, tokens[:, a] = that token: the emitted tokens are
    distributed exactly as plain sampling from p, one at a time."""
    def run(logits, arrays, drawn, history, chunk, active, banned, masks, q):
        ps = []
        for j in range(k + 1):
            p, history = processed(logits[:, j], arrays, history, chunk[:, j], active, banned, masks)
            ps.append(p)
        p = jnp.stack(ps, 1)
        rows = jnp.arange(chunk.shape[0])
        d = chunk[:, 1:]
        pd = jnp.take_along_axis(p[:, :k], d[..., None], -1)[..., 0]
        qd = jnp.take_along_axis(q, d[..., None], -1)[..., 0]
        u = jax.vmap(lambda s, n: jax.vmap(lambda j: jax.random.uniform(draw_key(2, s, n + j)))(jnp.arange(k)))(
            arrays["seed"], drawn)
        a = jnp.sum(jnp.cumprod((u * qd < pd).astype(jnp.int32), 1), 1)
        pa = p[rows, a]
        qa = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], 1)[rows, a]  # q_k = 0: the bonus draws from p_k
        r = jnp.maximum(pa - qa, 0.0)
        r = jnp.where(r.sum(-1, keepdims=True) > 0, r, pa)
        x = jax.vmap(lambda s, n, row: jax.random.categorical(draw_key(3, s, n), jnp.log(row)))(
            arrays["seed"], drawn + a, r).astype(jnp.int32)
        out = jnp.where(jnp.arange(k + 1)[None] < a[:, None], jnp.concatenate([d, d[:, :1]], 1), 0)
        return out.at[rows, a].set(x), a

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
