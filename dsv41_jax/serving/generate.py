"""A small sampler for `dsv41 generate`: prefill the prompt, then decode one token per step.

It is deliberately minimal (batch 1, host-side sampling) until the serving engine owns
sampling. Greedy at temperature 0, otherwise temperature + top-p with a seeded numpy
generator. The input-only sentinel ids (docs/REFERENCE.md §9) and ids the tokenizer does not have are
never sampled. Engram ids are hashed on the host from the token history (docs/REFERENCE.md §3).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.config import ModelConfig
from dsv41_jax.model.transformer import check_inputs, init_cache, make_step
from dsv41_jax.runtime import Runtime
from dsv41_jax.text.tokenizer import Tokenizer, sentinel_ids


@dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy; top_p in (0, 1] keeps the smallest set of tokens reaching that mass."""

    temperature: float = 1.0
    top_p: float = 0.95
    seed: int = 0

    def __post_init__(self):
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Generation:
    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""  # "eos", "length" (max_new_tokens) or "cache_full" (max_seq_len)


def allowed_ids(vocab_size: int, tokenizer: Tokenizer) -> np.ndarray:
    """bool [vocab_size]: ids the sampler may pick (known to the tokenizer, not a sentinel)."""
    ids = np.fromiter(tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True).values(), np.int64)
    if ids.size and ids.max() >= vocab_size:
        raise ValueError(f"{tokenizer.path} has token ids up to {int(ids.max())} but the model's vocab_size is {vocab_size}; "
                         "the tokenizer does not belong to this checkpoint")
    mask = np.zeros(vocab_size, bool)
    mask[ids] = True
    mask[list(sentinel_ids(tokenizer))] = False
    return mask


def sample(logits: np.ndarray, allowed: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> int:
    """One token id from a logits row [V] (host float)."""
    z = np.where(allowed, np.asarray(logits, np.float64), -np.inf)
    if not np.any(np.isfinite(z)):
        raise FloatingPointError("every allowed logit is -inf or NaN; the model produced no usable distribution")
    if sampling.temperature == 0:
        return int(np.argmax(np.where(np.isnan(z), -np.inf, z)))
    z = z / sampling.temperature
    p = np.exp(z - np.max(z[np.isfinite(z)]))
    p = np.where(np.isfinite(p), p, 0.0)
    order = np.argsort(-p, kind="stable")
    mass = np.cumsum(p[order]) / p.sum()
    keep = order[: int(np.searchsorted(mass, sampling.top_p)) + 1]  # the smallest prefix reaching top_p
    q = p[keep] / p[keep].sum()
    return int(keep[rng.choice(len(keep), p=q)])


def _check_finite_logits(row: np.ndarray, position: int) -> None:
    """The runtime guard's host half (`Runtime.check_finite`): one logits row, already on the host."""
    nan, inf = int(np.isnan(row).sum()), int(np.isinf(row).sum())
    if nan or inf:
        raise FloatingPointError(f"non-finite logits for position {position} ({nan} NaN, {inf} inf of {row.size}): "
                                 "the weights or activations hold NaN/inf; load with the value check on (the default) "
                                 "to find the tensor")


class Generator:
    """Holds the split model, its jitted step and the host-side tables for one checkpoint."""

    def __init__(self, cfg: ModelConfig, model: nnx.Module, tokenizer: Tokenizer, *, runtime: Runtime = Runtime()):
        self.cfg, self.tokenizer = cfg, tokenizer
        graphdef, self.params = nnx.split(model)
        self.step = make_step(graphdef, runtime)
        self.check_finite = runtime.check_finite
        self.allowed = allowed_ids(cfg.vocab_size, tokenizer)
        self.engram = _engram_tables(cfg, tokenizer) if cfg.engram_layer_ids else None

    def _engram_ids(self, tokens: np.ndarray, history):
        if self.engram is None:
            return None, None
        from dsv41_jax.engram.hashing import hash_ids, next_history

        layout, token_map = self.engram
        ids = hash_ids(layout, token_map, tokens, history)
        return jnp.asarray(ids.astype(np.int32)), next_history(layout, tokens, history)

    def generate(self, prompt_ids, *, max_new_tokens: int, sampling: Sampling = Sampling(),
                 on_token: Callable[[int], None] | None = None) -> Generation:
        cfg = self.cfg
        tokens = np.asarray([list(prompt_ids)], np.int32)
        if tokens.shape[1] == 0:
            raise ValueError("the prompt is empty")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        check_inputs(cfg, tokens, np.zeros(1, np.int32))
        out = Generation(prompt_tokens=tokens.shape[1])
        rng = np.random.default_rng(sampling.seed)
        cache = init_cache(cfg, 1)
        engram_ids, history = self._engram_ids(tokens, None)
        logits, cache, _ = self.step(self.params, jnp.asarray(tokens), cache, engram_ids)
        position = tokens.shape[1]
        while True:
            row = np.asarray(logits[0, -1])
            if self.check_finite:
                _check_finite_logits(row, position)
            tok = sample(row, self.allowed, sampling, rng)
            out.tokens.append(tok)
            if on_token is not None:
                on_token(tok)
            if tok == self.tokenizer.eos_id:
                out.finish_reason = "eos"
                break
            if len(out.tokens) >= max_new_tokens:
                out.finish_reason = "length"
                break
            if position >= cfg.max_seq_len:
                out.finish_reason = "cache_full"
                break
            step_tokens = np.asarray([[tok]], np.int32)
            engram_ids, history = self._engram_ids(step_tokens, history)
            logits, cache, _ = self.step(self.params, jnp.asarray(step_tokens), cache, engram_ids)
            position += 1
        return out


def _engram_tables(cfg: ModelConfig, tokenizer: Tokenizer):
    """(layout, token map) for Engram hashing; the tokenizer's map must match the config."""
    from dsv41_jax.engram.hashing import EngramLayout
    from dsv41_jax.engram.tokens import build_token_map

    layout = EngramLayout.build(cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads, cfg.engram_head_dim,
                                cfg.engram_vocab_size, cfg.engram_compressed_vocab_size, cfg.engram_pad_id)
    if cfg.engram_num_embeddings:
        layout.check_num_embeddings(cfg.engram_num_embeddings)
    token_map, compressed = build_token_map(tokenizer)
    if compressed != cfg.engram_compressed_vocab_size:
        raise ValueError(f"{tokenizer.path} normalises to {compressed} Engram token classes but the config says "
                         f"engram_compressed_vocab_size={cfg.engram_compressed_vocab_size}; the tokenizer does not belong "
                         "to this checkpoint (the Engram hashes would address the wrong rows)")
    return layout, token_map


class TextStream:
    """Turns generated ids into the newly decoded text, holding back incomplete UTF-8 pieces."""

    def __init__(self, tokenizer: Tokenizer, skip_ids=()):
        self.tokenizer, self.skip = tokenizer, set(skip_ids)
        self.ids: list[int] = []
        self.text = ""

    def push(self, tok: int) -> str:
        if tok in self.skip:
            return ""
        self.ids.append(tok)
        full = self.tokenizer.decode(self.ids)
        if full.endswith("\ufffd"):  # a multi-byte character is not complete yet
            return ""
        new = full[len(self.text):] if full.startswith(self.text) else self.tokenizer.decode([tok])
        self.text = full
        return new
