"""The answer of both generating endpoints: one JSON body with every choice, or an SSE stream of
chunks (`data: {...}` events ending with `data: [DONE]`). The choices run concurrently; each
choice object (`choices.py`) turns its text into entries."""
from __future__ import annotations

import asyncio
import json
import time

from fastapi import Request as HTTPRequest
from fastapi.responses import StreamingResponse

from dsv41_jax.serving.http import protocol as P
from dsv41_jax.serving.http.choices import usage
from dsv41_jax.serving.http.runs import Run, cancel_runs, first_events, text_pieces, while_connected
from dsv41_jax.serving.http.state import ServingState


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"


def event_stream(events) -> StreamingResponse:
    return StreamingResponse(events, media_type="text/event-stream")


async def _collect(state: ServingState, runs: list[Run], sp: P.Sampling) -> list[list[str]]:
    """Every choice's text pieces, the choices running concurrently; one failing cancels the others."""
    async def one(run):
        return [t async for t in text_pieces(state, run, sp)]
    tasks = [asyncio.create_task(one(r)) for r in runs]
    try:
        return list(await asyncio.gather(*tasks))
    except Exception:
        cancel_runs(state, runs, "error")
        raise
    finally:
        for t in tasks:
            t.cancel()


async def _merged(state: ServingState, runs: list[Run], sp: P.Sampling):
    """(choice index, text piece) as the choices produce them, then (index, None) when one ends."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, run):
        try:
            async for text in text_pieces(state, run, sp):
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
                cancel_runs(state, runs, "error")
                raise item
            left -= item is None
            yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def respond(state: ServingState, request: HTTPRequest, runs: list[Run], sp: P.Sampling, choices: list,
                  cid: str, chunk_object: str, whole_object: str):
    """Both endpoints' answer: an SSE stream of chunks, or one body with every choice. A client that
    goes away cancels the runs: while the answer is collected or the stream's first events are
    awaited (`while_connected`), and once the stream has started (starlette cancels the generator,
    whose choices cancel their runs)."""
    created = int(time.time())
    if sp.stream:
        await while_connected(state, request, runs, first_events(state, runs))
        head = {"id": cid, "object": chunk_object, "created": created, "model": state.cfg.model_name}
        return event_stream(_chunks(state, request, runs, sp, choices, head))
    texts = await while_connected(state, request, runs, _collect(state, runs, sp))
    state.metrics.requests.labels(request.url.path, "200").inc()
    return {"id": cid, "object": whole_object, "created": created, "model": state.cfg.model_name,
            "choices": [c.whole(t) for c, t in zip(choices, texts)], "usage": usage(runs, len(sp.seeds))}


async def _chunks(state: ServingState, request: HTTPRequest, runs: list[Run], sp: P.Sampling, choices: list,
                  head: dict):
    """The one SSE loop of both endpoints: each choice object turns text into its chunk entries
    (`opening`, `piece(text)`, `closing()`)."""
    try:
        opening = [o for o in (c.opening() for c in choices) if o is not None]
        if opening:
            yield sse({**head, "choices": opening})
        async for i, text in _merged(state, runs, sp):
            entry = choices[i].piece(text) if text is not None else choices[i].closing()
            if entry is not None:
                yield sse({**head, "choices": [entry]})
        if sp.include_usage:
            yield sse({**head, "choices": [], "usage": usage(runs, len(sp.seeds))})
        state.metrics.requests.labels(request.url.path, "200").inc()
    except P.APIError as e:
        state.metrics.requests.labels(request.url.path, str(e.status)).inc()
        yield sse(e.body())
    except (asyncio.CancelledError, GeneratorExit):  # the client left mid-stream: counted as a whole answer's 499
        state.metrics.requests.labels(request.url.path, "499").inc()
        raise
    yield DONE
