"""The OpenAI-compatible HTTP API over an `EngineWorker` (FastAPI; `dsv41 serve` runs it with uvicorn).

Endpoints: POST /v1/chat/completions and /v1/completions (SSE streaming or one JSON body),
GET /v1/models, /health and /metrics (Prometheus text). Chat replies are split into
`reasoning_content` (also sent as `reasoning`, vLLM's newer name), `content` and `tool_calls`
by the streaming `ReplyParser`; stop strings are matched on the decoded text with a hold-back of
the longest stop minus one character, so a stop split across tokens is still found.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import traceback
import uuid

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from dsv41_jax.serving.engine import Request
from dsv41_jax.serving.generate import TextStream
from dsv41_jax.serving.http import protocol as P
from dsv41_jax.serving.http.worker import EngineWorker, Job, QueueFull
from dsv41_jax.serving.sampling import SamplingParams
from dsv41_jax.text import special_tokens as st
from dsv41_jax.text.chat import encode_chat_ids
from dsv41_jax.text.reply import ReplyParser

RETRY_AFTER_S = 1


@dataclasses.dataclass
class ServerConfig:
    """What the HTTP layer needs to know besides the worker."""

    model_name: str
    max_model_len: int
    api_key: str | None = None
    has_vision: bool = False
    test_hooks: bool = False  # accept the `dsv41_test` request field (forced tokens, faults); tests only
    conversations: object = None  # a ConversationStore, or None for no conversation caches


class _Stops:
    """Finds stop strings in streamed text, holding back what could be the start of one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops, self.hold = stops, max((len(s) for s in stops), default=1) - 1
        self.buf = ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text that is certain, whether a stop string was hit)."""
        self.buf += text
        hits = [self.buf.find(s) for s in self.stops if s in self.buf]
        if hits:
            out, self.buf = self.buf[:min(hits)], ""
            return out, True
        cut = max(len(self.buf) - self.hold, 0)
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out, False

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out


@dataclasses.dataclass
class _Run:
    """One request's prompt and the state gathered while it runs."""

    prompt_len: int
    job: Job
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    cached: int = 0
    finish: str | None = None
    first: tuple | None = None  # the first event, read before a stream's 200 is sent


def _auth(cfg: ServerConfig, request: HTTPRequest):
    if cfg.api_key is None:
        return
    header = request.headers.get("authorization", "")
    if header != f"Bearer {cfg.api_key}":
        raise P.APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' with the key the server "
                              "was started with (--api-key)")


