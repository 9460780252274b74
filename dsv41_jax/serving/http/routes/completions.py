"""POST /v1/completions: a text or token-id prompt, or a list of either (each prompt's choices in
turn, as OpenAI orders them), with `echo` (the prompt, and its tokens'
logprobs with `logprobs`) and `max_tokens: 0` (score the prompt, generate nothing); without
`max_tokens` at most 16 tokens are generated (OpenAI's default; chat's is the rest of the context)."""
from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid

from fastapi import APIRouter, Request as HTTPRequest

from dsv41_jax.serving.http import protocol as P
from dsv41_jax.serving.http import schema as S
from dsv41_jax.serving.http.checks import get_bool, read_request, token_budget
from dsv41_jax.serving.http.choices import TextChoice
from dsv41_jax.serving.http.grammar import build_constraints
from dsv41_jax.serving.http.prompts import Prompt, build_prompt, prompt_batch, prompt_text
from dsv41_jax.serving.http.runs import make_runs, submit_runs
from dsv41_jax.serving.http.state import ServingState
from dsv41_jax.serving.http.streaming import DONE, event_stream, respond, sse
from dsv41_jax.serving.http.token_text import Offsets

router = APIRouter()
DEFAULT_MAX_TOKENS = 16  # a completions request without max_tokens generates this many at most (OpenAI's)


def _fields(body: dict, state: ServingState) -> None:
    P.check_fields(body, chat=False, extra=state.extra_fields)


@router.post("/v1/completions", openapi_extra=S.route(S.COMPLETION_REQUEST, S.COMPLETION_RESPONSE))
async def completions(request: HTTPRequest):
    state, body = await read_request(request, _fields)
    cfg = state.cfg
    split_special = get_bool(body, "split_special_tokens", False)
    sources = prompt_batch(body.get("prompt"))
    prompts = [await build_prompt(state, source, split_special=split_special) for source in sources]
    sp = P.sampling_fields(body, chat=False)
    echo = get_bool(body, "echo", False)
    spec = P.constraint_spec(body, chat=False)
    texts = [prompt_text(state.tokenizer, source, p.ids) if echo else None for source, p in zip(sources, prompts)]
    if sp.max_tokens == 0:  # score the prompts only (sampling_fields allows 0 with echo alone)
        for p in prompts:
            if len(p.ids) > cfg.max_model_len:
                raise P.APIError(400, f"the prompt has {len(p.ids)} tokens but the maximum model length is "
                                      f"{cfg.max_model_len}", param="prompt")
        return await _echo_only(state, request, prompts, sp, texts)
    _check_batch(state, len(prompts), len(sp.seeds))
    runs, choices = [], []
    for prompt, text in zip(prompts, texts):
        runs_of_prompt, choices_of_prompt = await _prompt_choices(state, body, prompt, sp, spec, text, len(runs))
        runs += runs_of_prompt
        choices += choices_of_prompt
    submit_runs(state, runs)
    return await respond(state, request, runs, sp, choices, runs[0].request_id, "text_completion", "text_completion")


def _check_batch(state: ServingState, prompts: int, n: int) -> None:
    """Every choice of every prompt holds a slot at once (one prompt's n is checked with its runs)."""
    slots = state.worker.engine.slots
    if prompts > 1 and prompts * n > slots:
        raise P.bad("prompt", f"{prompts} prompts x {n} choices need {prompts * n} batch slots at once; this "
                              f"server has {slots} (dsv41 serve --max-batch); send fewer prompts per request")


async def _prompt_choices(state: ServingState, body: dict, prompt: Prompt, sp: P.Sampling, spec, text: str | None,
                          first: int) -> tuple[list, list]:
    """One prompt's runs (not yet submitted) and choices, indexed from `first`."""
    cfg = state.cfg
    if sp.max_tokens is None:  # OpenAI's default for completions, within what the context has left
        sp = dataclasses.replace(sp, max_tokens=max(min(DEFAULT_MAX_TOKENS, cfg.max_model_len - len(prompt.ids)), 1))
    constraints = spec and await asyncio.to_thread(build_constraints, state, spec, None, len(sp.seeds))
    token_budget(cfg, prompt.ids, sp, "prompt")  # its 400 before any compute
    prefix = await _echo(state, prompt.ids, sp, text) if text is not None else None
    runs = make_runs(state, body, prompt, sp, None, constraints)
    return runs, [TextChoice(first + i, run, sp, prefix) for i, run in enumerate(runs)]


async def _echo(state: ServingState, ids: list[int], sp: P.Sampling, text: str) -> tuple[str, dict | None]:
    """(the prompt's text, its legacy logprobs block or None): echo's prefix of every choice. The
    block has one entry per prompt token (a text prompt's first is the BOS the server adds), the
    first with null logprobs."""
    if not sp.logprobs:
        return text, None
    lps, tops = await state.worker.call(lambda engine: engine.prompt_logprobs(list(ids)))
    shown, k = state.token_text.shown, sp.top_logprobs
    return text, {"tokens": [shown(t) for t in ids], "token_logprobs": lps,
                  "top_logprobs": [None] + [{shown(i): v for i, v in top[:k]} for top in tops[1:]],
                  "text_offset": _echo_offsets(state, ids, text)}


def _echo_offsets(state: ServingState, ids: list[int], text: str) -> list[int]:
    """Where each prompt token starts in the echoed text; the BOS the server put before a text prompt is
    not in that text and takes no characters."""
    chars, raw = Offsets(), state.token_text.raw
    added_bos = ids[:1] == [state.tokenizer.bos_id] and not text.startswith(raw(ids[0]).decode("utf-8"))
    return [chars.take(b"" if added_bos and i == 0 else raw(t)) for i, t in enumerate(ids)]


async def _echo_only(state: ServingState, request: HTTPRequest, prompts: list[Prompt], sp: P.Sampling,
                     texts: list[str]):
    """max_tokens 0: every choice is its prompt's text (and logprobs); nothing is generated."""
    n, choices, counted = len(sp.seeds), [], 0
    for k, (prompt, text) in enumerate(zip(prompts, texts)):
        text, block = await _echo(state, prompt.ids, sp, text)
        choices += [{"index": k * n + i, "text": text, "logprobs": block, "finish_reason": "length"}
                    for i in range(n)]
        counted += len(prompt.ids)
    head = {"id": f"cmpl-{uuid.uuid4().hex[:24]}", "object": "text_completion", "created": int(time.time()),
            "model": state.cfg.model_name}
    usage = {"prompt_tokens": counted, "completion_tokens": 0, "total_tokens": counted}
    state.metrics.requests.labels(request.url.path, "200").inc()
    if not sp.stream:
        return {**head, "choices": choices, "usage": usage}

    async def events():
        for c in choices:
            yield sse({**head, "choices": [c]})
        if sp.include_usage:
            yield sse({**head, "choices": [], "usage": usage})
        yield DONE

    return event_stream(events())
