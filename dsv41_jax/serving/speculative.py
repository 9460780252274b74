"""Speculative decoding with the DSpark drafter, one sequence: draft a block, verify it in one
target forward, accept, commit only what was accepted.

Per step, with L tokens committed and g the next token (sampled, not yet in the cache):
1. draft: d1..d5 = DSpark block after position L-1 anchored on g (rings hold main_x of 0..L-1);
2. verify: one target forward of [g, d1..d5] at positions L..L+5 (q = 6 queries; the forward's
   per-query windows read the ring before anything is written, so no query loses a slot a
   later one overwrites): the engine's decode step with pending writes (`Plan.writes="pending"`),
   which returns the chunk's cache writes and DSpark's taps instead of applying them;
3. accept: greedy takes the longest prefix of drafts equal to the target's argmax, plus the
   target's token after it (the bonus); at temperature T > 0, standard rejection sampling
   (`rejection_accept`) keeps the target distribution exactly;
4. commit: `split_prefill.commit` applies the writes of the accepted tokens [g, d1..da] only (their
   window slots, compressor groups and partial group, compressed / index-key rows, publication
   state: what a plain chunk of them writes), their taps go into the DSpark rings, and the Engram
   history advances by them. One target forward per step.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.model import dspark
from dsv41_jax.model.transformer import COMPILER_OPTIONS, check_inputs, init_cache, make_step
from dsv41_jax.runtime import Runtime
from dsv41_jax.serving import split_prefill as sp


# ------------------------------------------------------------------------------ acceptance rules
def greedy_accept(drafts: np.ndarray, target_ids: np.ndarray, limit: int | None = None) -> tuple[int, int]:
    """(accepted a, next token): the longest prefix of drafts [k] equal to target_ids[:k], then target_ids[a].

    target_ids [k+1]: the target's argmax after each of [g, d1..dk]. limit caps a (truncation).
    """
    k = len(drafts) if limit is None else min(limit, len(drafts))
    a = 0
    while a < k and drafts[a] == target_ids[a]:
        a += 1
    return a, int(target_ids[a])


def softmax_t(logits: np.ndarray, temperature: float) -> np.ndarray:
    z = np.asarray(logits, np.float64) / temperature
    z = z - np.max(z, -1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(-1, keepdims=True)


def rejection_accept(p: np.ndarray, q: np.ndarray, drafts: np.ndarray, rng: np.random.Generator,
                     limit: int | None = None) -> tuple[int, int]:
    """(accepted a, next token) by standard speculative rejection sampling.

    p [k+1, V]: target distributions after [g, d1..dk]; q [k, V]: the distributions the drafts were
    drawn from. Accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw
    from normalise(max(0, p_i - q_i)); after k acceptances (or at the truncation `limit`) draw the
    bonus from p. The emitted tokens are then distributed exactly as sampling p one at a time.
    """
    k = len(drafts) if limit is None else min(limit, len(drafts))
    for i in range(k):
        d = int(drafts[i])
        if rng.random() * q[i, d] < p[i, d]:  # u < p/q without dividing by a tiny q
            continue
        residual = np.maximum(p[i] - q[i], 0.0)
        total = residual.sum()
        r = residual / total if total > 0 else p[i]
        return i, int(rng.choice(p.shape[-1], p=r))
    return k, int(rng.choice(p.shape[-1], p=p[k]))


# ---------------------------------------------------------------------------------- decoding
@dataclass
class SpecResult:
    """Tokens and bookkeeping: blocks verified, drafts proposed and accepted."""

    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)
    blocks: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_block: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification step (accepted drafts + the bonus token)."""
        return (self.accepted + self.blocks) / self.blocks if self.blocks else 0.0


