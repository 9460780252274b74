"""`dsv41 generate`'s driver: the serving engine with one slot, so generate prefills, decodes and
samples exactly as the server does (one sampler: `dsv41_jax.serving.sampling`, on device).

Prefill is exact (`Engine(exact_prefill=True)`, the whole prompt through the layer body as
`model.forward` runs it). The input-only sentinel ids (docs/REFERENCE.md §9) and ids the tokenizer
does not have are banned. Engram ids are hashed on the host from the token history
(docs/REFERENCE.md §3). The demo (`dsv41_jax.cli.demo`) samples through `generate` too.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from dsv41_jax.config import ModelConfig
from dsv41_jax.engram.hashing import EngramLayout
from dsv41_jax.engram.tokens import build_token_map
from dsv41_jax.runtime import Runtime
from dsv41_jax.serving.engine import Engine, EngineSettings, Request
from dsv41_jax.serving.sampling import SamplingParams
from dsv41_jax.text.tokenizer import sentinel_ids, Tokenizer
from sharding.serving import engine_strategies


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


def banned_ids(cfg: ModelConfig, tokenizer: Tokenizer) -> list[int]:
    """Ids never to sample: the input-only sentinels, ids the tokenizer does not have, and the image token
    (input-only; the released tokenizer lists it among the sentinels, a small test tokenizer may not)."""
    allowed = allowed_ids(cfg.vocab_size, tokenizer)
    if getattr(cfg, "vision_enabled", False) and 0 <= cfg.image_token_id < cfg.vocab_size:
        allowed[cfg.image_token_id] = False
    return [int(i) for i in np.flatnonzero(~allowed)]


def one_slot_engine(model, *, runtime: Runtime = Runtime(), banned_ids=(), engram=None, mesh=None,
                    preset: str = "inference", prefill_chunk: int = 512, speculative: int = 0,
                    engram_host: bool = False) -> Engine:
    """The engine `generate` runs on: one slot, exact prefill, the config's max_seq_len.
    engram: (layout, token map) for models with Engram layers; prefill_chunk 1 compiles a single
    prefill shape (the demo's short prompt: compile time dominates on CPU); speculative: K DSpark
    drafts per step (`serving.speculation`; the model must carry the drafter); engram_host: the
    Engram tables in host memory (`sharding.serving.HostTables`)."""
    cfg = model.cfg
    settings = EngineSettings(slots=1, max_seq_len=cfg.max_seq_len, min_capacity=min(256, cfg.max_seq_len),
                              prefill_chunk=prefill_chunk, exact_prefill=True, runtime=runtime,
                              banned_ids=tuple(banned_ids), speculative=speculative)
    return Engine(model, settings, engram=engram, **engine_strategies(mesh, preset, engram_host))


def generate(engine: Engine, prompt_ids, *, max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
             stop_tokens=(), on_token: Callable[[int], None] | None = None, spans=None) -> Generation:
    """Continue one prompt on `engine` (the server's prefill, decode step and sampler). sampling's
    max_tokens and stop_tokens are replaced by max_new_tokens (cut to the room left in the cache:
    finish "cache_full" when that cut ends the reply) and stop_tokens (finish "eos"). spans: the
    prompt's image spans (`Request.spans`)."""
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("the prompt is empty")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    room = engine.max_seq_len - len(prompt)
    if room < 1:
        raise ValueError(f"the prompt is {len(prompt)} tokens and leaves no room for a reply in the cache "
                         f"(max_seq_len={engine.max_seq_len}); shorten the prompt or pass a larger --max-seq-len")
    sp = dataclasses.replace(sampling, max_tokens=min(max_new_tokens, room), stop_tokens=tuple(stop_tokens))
    rid = engine.submit(Request(prompt, sp, on_token=None if on_token is None else (lambda tok, _lp: on_token(tok)),
                                spans=spans))
    while not engine.idle():
        engine.step()
    r = engine.done.pop(rid)
    if r.finish_reason == "error":
        raise r.exception if r.exception is not None else RuntimeError(r.error)
    reason = ("eos" if r.finish_reason == "stop" else "length" if len(r.tokens) >= max_new_tokens else "cache_full")
    return Generation(prompt_tokens=len(prompt), tokens=list(r.tokens), finish_reason=reason)


class Generator:
    """One checkpoint's one-slot engine, with the tokenizer's banned ids and Engram tables."""

    def __init__(self, cfg: ModelConfig, model, tokenizer: Tokenizer, *, runtime: Runtime = Runtime(), mesh=None,
                 preset: str = "inference", speculative: int = 0, engram_host: bool = False):
        self.cfg, self.tokenizer = cfg, tokenizer
        self.engine = one_slot_engine(model, runtime=runtime, banned_ids=banned_ids(cfg, tokenizer), mesh=mesh,
                                      preset=preset, engram=engram_tables(cfg, tokenizer) if cfg.engram_layer_ids else None,
                                      speculative=speculative, engram_host=engram_host)

    def generate(self, prompt_ids, *, max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                 on_token: Callable[[int], None] | None = None, spans=None) -> Generation:
        return generate(self.engine, prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling,
                        stop_tokens=(self.tokenizer.eos_id,), on_token=on_token, spans=spans)


def engram_tables(cfg: ModelConfig, tokenizer: Tokenizer):
    """(layout, token map) for Engram hashing; the tokenizer's map must match the config."""
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
