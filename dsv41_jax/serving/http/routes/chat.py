"""POST /v1/chat/completions: messages rendered by DeepSeek's encoder (images through the vision
tower), replies split into reasoning, content and tool calls (`choices.ChatChoice`)."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request as HTTPRequest

from dsv41_jax.serving.http import protocol as P
from dsv41_jax.serving.http import schema as S
from dsv41_jax.serving.http.checks import read_request, refuse_images
from dsv41_jax.serving.http.choices import ChatChoice
from dsv41_jax.serving.http.grammar import build_constraints, check_call_budget
from dsv41_jax.serving.http.prompts import build_prompt
from dsv41_jax.serving.http.runs import start_runs
from dsv41_jax.serving.http.state import ServingState
from dsv41_jax.serving.http.streaming import respond

router = APIRouter()


def _fields(body: dict, state: ServingState) -> None:
    P.check_fields(body, chat=True, extra=state.extra_fields)


@router.post("/v1/chat/completions", openapi_extra=S.route(S.CHAT_REQUEST, S.CHAT_RESPONSE))
async def chat(request: HTTPRequest):
    state, body = await read_request(request, _fields)
    messages = body.get("messages")
    refuse_images(state, messages)
    mode = P.chat_mode(body, state.cfg.effort_table)
    sp = P.sampling_fields(body, chat=True)
    spec = P.constraint_spec(body, chat=True)
    if spec:
        await asyncio.to_thread(check_call_budget, state, spec, mode, sp.max_tokens)
    prompt = await build_prompt(state, messages, mode)
    constraints = spec and await asyncio.to_thread(build_constraints, state, spec, mode, len(sp.seeds))
    runs = start_runs(state, body, prompt, sp, mode, constraints)
    cid = runs[0].request_id.replace("cmpl-", "chatcmpl-")
    one_call = not P.parallel_tool_calls(body)
    choices = [ChatChoice(i, run, mode, sp, one_call) for i, run in enumerate(runs)]
    return await respond(state, request, runs, sp, choices, cid, "chat.completion.chunk", "chat.completion")
