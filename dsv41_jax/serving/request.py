"""What a client gives the engine (`Request`), what it gets back (`Result`), and the checks a
request passes before any compute (`check_request`: bad input is refused at submit, naming the value)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from dsv41_jax.serving.sampling import SamplingParams


@dataclass
class Request:
    """A prompt to continue. With `resume_from`, the prompt continues the tokens stored in that
    prefix-cache file; with `save_to`, the sequence's global cache is stored when it finishes.

    `on_token(token, logprobs)` is called with every token as it is generated (for streaming);
    `logprobs` is the log-softmax row [V] (numpy float32, banned ids at -inf) when
    `want_logprobs`, else None. `forced_tokens` (tests only) replaces the first sampled tokens
    by these ids; the model still runs on them, so the engine's path is the production one.
    `constraint` (host side, e.g. `dsv41_jax.serving.constraints.Constraint`) limits what may be
    sampled: before each draw `constraint.fill(row)` writes the allowed ids into a packed int32
    row of `sampling.mask_words(V)` words (all ones on entry), and every kept token is passed to
    `constraint.advance(token)`. A row left all zero (the grammar cannot go on) allows only the
    stop tokens, so the reply ends.
    `spans` = (rows [len(prompt), dim], token_types [len(prompt)]) are the prompt's image spans
    (`dsv41_jax.vision.merge.span_rows`; type >= 0 inside a span), as `model.forward` takes them.
    With `resume_from`, `history_spans` are those of the stored tokens (the replayed window reads
    the rows of its image positions), and `match_key` (one int per stored-and-prompt token, image
    positions keyed by their pixels) is saved with `save_to`'s cache for conversation matching."""

    prompt: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    request_id: str | None = None
    resume_from: str | None = None
    save_to: str | None = None
    on_token: Callable | None = None
    want_logprobs: bool = False
    forced_tokens: tuple[int, ...] = ()
    spans: tuple | None = None
    constraint: object | None = None
    speculate: bool = True  # on an engine with speculation: False decodes this request token by token
    history_spans: tuple | None = None
    match_key: list[int] | None = None


@dataclass
class Result:
    """What came out: generated tokens, why it stopped, and timings in seconds."""

    request_id: str
    tokens: list[int]
    finish_reason: str  # "stop" (a stop token, included), "length" (max_tokens) or "error" (see `error`)
    prompt_tokens: int
    cached_tokens: int  # tokens restored from a prefix cache
    timing: dict
    error: str | None = None  # why this request failed alone (finish_reason "error")
    exception: BaseException | None = None  # and the exception that said so (its type tells a caller what failed)


def check_request(req: Request, cached: int, cfg, max_seq_len: int) -> None:
    """Refuse a request this engine cannot serve: `cached` tokens come from its stored conversation,
    `max_seq_len` is the engine's limit per sequence."""
    prompt = np.asarray(req.prompt, np.int64)
    if prompt.ndim != 1:
        raise ValueError(f"prompt must be a flat list of token ids, got shape {prompt.shape}")
    if prompt.size and (prompt.min() < 0 or prompt.max() >= cfg.vocab_size):
        bad = int(prompt.min() if prompt.min() < 0 else prompt.max())
        raise ValueError(f"token id {bad} is out of range for vocab_size {cfg.vocab_size}")
    if cached + prompt.size == 0:
        raise ValueError("empty prompt: give at least one token (e.g. BOS)")
    if req.spans is not None:
        rows, types = np.asarray(req.spans[0]), np.asarray(req.spans[1])
        if types.shape != prompt.shape or rows.shape != prompt.shape + (cfg.dim,):
            raise ValueError(f"spans must be (rows [{prompt.size}, {cfg.dim}], token_types [{prompt.size}]) for this "
                             f"prompt, got rows {rows.shape} and token_types {types.shape} "
                             "(dsv41_jax.vision.merge.span_rows builds them)")
        if not cfg.vision_enabled:
            raise ValueError("this model has no vision tower (gate.bias_vl): a request with image spans needs a VL "
                             "checkpoint")
    if req.history_spans is not None:
        rows, types = np.asarray(req.history_spans[0]), np.asarray(req.history_spans[1])
        if types.shape != (cached,) or rows.shape != (cached, cfg.dim):
            raise ValueError(f"history_spans must be (rows [{cached}, {cfg.dim}], token_types [{cached}]) for the "
                             f"{cached} stored tokens, got rows {rows.shape} and token_types {types.shape}")
    wrong = [t for t, _ in req.sampling.logit_bias if t >= cfg.vocab_size]
    if wrong:
        raise ValueError(f"logit_bias names token id {wrong[0]}, outside the vocabulary [0, {cfg.vocab_size})")
    total = cached + prompt.size + req.sampling.max_tokens
    if total > max_seq_len:
        raise ValueError(f"request needs {total} positions (cached {cached} + prompt {prompt.size} + max_tokens "
                         f"{req.sampling.max_tokens}) but the engine's max_seq_len is {max_seq_len}")