async def _body(request: HTTPRequest) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise P.APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise P.APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def build_app(worker: EngineWorker, tokenizer, cfg: ServerConfig) -> FastAPI:
    app = FastAPI(title="dsv41 serve", docs_url=None, redoc_url=None)
    metrics = worker.metrics
    eos = tokenizer.eos_id

    @app.exception_handler(P.APIError)
    async def _api_error(request: HTTPRequest, e: P.APIError):
        metrics.requests.labels(request.url.path, str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(Exception)
    async def _internal(request: HTTPRequest, e: Exception):
        traceback.print_exc()
        metrics.requests.labels(request.url.path, "500").inc()
        err = P.APIError(500, f"internal error: {type(e).__name__}: {e}")
        return JSONResponse(err.body(), status_code=500)

    @app.get("/health")
    async def health():
        alive = worker.thread.is_alive()
        return JSONResponse({"status": "ok" if alive else "engine thread stopped"}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics_text():
        return PlainTextResponse(metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(request: HTTPRequest):
        _auth(cfg, request)
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model", "created": 0,
                                            "owned_by": "dsv41", "max_model_len": cfg.max_model_len}]}

    def _check_model(body: dict):
        model = body.get("model")
        if model is not None and model != cfg.model_name:
            raise P.APIError(400, f"unknown model {model!r}; this server serves {cfg.model_name!r} (GET /v1/models)",
                             param="model")

    def _limits(prompt: list[int], sp: P.Sampling) -> int:
        n = len(prompt)
        if n >= cfg.max_model_len:
            raise P.APIError(400, f"the prompt has {n} tokens but the maximum model length is {cfg.max_model_len}",
                             param="messages")
        if sp.max_tokens is None:
            return cfg.max_model_len - n
        if n + sp.max_tokens > cfg.max_model_len:
            raise P.APIError(400, f"prompt ({n} tokens) plus max_tokens ({sp.max_tokens}) is {n + sp.max_tokens}, "
                                  f"beyond the maximum model length {cfg.max_model_len}; lower max_tokens",
                             param="max_tokens")
        return sp.max_tokens

    def _test_fields(body: dict) -> tuple[tuple[int, ...], bool]:
        extra = body.get("dsv41_test")
        if extra is None or not cfg.test_hooks:
            return (), False
        forced = tuple(extra.get("forced_tokens") or tokenizer.encode(extra.get("forced_text", "")))
        return forced, bool(extra.get("fail"))

    def _start(body: dict, prompt: list[int], sp: P.Sampling, mode: P.ChatMode | None) -> _Run:
        max_tokens = _limits(prompt, sp)
        params = SamplingParams(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, seed=sp.seed,
                                max_tokens=max_tokens, stop_tokens=(eos,))
        forced, fail = _test_fields(body)
        req = Request(list(prompt), params, request_id=f"cmpl-{uuid.uuid4().hex[:24]}", want_logprobs=sp.logprobs,
                      forced_tokens=forced)
        loop = asyncio.get_running_loop()
        job = Job(req, loop, asyncio.Queue(), fail_in_engine=fail)
        run = _Run(len(prompt), job)
        if cfg.conversations is not None:
            cfg.conversations.attach(job, thinking=bool(mode and mode.thinking), chat=mode is not None)
        try:
            worker.submit(job)
        except QueueFull as e:
            raise P.APIError(429, f"the server is at capacity: {e}; retry after {RETRY_AFTER_S} s",
                             headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        return run

    def _lp_entry(tok: int, lp, top: int) -> dict:
        def item(i):
            text = tokenizer.decode([i])
            return {"token": text, "logprob": float(lp[i]), "bytes": list(text.encode("utf-8"))}

        entry = item(tok)
        if top:
            import numpy as np

            best = np.argsort(-lp, kind="stable")[:top]
            entry["top_logprobs"] = [item(int(i)) for i in best]
        else:
            entry["top_logprobs"] = []
        return entry

    async def _events(run: _Run, sp: P.Sampling, request: HTTPRequest, streaming: bool):
        """Text pieces of the reply as they become certain, then sets run.finish."""
        stream = TextStream(tokenizer, skip_ids=[eos])
        stops = _Stops(sp.stop)
        rid = run.job.request.request_id
        try:
            while True:
                ev, run.first = run.first, None
                if ev is None:
                    ev = await _next(run, request, check_disconnect=not streaming)
                if ev[0] == "token":
                    _, tok, lp = ev
                    run.tokens.append(tok)
                    if sp.logprobs and lp is not None and tok != eos:
                        run.logprobs.append(_lp_entry(tok, lp, sp.top_logprobs))
                    text, hit = stops.push(stream.push(tok))
                    if text:
                        yield text
                    if hit:
                        worker.cancel(rid)
                        run.finish = "stop"
                        return
                elif ev[0] == "done":
                    result = ev[1]
                    run.cached = result.cached_tokens
                    tail = stops.flush()
                    if tail:
                        yield tail
                    run.finish = result.finish_reason
                    return
                else:
                    raise P.APIError(ev[1], ev[2])
        finally:
            if run.finish is None:  # the client went away or the handler failed: free the slot
                worker.cancel(rid)

    async def _next(run: _Run, request: HTTPRequest, check_disconnect: bool) -> tuple:
        while True:
            try:
                return await asyncio.wait_for(run.job.events.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if check_disconnect and await request.is_disconnected():
                    worker.cancel(run.job.request.request_id)
                    raise asyncio.CancelledError from None

    async def _first(run: _Run, request: HTTPRequest):
        """Wait for the first event so a request refused by the engine gets its status code
        rather than a 200 stream that carries an error."""
        run.first = await _next(run, request, check_disconnect=True)
        if run.first[0] == "error":
            raise P.APIError(run.first[1], run.first[2])

    def _usage(run: _Run) -> dict:
        return {"prompt_tokens": run.prompt_len, "completion_tokens": len(run.tokens),
                "total_tokens": run.prompt_len + len(run.tokens),
                "prompt_tokens_details": {"cached_tokens": run.cached}}

    def _sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    # ------------------------------------------------------------------ chat
    @app.post("/v1/chat/completions")
    async def chat(request: HTTPRequest):
        _auth(cfg, request)
        body = await _body(request)
        _check_model(body)
        messages = body.get("messages")
        P.check_images(messages, cfg.has_vision)
        mode = P.chat_mode(body)
        sp = P.sampling_fields(body, chat=True)
        try:
            prompt = encode_chat_ids(tokenizer, messages, thinking=mode.thinking, effort=mode.effort, tools=mode.tools)
        except (ValueError, TypeError) as e:
            raise P.APIError(400, f"messages: {e}", param="messages") from None
        run = _start(body, prompt, sp, mode)
        created, cid = int(time.time()), run.job.request.request_id.replace("cmpl-", "chatcmpl-")
        parser = ReplyParser(thinking=mode.thinking, tools=mode.parse_tools)

        def delta_dict(d) -> dict:
            out = {}
            if d.reasoning:
                out["reasoning_content"] = out["reasoning"] = d.reasoning
            if d.content:
                out["content"] = d.content
            if d.tool_calls:
                out["tool_calls"] = [_call(c) for c in d.tool_calls]
            return out

        def finish_reason(calls) -> str:
            return "tool_calls" if calls else ("length" if run.finish == "length" else "stop")

        if sp.stream:
            await _first(run, request)

            async def gen():
                head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": cfg.model_name}
                yield _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}]})
                calls, sent_lp = [], 0
                try:
                    async for text in _events(run, sp, request, True):
                        d = parser.feed(text)
                        calls += d.tool_calls
                        if d:
                            lp = _chunk_lp(run, sent_lp)
                            sent_lp = len(run.logprobs)
                            yield _sse({**head, "choices": [{"index": 0, "delta": delta_dict(d), "logprobs": lp,
                                                             "finish_reason": None}]})
                    d = parser.finish()
                    calls += d.tool_calls
                    yield _sse({**head, "choices": [{"index": 0, "delta": delta_dict(d),
                                                     "logprobs": _chunk_lp(run, sent_lp),
                                                     "finish_reason": finish_reason(calls)}]})
                    if sp.include_usage:
                        yield _sse({**head, "choices": [], "usage": _usage(run)})
                    metrics.requests.labels(request.url.path, "200").inc()
                except P.APIError as e:
                    metrics.requests.labels(request.url.path, str(e.status)).inc()
                    yield _sse(e.body())
                yield "data: [DONE]\n\n"

            return StreamingResponse(gen(), media_type="text/event-stream")

        pieces = [parser.feed(t) async for t in _events(run, sp, request, False)] + [parser.finish()]
        reasoning = "".join(d.reasoning for d in pieces)
        calls = [c for d in pieces for c in d.tool_calls]
        message = {"role": "assistant", "content": "".join(d.content for d in pieces) or (None if calls else "")}
        if mode.thinking:
            message["reasoning_content"] = message["reasoning"] = reasoning
        if calls:
            message["tool_calls"] = [_call(c) for c in calls]
        choice = {"index": 0, "message": message, "finish_reason": finish_reason(calls),
                  "logprobs": {"content": run.logprobs} if sp.logprobs else None}
        metrics.requests.labels(request.url.path, "200").inc()
        return {"id": cid, "object": "chat.completion", "created": created, "model": cfg.model_name,
                "choices": [choice], "usage": _usage(run)}

    def _chunk_lp(run: _Run, start: int):
        return {"content": run.logprobs[start:]} if run.job.request.want_logprobs else None

    def _call(c) -> dict:
        return {"index": c.index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": c.name, "arguments": c.arguments}}

    # ------------------------------------------------------------------ completions
    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        _auth(cfg, request)
        body = await _body(request)
        _check_model(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise P.bad("prompt", "is empty")
            ids = tokenizer.encode(prompt)
            ids = ids if ids[:1] == [tokenizer.bos_id] else [tokenizer.bos_id] + ids
        elif isinstance(prompt, list) and prompt and all(P._is_int(t) for t in prompt):
            ids = [int(t) for t in prompt]
        else:
            raise P.bad("prompt", f"expected a string or a list of token ids, got {prompt!r:.80} (one prompt per request)")
        sp = P.sampling_fields(body, chat=False)
        run = _start(body, ids, sp, None)
        created, cid = int(time.time()), run.job.request.request_id

        def lp_block(entries):
            return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                    "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries]}

        if sp.stream:
            await _first(run, request)

            async def gen():
                head = {"id": cid, "object": "text_completion", "created": created, "model": cfg.model_name}
                sent = 0
                try:
                    async for text in _events(run, sp, request, True):
                        lp = lp_block(run.logprobs[sent:]) if sp.logprobs else None
                        sent = len(run.logprobs)
                        yield _sse({**head, "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": None}]})
                    yield _sse({**head, "choices": [{"index": 0, "text": "", "finish_reason": run.finish,
                                                     "logprobs": lp_block(run.logprobs[sent:]) if sp.logprobs else None}]})
                    if sp.include_usage:
                        yield _sse({**head, "choices": [], "usage": _usage(run)})
                    metrics.requests.labels(request.url.path, "200").inc()
                except P.APIError as e:
                    metrics.requests.labels(request.url.path, str(e.status)).inc()
                    yield _sse(e.body())
                yield "data: [DONE]\n\n"

            return StreamingResponse(gen(), media_type="text/event-stream")

        text = "".join([t async for t in _events(run, sp, request, False)])
        metrics.requests.labels(request.url.path, "200").inc()
        return {"id": cid, "object": "text_completion", "created": created, "model": cfg.model_name,
                "choices": [{"index": 0, "text": text, "finish_reason": run.finish,
                             "logprobs": lp_block(run.logprobs) if sp.logprobs else None}],
                "usage": _usage(run)}

    return app
