"""POST /tokenize and /detokenize (vLLM's shapes): the ids the server would prefill, and back."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request as HTTPRequest

from dsv41_jax.serving.http import protocol as P
from dsv41_jax.serving.http import schema as S
from dsv41_jax.serving.http.checks import check_ids, get_bool, read_request
from dsv41_jax.serving.http.prompts import build_prompt

router = APIRouter()


@router.post("/tokenize", openapi_extra=S.route(S.TOKENIZE_REQUEST, S.TOKENIZE_RESPONSE))
async def tokenize(request: HTTPRequest):
    """`{prompt | messages, add_special_tokens}` -> `{count, max_model_len, tokens}`: the ids the server
    would prefill for that completions prompt or chat request."""
    state, body = await read_request(request, lambda body, state: P.check_tokenize_fields(body))
    add_special = get_bool(body, "add_special_tokens", True)
    split_special = get_bool(body, "split_special_tokens", False)  # checked for chat too, where it has no effect
    if ("prompt" in body) == ("messages" in body):
        raise P.bad("prompt", "send exactly one of 'prompt' (completions) and 'messages' (chat)")
    mode = P.chat_mode(body, state.cfg.effort_table)  # the chat fields are checked with a prompt too (unused there)
    if "messages" in body:
        prompt = await build_prompt(state, body["messages"], mode, run_tower=False)
    elif body["prompt"] == "":  # a harness's empty context (vLLM answers it too); completions refuse it
        return {"count": int(add_special), "max_model_len": state.cfg.max_model_len,
                "tokens": [state.tokenizer.bos_id] if add_special else []}
    else:
        prompt = await build_prompt(state, body["prompt"], add_special=add_special,
                                    split_special=split_special)
    ids = prompt.ids
    return {"count": len(ids), "max_model_len": state.cfg.max_model_len, "tokens": ids}


@router.post("/detokenize", openapi_extra=S.route(S.DETOKENIZE_REQUEST, S.DETOKENIZE_RESPONSE))
async def detokenize(request: HTTPRequest):
    """`{tokens}` -> `{prompt}`: the text of token ids, special tokens included."""
    state, body = await read_request(request, lambda body, state: P.check_detokenize_fields(body))
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(P.is_int(t) for t in tokens):
        raise P.bad("tokens", f"expected a list of token ids, got {tokens!r:.80}")
    ids = check_ids(state, "tokens", tokens)
    return {"prompt": await asyncio.to_thread(state.tokenizer.decode, ids)}
