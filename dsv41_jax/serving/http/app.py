"""The OpenAI-compatible HTTP API over an `EngineWorker` (FastAPI; `dsv41 serve` runs it with uvicorn).

Endpoints: POST /v1/chat/completions and /v1/completions (SSE streaming or one JSON body, n
choices), POST /tokenize and /detokenize (vLLM's shapes), GET /v1/models, /health (liveness),
/ready (readiness: every program compiled), /metrics (Prometheus text) and /openapi.json (request and response schemas: `schema.py`). Chat replies are split into
`reasoning_content` (also sent as `reasoning`, vLLM's newer name), `content` and `tool_calls`
by the streaming `ReplyParser`; stop strings are matched on the decoded text with a hold-back of
the longest stop minus one character, so a stop split across tokens is still found.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
import traceback
import uuid
from functools import partial

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from dsv41_jax.serving.engine import Request
from dsv41_jax.serving.generate import TextStream
from dsv41_jax.serving.http import protocol as P
from dsv41_jax.serving.http import schema as S
from dsv41_jax.serving.http.images import has_images
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
    max_request_bytes: int = 32 << 20  # request bodies beyond this get a 413 before they are read whole
    test_hooks: bool = False  # accept the `dsv41_test` request field (forced tokens, faults); tests only
    conversations: object = None  # a ConversationStore, or None for no conversation caches
    images: object = None  # an images.ImagePrompter when the checkpoint has a vision tower, else None
    effort_table: object = None  # reasoning_effort names -> budgets (--effort-table); None: DEFAULT_EFFORT_TABLE
    processes: object = None  # serving across processes: callable() -> [{"process", "alive", ...}] (/health)


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


def _too_large(n, limit: int) -> P.APIError:
    return P.APIError(413, f"the request body has {n} bytes, over this server's limit of {limit} bytes "
                           "(dsv41 serve --max-request-bytes)", kind="invalid_request_error")


async def _body(request: HTTPRequest, limit: int) -> dict:
    """The JSON object of the request, refused with 413 before it is read whole when it is over `limit`
    bytes (by its Content-Length, or while it streams in); parsed off the event loop, so a large body
    never stalls the other clients."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(f"more than {limit}", limit)
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = json.loads(raw) if size < (1 << 16) else await asyncio.to_thread(json.loads, raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise P.APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise P.APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def reply_control_ids(tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(ids that end a reply, ids dropped from its text). A sampled turn marker (EOS, BOS, User,
    Assistant, System) ends the reply with finish_reason "stop": the model has started another turn.
    Every other special token but the reasoning markers (which the reply parser reads) is dropped
    from the text, so control tokens never reach `content` (docs/SERVING.md "Control tokens")."""
    ends = {tokenizer.eos_id}
    for text in (st.BOS, st.USER, st.ASSISTANT, st.SYSTEM):
        i = tokenizer.token_to_id(text)
        if i is not None:
            ends.add(i)
    keep = {tokenizer.token_to_id(st.THINK_START), tokenizer.token_to_id(st.THINK_END)}
    specials = tokenizer.backend_tokenizer.get_added_tokens_decoder()
    dropped = {i for i, t in specials.items() if t.special and i not in keep and st.DSML not in t.content}
    return tuple(sorted(ends)), tuple(sorted(dropped | ends))


def _text_bytes(value) -> int:
    """UTF-8 bytes of every string inside a JSON value (the text a prompt is made of)."""
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, dict):
        return sum(_text_bytes(v) for v in value.values())
    if isinstance(value, list):
        return sum(_text_bytes(v) for v in value)
    return 0


def _malloc_trim() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise): after a large request the
    process returns to its size instead of keeping the peak. No-op where glibc is absent."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


LARGE_BODY = 1 << 20  # bytes; after a request this large the heap is trimmed


def build_app(worker: EngineWorker, tokenizer, cfg: ServerConfig) -> FastAPI:
    app = FastAPI(title="dsv41 serve", docs_url=None, redoc_url=None)
    metrics = worker.metrics

    @app.middleware("http")
    async def _trim_after_large_bodies(request: HTTPRequest, call_next):
        response = await call_next(request)
        size = request.headers.get("content-length", "")
        if size.isdigit() and int(size) >= LARGE_BODY:
            await asyncio.to_thread(_malloc_trim)
        return response
    end_ids, skip_ids = reply_control_ids(tokenizer)
    # No vocabulary entry is longer than this many bytes (byte-level entries are longer than the bytes
    # they decode to), so a text of more than max_model_len * this many bytes is over the limit for
    # sure: refused before it is tokenized (a 50 MB prompt costs nothing). The factor 2 leaves room
    # for a normalizer that shortens text before it is split.
    max_token_bytes = max((len(t.encode("utf-8")) for t in tokenizer.backend_tokenizer.get_vocab(True)), default=1)
    max_token_bytes = 2 * max(max_token_bytes, 4)  # byte-level pieces can decode to a whole UTF-8 character
    test_fields = frozenset({"dsv41_test"}) if cfg.test_hooks else frozenset()

    def _single_process(param: str, feature: str):
        """Across processes (`dsv41 serve --coordinator ...`), a feature whose work runs outside the
        engine's lockstep steps (`lockstep.NOT_ACROSS`) is refused (400) before any compute."""
        if cfg.processes is not None:
            from dsv41_jax.serving.lockstep import refusal

            raise P.bad(param, refusal(feature, len(cfg.processes())))

    def _precheck(param: str, value):
        n = _text_bytes(value)
        if n > cfg.max_model_len * max_token_bytes:
            raise P.APIError(400, f"the prompt's text has {n} bytes, more than the maximum model length "
                                  f"{cfg.max_model_len} tokens can hold (at most {max_token_bytes} bytes a token); shorten it", param=param)

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
        """Liveness: 200 while the engine thread runs, warming included (readiness is /ready)."""
        alive = worker.thread.is_alive()
        body = {"status": "ok" if alive else "engine thread stopped", "ready": worker.ready.is_set()}
        if cfg.processes is not None:  # across processes: every process's heartbeat, as process 0 sees it
            body["processes"] = cfg.processes()
            dead = [p["process"] for p in body["processes"] if not p["alive"]]
            if dead:
                alive, body["status"] = False, f"process {', '.join(map(str, dead))} stopped answering"
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/ready")
    async def ready():
        """Readiness: 200 once every program is compiled (dsv41 serve warms before serving), else 503
        with the progress ({"status": "warming", "done": 3, "total": 25, "current": "graph_a 64"}).
        Requests sent before then are queued, not refused."""
        st = worker.readiness()
        return JSONResponse(st, status_code=200 if st["status"] == "ready" else 503)

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

    def _test_fields(body: dict) -> tuple[tuple[int, ...], int]:
        """(forced tokens, fail at token k or 0); `"fail": true` means the first token."""
        extra = body.get("dsv41_test")
        if extra is None or not cfg.test_hooks:
            return (), 0
        forced = tuple(extra.get("forced_tokens") or tokenizer.encode(extra.get("forced_text", "")))
        return forced, int(extra.get("fail") or 0)

    grammars = []  # the Grammars of this tokenizer, built on the first constrained request (llguidance reads the file)
    grammars_lock = threading.Lock()

    def _constraints(spec: P.ConstraintSpec, mode: P.ChatMode | None, n: int) -> list:
        """One llguidance matcher per choice for the request's constraint (run in a worker thread: a
        large schema takes a while to compile); a grammar that cannot be used is a 400 naming the field."""
        from dsv41_jax.serving.constraints import ConstraintError, Grammars

        with grammars_lock:
            if not grammars:
                grammars.append(Grammars(tokenizer, worker.engine.cfg.vocab_size))
        g = grammars[0]
        try:
            if spec.kind == "json":
                grammar = g.json_schema(spec.value, spec.param)
            elif spec.kind == "regex":
                grammar = g.regex(spec.value)
            elif spec.kind == "grammar":
                grammar = g.lark(spec.value)
            else:
                functions = [t["function"] for t in mode.tools]
                grammar = g.tool_calls(functions, parallel=spec.parallel, param="tools")
            g.check(grammar, spec.param)
            after = tokenizer.token_to_id(st.THINK_END) if mode is not None and mode.reply_thinking else None
            return [g.constraint(grammar, start_after=after) for _ in range(n)]
        except ConstraintError as e:
            raise P.bad(e.param, str(e).split(": ", 1)[1]) from None

    def _start(body: dict, prompt: list[int], sp: P.Sampling, mode: P.ChatMode | None,
               constraints: list | None = None, spans: tuple | None = None, key: list | None = None) -> list[_Run]:
        """Submit one engine request per choice (`n`); each holds a slot, so n is at most the batch."""
        max_tokens = _limits(prompt, sp)
        if len(sp.seeds) > worker.engine.slots:
            raise P.bad("n", f"{len(sp.seeds)} choices need {len(sp.seeds)} batch slots at once; this server has "
                             f"{worker.engine.slots} (dsv41 serve --max-batch)")
        forced, fail = _test_fields(body)
        vocab = worker.engine.cfg.vocab_size
        wrong = next((t for t, _ in sp.logit_bias if t >= vocab), None)
        if wrong is not None:
            raise P.bad("logit_bias", f"token id {wrong} is outside the model's vocabulary [0, {vocab})")
        loop = asyncio.get_running_loop()
        runs = []
        for i, seed in enumerate(sp.seeds):
            params = SamplingParams(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, seed=seed,
                                    max_tokens=max_tokens, stop_tokens=end_ids, presence_penalty=sp.presence_penalty,
                                    frequency_penalty=sp.frequency_penalty, repetition_penalty=sp.repetition_penalty,
                                    logit_bias=sp.logit_bias)
            req = Request(list(prompt), params, request_id=f"cmpl-{uuid.uuid4().hex[:24]}",
                          want_logprobs=sp.logprobs, forced_tokens=forced,
                          constraint=constraints[i] if constraints else None, spans=spans)
            job = Job(req, loop, asyncio.Queue(), fail_in_engine=fail)
            # an image prompt matches the conversation caches on its pixel key (every image position has one id)
            if cfg.conversations is not None:
                cfg.conversations.attach(job, thinking=bool(mode and mode.reply_thinking), chat=mode is not None, key=key)
            runs.append(_Run(len(prompt), job))
        try:
            worker.submit_all([run.job for run in runs])
        except QueueFull as e:
            raise P.APIError(429, f"the server is at capacity: {e}; retry after {RETRY_AFTER_S} s",
                             headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        return runs

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
        stream = TextStream(tokenizer, skip_ids=skip_ids)
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
                    if sp.logprobs and lp is not None and tok not in end_ids:
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

    async def _first_all(runs: list[_Run], request: HTTPRequest):
        try:
            for run in runs:
                await _first(run, request)
        except BaseException:
            for run in runs:  # a refused choice refuses the request: free the others' slots
                worker.cancel(run.job.request.request_id)
            raise

    def _usage(runs: list[_Run]) -> dict:
        """The prompt counts once however many choices were drawn from it (as OpenAI counts it)."""
        prompt, generated = runs[0].prompt_len, sum(len(r.tokens) for r in runs)
        return {"prompt_tokens": prompt, "completion_tokens": generated, "total_tokens": prompt + generated,
                "prompt_tokens_details": {"cached_tokens": runs[0].cached}}

    async def _collect(runs: list[_Run], sp: P.Sampling, request: HTTPRequest) -> list[list[str]]:
        """Every choice's text pieces, the choices running concurrently; one failing cancels the others."""
        async def one(run):
            return [t async for t in _events(run, sp, request, False)]
        tasks = [asyncio.create_task(one(r)) for r in runs]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()

    async def _merged(runs: list[_Run], sp: P.Sampling, request: HTTPRequest):
        """(choice index, text piece) as the choices produce them, then (index, None) when one ends."""
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i, run):
            try:
                async for text in _events(run, sp, request, True):
                    await q.put((i, text))
                await q.put((i, None))
            except P.APIError as e:
                await q.put((i, e))
        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(runs)]
        try:
            left = len(runs)
            while left:
                i, item = await q.get()
                if isinstance(item, P.APIError):
                    raise item
                left -= item is None
                yield i, item
        finally:
            for t in tasks:
                t.cancel()

    async def _respond(request: HTTPRequest, runs: list[_Run], sp: P.Sampling, choices: list, cid: str,
                       chunk_object: str, whole_object: str):
        """Both endpoints' answer: an SSE stream of chunks, or one body with every choice."""
        created = int(time.time())
        if sp.stream:
            await _first_all(runs, request)
            head = {"id": cid, "object": chunk_object, "created": created, "model": cfg.model_name}
            return _stream(request, runs, sp, choices, head)
        texts = await _collect(runs, sp, request)
        metrics.requests.labels(request.url.path, "200").inc()
        return {"id": cid, "object": whole_object, "created": created, "model": cfg.model_name,
                "choices": [c.whole(t) for c, t in zip(choices, texts)], "usage": _usage(runs)}

    def _stream(request: HTTPRequest, runs: list[_Run], sp: P.Sampling, choices: list, head: dict):
        """The one SSE loop of both endpoints: each choice object turns text into its chunk entries
        (`opening`, `piece(text)`, `closing()`)."""
        async def gen():
            try:
                opening = [o for o in (c.opening() for c in choices) if o is not None]
                if opening:
                    yield _sse({**head, "choices": opening})
                async for i, text in _merged(runs, sp, request):
                    entry = choices[i].piece(text) if text is not None else choices[i].closing()
                    if entry is not None:
                        yield _sse({**head, "choices": [entry]})
                if sp.include_usage:
                    yield _sse({**head, "choices": [], "usage": _usage(runs)})
                metrics.requests.labels(request.url.path, "200").inc()
            except P.APIError as e:
                metrics.requests.labels(request.url.path, str(e.status)).inc()
                yield _sse(e.body())
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    def _sse(obj) -> str:
        return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"

    # ------------------------------------------------------------------ chat
    @app.post("/v1/chat/completions", openapi_extra=S.route(S.CHAT_REQUEST, S.CHAT_RESPONSE))
    async def chat(request: HTTPRequest):
        _auth(cfg, request)
        body = await _body(request, cfg.max_request_bytes)
        P.check_fields(body, chat=True, extra=test_fields)
        _check_model(body)
        messages = body.get("messages")
        with_images = has_images(messages)
        if with_images and cfg.images is None:
            P.check_images(messages, cfg.has_vision)
        if with_images:
            _single_process("messages", "image input")
        mode = P.chat_mode(body, cfg.effort_table)
        sp = P.sampling_fields(body, chat=True)
        spec = P.constraint_spec(body, chat=True)
        if spec:
            _single_process(spec.param, "constrained decoding")
        _precheck("messages", messages)
        spans = key = None
        try:  # off the event loop: a long conversation must not stall the other clients
            if with_images:  # reads, decodes and encodes the images (vision tower), then the prompt's spans
                made = await asyncio.to_thread(cfg.images.build, tokenizer, messages, thinking=mode.thinking,
                                               effort=mode.effort, tools=mode.tools)
                prompt, spans, key = made.tokens, made.spans, made.key
            else:
                prompt = await asyncio.to_thread(encode_chat_ids, tokenizer, messages, thinking=mode.thinking,
                                                 effort=mode.effort, tools=mode.tools)
        except (ValueError, TypeError) as e:
            raise P.APIError(400, f"messages: {e}", param="messages") from None
        constraints = spec and await asyncio.to_thread(_constraints, spec, mode, len(sp.seeds))
        runs = _start(body, prompt, sp, mode, constraints, spans, key)
        cid = runs[0].job.request.request_id.replace("cmpl-", "chatcmpl-")
        one_call = not P.parallel_tool_calls(body)
        choices = [_ChatChoice(i, run, mode, sp, one_call) for i, run in enumerate(runs)]
        return await _respond(request, runs, sp, choices, cid, "chat.completion.chunk", "chat.completion")

    class _ChatChoice:
        """One chat choice: reasoning / content / tool calls split by its own ReplyParser."""

        def __init__(self, index: int, run: _Run, mode: P.ChatMode, sp: P.Sampling, one_call: bool = False):
            self.index, self.run, self.mode, self.sp = index, run, mode, sp
            self.parser = ReplyParser(thinking=mode.reply_thinking, tools=mode.parse_tools, max_calls=1 if one_call else None)
            self.calls, self.sent_lp = [], 0

        @staticmethod
        def _delta(d) -> dict:
            out = {}
            if d.reasoning:
                out["reasoning_content"] = out["reasoning"] = d.reasoning
            if d.content:
                out["content"] = d.content
            if d.tool_calls:
                out["tool_calls"] = [_call(c) for c in d.tool_calls]
            return out

        def _finish_reason(self) -> str:
            return "tool_calls" if self.calls else ("length" if self.run.finish == "length" else "stop")

        def _lp(self):
            lp = {"content": self.run.logprobs[self.sent_lp:]} if self.sp.logprobs else None
            self.sent_lp = len(self.run.logprobs)
            return lp

        def opening(self) -> dict:
            return {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                    "finish_reason": None}

        def piece(self, text: str) -> dict | None:
            d = self.parser.feed(text)
            self.calls += d.tool_calls
            if not d:
                return None
            return {"index": self.index, "delta": self._delta(d), "logprobs": self._lp(), "finish_reason": None}

        def closing(self) -> dict:
            d = self.parser.finish()
            self.calls += d.tool_calls
            return {"index": self.index, "delta": self._delta(d), "logprobs": self._lp(),
                    "finish_reason": self._finish_reason()}

        def whole(self, texts: list[str]) -> dict:
            pieces = [self.parser.feed(t) for t in texts] + [self.parser.finish()]
            self.calls = [c for d in pieces for c in d.tool_calls]
            message = {"role": "assistant",
                       "content": "".join(d.content for d in pieces) or (None if self.calls else "")}
            if self.mode.reply_thinking:
                message["reasoning_content"] = message["reasoning"] = "".join(d.reasoning for d in pieces)
            if self.calls:
                message["tool_calls"] = [_call(c) for c in self.calls]
            return {"index": self.index, "message": message, "finish_reason": self._finish_reason(),
                    "logprobs": {"content": self.run.logprobs} if self.sp.logprobs else None}

    def _call(c) -> dict:
        return {"index": c.index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": c.name, "arguments": c.arguments}}

    async def _prompt_ids(prompt, add_special: bool = True, split_special: bool = False) -> list[int]:
        """A completions prompt as ids: text (BOS first, when `add_special`), a one-text list, or token ids.
        In text, the text of a special token becomes its id (the convention of `tokenizers` and vLLM, so a
        client that writes its own chat template gets its control ids), unless `split_special` keeps it text."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise P.bad("prompt", "is empty")
            _precheck("prompt", prompt)
            ids = await asyncio.to_thread(partial(tokenizer.encode, split_special_tokens=split_special), prompt)
            if add_special and ids[:1] != [tokenizer.bos_id]:
                ids = [tokenizer.bos_id] + ids
            return ids
        if isinstance(prompt, list) and prompt and all(P._is_int(t) for t in prompt):
            return check_ids("prompt", prompt)
        raise P.bad("prompt", f"expected a string or a list of token ids, got {prompt!r:.80} (one prompt per request)")

    def check_ids(param: str, ids) -> list[int]:
        vocab = worker.engine.cfg.vocab_size
        wrong = next((t for t in ids if not 0 <= t < vocab), None)
        if wrong is not None:
            raise P.bad(param, f"token id {wrong} is outside the model's vocabulary [0, {vocab})")
        return [int(t) for t in ids]

    # ------------------------------------------------------------------ tokenizer endpoints (vLLM's shapes)
    @app.post("/tokenize", openapi_extra=S.route(S.TOKENIZE_REQUEST, S.TOKENIZE_RESPONSE))
    async def tokenize(request: HTTPRequest):
        """`{prompt | messages, add_special_tokens}` -> `{count, max_model_len, tokens}`: the ids the server
        would prefill for that completions prompt or chat request."""
        _auth(cfg, request)
        body = await _body(request, cfg.max_request_bytes)
        P.check_tokenize_fields(body)
        _check_model(body)
        add_special = _get_bool(body, "add_special_tokens", True)
        if ("prompt" in body) == ("messages" in body):
            raise P.bad("prompt", "send exactly one of 'prompt' (completions) and 'messages' (chat)")
        if "messages" in body:
            mode = P.chat_mode(body, cfg.effort_table)
            _precheck("messages", body["messages"])
            with_images = has_images(body["messages"])
            if with_images and cfg.images is None:
                P.check_images(body["messages"], cfg.has_vision)
            try:
                if with_images:  # the span positions each image takes; the tower does not run
                    made = await asyncio.to_thread(cfg.images.build, tokenizer, body["messages"], with_spans=False,
                                                   thinking=mode.thinking, effort=mode.effort, tools=mode.tools)
                    ids = made.tokens
                else:
                    ids = await asyncio.to_thread(encode_chat_ids, tokenizer, body["messages"],
                                                  thinking=mode.thinking, effort=mode.effort, tools=mode.tools)
            except (ValueError, TypeError) as e:
                raise P.APIError(400, f"messages: {e}", param="messages") from None
        else:
            ids = await _prompt_ids(body["prompt"], add_special, _get_bool(body, "split_special_tokens", False))
        return {"count": len(ids), "max_model_len": cfg.max_model_len, "tokens": ids}

    @app.post("/detokenize", openapi_extra=S.route(S.DETOKENIZE_REQUEST, S.DETOKENIZE_RESPONSE))
    async def detokenize(request: HTTPRequest):
        """`{tokens}` -> `{prompt}`: the text of token ids, special tokens included."""
        _auth(cfg, request)
        body = await _body(request, cfg.max_request_bytes)
        P.check_detokenize_fields(body)
        _check_model(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(P._is_int(t) for t in tokens):
            raise P.bad("tokens", f"expected a list of token ids, got {tokens!r:.80}")
        ids = check_ids("tokens", tokens)
        return {"prompt": await asyncio.to_thread(tokenizer.decode, ids)}

    def _get_bool(body, key, default):
        v = body.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise P.bad(key, f"expected true or false, got {v!r:.80}")
        return v

    # ------------------------------------------------------------------ completions
    @app.post("/v1/completions", openapi_extra=S.route(S.COMPLETION_REQUEST, S.COMPLETION_RESPONSE))
    async def completions(request: HTTPRequest):
        _auth(cfg, request)
        body = await _body(request, cfg.max_request_bytes)
        P.check_fields(body, chat=False, extra=test_fields)
        _check_model(body)
        ids = await _prompt_ids(body.get("prompt"), split_special=_get_bool(body, "split_special_tokens", False))
        sp = P.sampling_fields(body, chat=False)
        echo = _get_bool(body, "echo", False)
        spec = P.constraint_spec(body, chat=False)
        if echo:
            _single_process("echo", "echo (the prompt's logprobs)")
        if spec:
            _single_process(spec.param, "constrained decoding")
        if sp.max_tokens == 0:  # score the prompt only (sampling_fields allows 0 with echo alone)
            if len(ids) > cfg.max_model_len:
                raise P.APIError(400, f"the prompt has {len(ids)} tokens but the maximum model length is "
                                      f"{cfg.max_model_len}", param="prompt")
            return await _echo_only(request, ids, sp, _prompt_text(body.get("prompt"), ids))
        constraints = spec and await asyncio.to_thread(_constraints, spec, None, len(sp.seeds))
        _limits(ids, sp)  # its 400 before any compute
        prefix = await _echo(ids, sp, _prompt_text(body.get("prompt"), ids)) if echo else None
        runs = _start(body, ids, sp, None, constraints)
        choices = [_TextChoice(i, run, sp, prefix) for i, run in enumerate(runs)]
        return await _respond(request, runs, sp, choices, runs[0].job.request.request_id, "text_completion",
                              "text_completion")

    def _prompt_text(prompt, ids: list[int]) -> str:
        """The prompt as echo returns it: the text as sent, or the decoded ids of a token prompt."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        return prompt if isinstance(prompt, str) else tokenizer.decode(ids)

    async def _echo(ids: list[int], sp: P.Sampling, text: str) -> tuple[str, dict | None]:
        """(the prompt's text, its legacy logprobs block or None): echo's prefix of every choice. The
        block has one entry per prompt token (a text prompt's first is the BOS the server adds), the
        first with null logprobs."""
        if not sp.logprobs:
            return text, None
        from dsv41_jax.serving.prompt_logprobs import prompt_logprobs

        lps, tops = await worker.call(lambda engine: prompt_logprobs(engine, list(ids)))
        piece = lambda i: tokenizer.decode([i])  # noqa: E731
        k = sp.top_logprobs
        return text, {"tokens": [piece(t) for t in ids], "token_logprobs": lps,
                      "top_logprobs": [None] + [{piece(i): v for i, v in top[:k]} for top in tops[1:]]}

    async def _echo_only(request: HTTPRequest, ids: list[int], sp: P.Sampling, prompt_text: str):
        """max_tokens 0: every choice is the prompt (and its logprobs); nothing is generated."""
        text, block = await _echo(ids, sp, prompt_text)
        cid, created = f"cmpl-{uuid.uuid4().hex[:24]}", int(time.time())
        choices = [{"index": i, "text": text, "logprobs": block, "finish_reason": "length"}
                   for i in range(len(sp.seeds))]
        usage = {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
        metrics.requests.labels(request.url.path, "200").inc()
        if not sp.stream:
            return {"id": cid, "object": "text_completion", "created": created, "model": cfg.model_name,
                    "choices": choices, "usage": usage}
        head = {"id": cid, "object": "text_completion", "created": created, "model": cfg.model_name}

        async def gen():
            for c in choices:
                yield _sse({**head, "choices": [c]})
            if sp.include_usage:
                yield _sse({**head, "choices": [], "usage": usage})
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    class _TextChoice:
        """One completions choice: the text as it comes, with logprobs in the legacy block shape."""

        def __init__(self, index: int, run: _Run, sp: P.Sampling, echo: tuple[str, dict | None] | None = None):
            self.index, self.run, self.sp, self.sent = index, run, sp, 0
            # echo: the prompt's text and logprobs block, sent once, before the first piece
            self.echo_text, self.echo_lp = echo if echo is not None else (None, None)

        def _lp(self):
            if not self.sp.logprobs:
                return None
            entries, self.sent = self.run.logprobs[self.sent:], len(self.run.logprobs)
            block = {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                     "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries]}
            if self.echo_lp is not None:  # the prompt's entries first
                block, self.echo_lp = {k: self.echo_lp[k] + block[k] for k in block}, None
            return block

        def _text(self, text: str) -> str:
            if self.echo_text is not None:
                text, self.echo_text = self.echo_text + text, None
            return text

        def opening(self):
            return None

        def piece(self, text: str) -> dict:
            lp = self._lp()
            return {"index": self.index, "text": self._text(text), "logprobs": lp, "finish_reason": None}

        def closing(self) -> dict:
            lp = self._lp()
            return {"index": self.index, "text": self._text(""), "finish_reason": self.run.finish, "logprobs": lp}

        def whole(self, texts: list[str]) -> dict:
            lp = self._lp()
            return {"index": self.index, "text": self._text("".join(texts)), "finish_reason": self.run.finish,
                    "logprobs": lp}

    return app
