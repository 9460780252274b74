"""The OpenAI-compatible HTTP API over an `EngineWorker` (FastAPI; `dsv41 serve` runs it with uvicorn).

Endpoints (`routes/`): POST /v1/chat/completions and /v1/completions (SSE streaming or one JSON
body, n choices), POST /tokenize and /detokenize (vLLM's shapes), GET /v1/models, /health
(liveness), /ready (readiness: every program compiled), /metrics (Prometheus text) and
/openapi.json (request and response schemas: `schema.py`). Chat replies are split into
`reasoning_content` (also sent as `reasoning`, vLLM's newer name), `content` and `tool_calls`
by the streaming `ReplyParser`; stop strings are matched on the decoded text with a hold-back of
the longest stop minus one character, so a stop split across tokens is still found (`runs.py`).

The handlers are module-level functions that read one `state.ServingState` from
`request.app.state.serving`; `build_app` builds that state and registers them.
"""
from __future__ import annotations

import asyncio
import ctypes
import traceback

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from dsv41_jax.serving.http import protocol as P
from dsv41_jax.serving.http import schema as S
from dsv41_jax.serving.http.routes import chat, completions, status, tokens
from dsv41_jax.serving.http.runs import ClientGone
from dsv41_jax.serving.http.state import ServerConfig, ServingState, serving_state
from dsv41_jax.serving.http.worker import EngineWorker

__all__ = ["LARGE_BODY", "ServerConfig", "build_app"]

LARGE_BODY = 1 << 20  # bytes; after a request this large the heap is trimmed


def _malloc_trim() -> None:
    """Hand freed heap pages back to the OS (glibc keeps them otherwise): after a large request the
    process returns to its size instead of keeping the peak. No-op where glibc is absent."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class TrimAfterLargeBodies:
    """ASGI middleware: after a request whose body was declared LARGE_BODY bytes or more, trim the
    heap. Plain ASGI (not starlette's BaseHTTPMiddleware) so that the handlers see the client's
    `http.disconnect` as it happens."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        try:
            await self.app(scope, receive, send)
        finally:
            size = dict(scope.get("headers") or ()).get(b"content-length", b"") if scope["type"] == "http" else b""
            if size.isdigit() and int(size) >= LARGE_BODY:
                await asyncio.to_thread(_malloc_trim)


async def _client_gone(request: HTTPRequest, e: ClientGone):
    """Nobody reads this answer; it is counted as nginx's 499 (client closed request)."""
    serving_state(request).metrics.requests.labels(request.url.path, "499").inc()
    return JSONResponse(P.APIError(499, "the client closed the connection", kind="client_closed_request").body(), status_code=499)


async def _api_error(request: HTTPRequest, e: P.APIError):
    serving_state(request).metrics.requests.labels(request.url.path, str(e.status)).inc()
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _http_error(request: HTTPRequest, e: HTTPException):
    """The router's own answers (an unknown path 404, a wrong method 405) in OpenAI's error shape too,
    so a client reads every error the same way."""
    serving_state(request).metrics.requests.labels(request.url.path, str(e.status_code)).inc()
    what = {404: f"no endpoint {request.url.path!r}: GET /openapi.json lists them",
            405: f"{request.method} is not allowed on {request.url.path!r}"}.get(e.status_code, str(e.detail))
    err = P.APIError(e.status_code, what)
    return JSONResponse(err.body(), status_code=e.status_code, headers=getattr(e, "headers", None))


async def _internal(request: HTTPRequest, e: Exception):
    traceback.print_exc()
    serving_state(request).metrics.requests.labels(request.url.path, "500").inc()
    err = P.APIError(500, f"internal error: {type(e).__name__}: {e}")
    return JSONResponse(err.body(), status_code=500)


def build_app(worker: EngineWorker, tokenizer, cfg: ServerConfig) -> FastAPI:
    app = FastAPI(title="dsv41 serve", docs_url=None, redoc_url=None)
    app.state.serving = ServingState.create(worker, tokenizer, cfg)
    app.add_middleware(TrimAfterLargeBodies)
    app.add_exception_handler(P.APIError, _api_error)
    app.add_exception_handler(ClientGone, _client_gone)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal)
    for routes in (status, chat, tokens, completions):  # this order is /openapi.json's
        app.include_router(routes.router)
    openapi = app.openapi

    def served_openapi():  # the generic document, with this server's model name and vocabulary in the request schemas
        if app.openapi_schema is None:
            state = app.state.serving
            app.openapi_schema = S.for_server(openapi(), cfg.model_name, vocab_size=state.vocab_size,
                                              slots=state.worker.engine.slots, max_model_len=cfg.max_model_len,
                                              vision=cfg.images is not None,
                                              markers=frozenset(tokenizer.added_tokens().values()))
        return app.openapi_schema
    app.openapi = served_openapi
    return app