class SpeculativeDecoder:
    """A target model with its DSpark drafter, jitted once per shape (prompt, verify T = block + 1)."""

    def __init__(self, model, *, runtime: Runtime = Runtime(mode="exact"), engram=None):
        dspark.require_dspark(model)
        self.cfg = cfg = model.cfg
        self.graphdef, self.params = nnx.split(model)
        self.step = make_step(self.graphdef, runtime)
        self.mode = runtime.mode
        self.engram = engram  # (layout, token_map) for Engram configs
        graphdef, mode = self.graphdef, runtime.mode

        @functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS)
        def commit_rings(params, state, taps, start, n_valid):
            model = nnx.merge(graphdef, params)
            return dspark.write_rings(model, state, dspark.main_x(model, taps, mode), start, n_valid, mode)

        @functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS)
        def draft(params, state, anchor, newest, key, temperature):
            """At T > 0 each draft is drawn from softmax(Markov-adjusted logits / T), in order, as the
            reference sampler does (the next position's Markov bias uses the drawn id)."""
            model = nnx.merge(graphdef, params)

            def choose(j, lg):
                greedy = jnp.argmax(lg, -1).astype(jnp.int32)
                t = jnp.where(temperature > 0, temperature, 1.0)
                drawn = jax.random.categorical(jax.random.fold_in(key, j), lg / t, axis=-1).astype(jnp.int32)
                return jnp.where(temperature > 0, drawn, greedy)

            ids, logits, conf, _ = dspark.draft(model, state, anchor, newest, mode=mode, choose=choose)
            return ids, logits, conf

        plan = dataclasses.replace(sp.decode_plan(runtime, packed=False), writes="pending")  # = forward's numerics

        @functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS)
        def verify(params, tokens, cache, engram_ids):
            logits, _, aux = sp.decode_step(nnx.merge(graphdef, params), tokens, cache, plan, engram_ids=engram_ids,
                                            taps=True)
            return logits, aux["pending"], aux["main_hidden"]

        @functools.partial(jax.jit, compiler_options=COMPILER_OPTIONS, donate_argnums=(4,))
        def commit(params, cache, pending, taps, state, n):
            """The accepted prefix n [1] of a verified chunk: its cache writes and its DSpark ring rows."""
            model = nnx.merge(graphdef, params)
            state = dspark.write_rings(model, state, dspark.main_x(model, taps, mode), pending["start"], n, mode)
            return sp.commit(model.cfg, cache, pending, n), state

        self.commit_rings, self.draft_fn, self.verify, self.commit = commit_rings, draft, verify, commit

    def _engram_ids(self, tokens: np.ndarray, history):
        if self.engram is None:
            return None, None
        from dsv41_jax.engram.hashing import hash_ids, next_history

        layout, token_map = self.engram
        ids = hash_ids(layout, token_map, tokens, history)
        return jnp.asarray(ids.astype(np.int32)), next_history(layout, tokens, history)

    def _history(self, tokens, history):
        if self.engram is None:
            return None
        from dsv41_jax.engram.hashing import next_history

        return next_history(self.engram[0], np.asarray([tokens], np.int32), history)

    def _forward(self, tokens, cache, history):
        eids, new_history = self._engram_ids(np.asarray([tokens], np.int32), history)
        logits, new_cache, aux = self.step(self.params, jnp.asarray([tokens], jnp.int32), cache, eids)
        return np.asarray(logits[0]), new_cache, aux, new_history

    def generate(self, prompt, max_new_tokens: int, *, temperature: float = 0.0, seed: int = 0,
                 limits: Callable[[int], int] | None = None, drafter=None, allowed: np.ndarray | None = None,
                 stop_tokens=(), on_token: Callable[[int], None] | None = None) -> SpecResult:
        """Decode up to max_new_tokens after `prompt` (token ids), stopping after a stop token.

        allowed: optional bool [V] of ids the target may emit (others get probability 0, so a draft
        of one is always rejected).
        limits(block_index) caps the accepted drafts of that block (a forced acceptance schedule,
        or a uniform confidence truncation); drafter(context_ids, draft_ids, draft_logits) may
        replace the drafts (tests use drafters that follow the target).
        """
        cfg, bs = self.cfg, self.cfg.dspark_block_size
        prompt = [int(t) for t in prompt]
        check_inputs(cfg, np.asarray([prompt]), np.zeros(1, np.int32))
        rng = np.random.default_rng(seed)
        out = SpecResult(prompt_tokens=len(prompt))
        cache, history = init_cache(cfg, 1), None
        self._allowed = allowed
        logits, cache, aux, history = self._forward(prompt, cache, history)
        state = dspark.init_state(cfg, 1)
        state = self.commit_rings(self.params, state, aux["main_hidden"], jnp.asarray([0]), jnp.asarray([len(prompt)]))
        L = len(prompt)
        g = self._pick(logits[-1], temperature, rng)
        out.tokens.append(g)
        if on_token is not None:
            on_token(g)
        context = prompt + [g]
        stop = set(int(t) for t in stop_tokens)
        while len(out.tokens) < max_new_tokens and L + bs + 1 <= cfg.max_seq_len and g not in stop:
            key = jax.random.fold_in(jax.random.key(seed), out.blocks)
            ids, dlogits, _ = self.draft_fn(self.params, state, jnp.asarray([g]), jnp.asarray([L - 1]), key,
                                            jnp.float32(temperature))
            drafts, dlogits = np.asarray(ids[0, 1:]), np.asarray(dlogits[0])
            q = softmax_t(dlogits, temperature) if temperature > 0 else None
            if drafter is not None:
                drafts, q = drafter(context, drafts, dlogits)
            k = bs  # a block of bs tokens [g, noise..] proposes bs drafts, for positions L+1 .. L+bs
            chunk = [g] + [int(d) for d in drafts[:k]]
            eids, _ = self._engram_ids(np.asarray([chunk], np.int32), history)
            vlogits, pending, taps = self.verify(self.params, jnp.asarray([chunk], jnp.int32), cache, eids)
            vlogits = np.asarray(vlogits[0])
            limit = None if limits is None else limits(out.blocks)
            vlogits = self._mask(vlogits)
            if temperature > 0:
                a, nxt = rejection_accept(softmax_t(vlogits, temperature), q, drafts[:k], rng, limit)
            else:
                a, nxt = greedy_accept(drafts[:k], np.argmax(vlogits, -1), limit)
            accepted = [g] + [int(d) for d in drafts[:a]]
            cache, state = self.commit(self.params, cache, pending, taps, state, jnp.asarray([len(accepted)], jnp.int32))
            history = self._history(accepted, history)
            L += len(accepted)
            out.blocks += 1
            out.drafted += k
            out.accepted += a
            out.accepted_per_block.append(a)
            new = [int(d) for d in drafts[:a]] + [nxt]
            hit = [i for i, t in enumerate(new) if t in stop]
            new = new[: hit[0] + 1] if hit else new
            new = new[: max_new_tokens - len(out.tokens)]
            out.tokens.extend(new)
            if on_token is not None:
                for t in new:
                    on_token(t)
            context.extend(new)
            g = new[-1] if hit else nxt
        return out

    def _mask(self, logits):
        return logits if self._allowed is None else np.where(self._allowed, logits, -np.inf)

    def _pick(self, row, temperature, rng) -> int:
        row = self._mask(row)
        if temperature == 0:
            return int(np.argmax(row))
        return int(rng.choice(row.shape[-1], p=softmax_t(row, temperature)))
