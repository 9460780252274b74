"""GET endpoints about the server itself: /health (liveness), /ready (readiness), /metrics
(Prometheus text), /v1/models and /v1/models/{id}."""
from __future__ import annotations

from fastapi import APIRouter, Request as HTTPRequest
from fastapi.responses import JSONResponse, PlainTextResponse

from dsv41_jax.serving.http import protocol as P
from dsv41_jax.serving.http import schema as S
from dsv41_jax.serving.http.checks import authorize
from dsv41_jax.serving.http.state import ServerConfig, serving_state

router = APIRouter()


@router.get("/health", openapi_extra=S.get_route(S.HEALTH, {503: ("the engine thread (or a process) stopped", S.HEALTH)}))
async def health(request: HTTPRequest):
    """Liveness: 200 while the engine thread runs, warming included (readiness is /ready)."""
    state = serving_state(request)
    worker, processes = state.worker, state.cfg.processes
    alive = worker.thread.is_alive()
    body = {"status": "ok" if alive else "engine thread stopped", "ready": worker.ready.is_set()}
    if processes is not None:  # across processes: every process's heartbeat, as process 0 sees it
        body["processes"] = processes()
        dead = [p["process"] for p in body["processes"] if not p["alive"]]
        if dead:
            alive, body["status"] = False, f"process {', '.join(map(str, dead))} stopped answering"
    return JSONResponse(body, status_code=200 if alive else 503)


@router.get("/ready", openapi_extra=S.get_route(S.READINESS, {503: ("warming up, or the warm-up failed", S.READINESS)}))
async def ready(request: HTTPRequest):
    """Readiness: 200 once every program is compiled (dsv41 serve warms before serving), else 503
    with the progress ({"status": "warming", "done": 3, "total": 25, "current": "graph_a 64"}).
    Requests sent before then are queued, not refused."""
    progress = serving_state(request).worker.readiness()
    return JSONResponse(progress, status_code=200 if progress["status"] == "ready" else 503)


@router.get("/metrics", response_class=PlainTextResponse, openapi_extra=S.METRICS_ROUTE)
async def metrics_text(request: HTTPRequest):
    return PlainTextResponse(serving_state(request).metrics.text(), media_type="text/plain; version=0.0.4")


def _model_card(cfg: ServerConfig) -> dict:
    return {"id": cfg.model_name, "object": "model", "created": 0, "owned_by": "dsv41",
            "max_model_len": cfg.max_model_len}


@router.get("/v1/models", openapi_extra=S.get_route(S.MODEL_LIST, S.KEY_ERROR))
async def models(request: HTTPRequest):
    cfg = serving_state(request).cfg
    authorize(cfg, request)
    return {"object": "list", "data": [_model_card(cfg)]}


# `:path`: a model id may hold slashes (`org/name`), as Hugging Face ids do
@router.get("/v1/models/{model_id:path}",
            openapi_extra=S.get_route(S.MODEL_CARD, {**S.KEY_ERROR, 404: ("another model id", S.ERROR)}))
async def model(request: HTTPRequest, model_id: str):
    """The served model's card (OpenAI's `models.retrieve`); another id is a 404."""
    cfg = serving_state(request).cfg
    authorize(cfg, request)
    if model_id != cfg.model_name:
        raise P.APIError(404, f"the model {model_id!r} does not exist; this server serves {cfg.model_name!r} "
                              "(GET /v1/models)", param="model")
    return _model_card(cfg)
