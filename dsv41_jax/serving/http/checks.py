"""The checks every endpoint runs before any compute: the API key, the body (size, JSON), the
model name, the prompt's size before it is tokenized, token ids against the vocabulary, the
token budget. Field-by-field validation of a body is
`protocol.py`'s; each check here raises a `protocol.APIError`."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from fastapi import Request as HTTPRequest

from dsv41_jax.serving.http import protocol as P
from dsv41_jax.serving.http.images import has_images
from dsv41_jax.serving.http.state import ServerConfig, ServingState, serving_state


def authorize(cfg: ServerConfig, request: HTTPRequest) -> None:
    if cfg.api_key is None:
        return
    header = request.headers.get("authorization", "")
    if header != f"Bearer {cfg.api_key}":
        raise P.APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' with the key the server "
                              "was started with (--api-key)")


def _too_large(n, limit: int) -> P.APIError:
    return P.APIError(413, f"the request body has {n} bytes, over this server's limit of {limit} bytes "
                           "(dsv41 serve --max-request-bytes)", kind="invalid_request_error")


MAX_JSON_DEPTH = 64  # nesting levels of a request body; a prompt, tools or a JSON schema need far fewer


def _too_deep() -> P.APIError:
    return P.APIError(400, f"the request body nests JSON deeper than this server's limit of {MAX_JSON_DEPTH} "
                           "levels (objects and arrays inside one another)")


def _parse(raw: bytes):
    """json.loads, refusing bodies nested deeper than MAX_JSON_DEPTH: the decoder's own recursion
    limit would be a 500, and later walks over the body (the prompt's size) recurse too."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise _too_deep() from None
    level = [body]
    for _ in range(MAX_JSON_DEPTH):  # breadth-first, one nesting level at a time; no recursion
        level = [c for v in level if isinstance(v, (dict, list)) for c in (v.values() if isinstance(v, dict) else v)
                 if isinstance(c, (dict, list))]
        if not level:
            return body
    raise _too_deep()


DISCARD_BYTES = 256 << 20  # of a body over the limit, read and dropped before the 413


async def _discard(stream, size: int, limit: int) -> P.APIError:
    """The 413 of a body over `limit`, answered after the rest of the body is read and dropped (up to
    DISCARD_BYTES past the limit; nothing is kept). A client that sends its whole body before it
    reads the answer (Python's urllib, curl without Expect) gets the 413 and its JSON; answering
    while it still sends would reset its connection. A body longer still is answered at once."""
    async for chunk in stream:
        size += len(chunk)
        if size > limit + DISCARD_BYTES:
            break
    return _too_large(f"more than {limit}" if size > limit + DISCARD_BYTES else size, limit)


async def read_body(request: HTTPRequest, limit: int) -> dict:
    """The JSON object of the request; over `limit` bytes (by its Content-Length, or while it streams
    in) a 413, with nothing of the body kept (`_discard`); parsed off the event loop, so a large body
    never stalls the other clients."""
    declared = request.headers.get("content-length")
    stream = request.stream()
    if declared is not None and declared.isdigit() and int(declared) > limit:
        if int(declared) > limit + DISCARD_BYTES:
            raise _too_large(int(declared), limit)
        raise await _discard(stream, 0, limit)
    chunks, size = [], 0
    async for chunk in stream:
        size += len(chunk)
        if size > limit:
            chunks.clear()
            raise await _discard(stream, size, limit)
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        body = _parse(raw) if size < (1 << 16) else await asyncio.to_thread(_parse, raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise P.APIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise P.APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def check_model(cfg: ServerConfig, body: dict) -> None:
    model = body.get("model")
    if model not in (None, "", cfg.model_name):  # empty or null: the served model (as vLLM takes them)
        raise P.APIError(400, f"unknown model {model!r}; this server serves {cfg.model_name!r} (GET /v1/models)",
                         param="model")


async def read_request(request: HTTPRequest,
                       check_fields: Callable[[dict, ServingState], None]) -> tuple[ServingState, dict]:
    """Every POST endpoint's preamble: the key, the body, its fields (`check_fields(body, state)`),
    the model name; (the server's state, the body)."""
    state = serving_state(request)
    authorize(state.cfg, request)
    body = await read_body(request, state.cfg.max_request_bytes)
    check_fields(body, state)
    check_model(state.cfg, body)
    return state, body


def get_bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise P.bad(key, f"expected true or false, got {v!r:.80}")
    return v


def _text_bytes(value) -> int:
    """UTF-8 bytes of every string inside a JSON value (the text a prompt is made of)."""
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, dict):
        return sum(_text_bytes(v) for v in value.values())
    if isinstance(value, list):
        return sum(_text_bytes(v) for v in value)
    return 0


def check_prompt_size(state: ServingState, param: str, value) -> None:
    """A prompt whose text cannot fit in the context is refused before it is tokenized
    (`state.max_token_bytes`)."""
    n, most = _text_bytes(value), state.max_token_bytes
    if n > state.cfg.max_model_len * most:
        raise P.APIError(400, f"the prompt's text has {n} bytes, more than the maximum model length "
                              f"{state.cfg.max_model_len} tokens can hold (at most {most} bytes a token); shorten it",
                         param=param)


def refuse_images(state: ServingState, messages) -> bool:
    """Whether the messages hold images; a 400 naming the reason where this server takes none."""
    with_images = has_images(messages)
    if with_images and state.cfg.images is None:
        P.check_images(messages, state.cfg.has_vision)
    return with_images


def check_ids(state: ServingState, param: str, ids) -> list[int]:
    vocab = state.vocab_size
    wrong = next((t for t in ids if not 0 <= t < vocab), None)
    if wrong is not None:
        raise P.bad(param, f"token id {wrong} is outside the model's vocabulary [0, {vocab})")
    return [int(t) for t in ids]


def token_budget(cfg: ServerConfig, prompt: list[int], sp: P.Sampling, param: str) -> int:
    """The tokens a reply may take: max_tokens, or the rest of the context; a 400 when the prompt
    (the field `param`: chat's messages, completions' prompt) or prompt + max_tokens is over the
    maximum model length."""
    n = len(prompt)
    if n >= cfg.max_model_len:
        raise P.APIError(400, f"the prompt has {n} tokens but the maximum model length is {cfg.max_model_len}",
                         param=param)
    if sp.max_tokens is None:
        return cfg.max_model_len - n
    if n + sp.max_tokens > cfg.max_model_len:
        raise P.APIError(400, f"prompt ({n} tokens) plus max_tokens ({sp.max_tokens}) is {n + sp.max_tokens}, "
                              f"beyond the maximum model length {cfg.max_model_len}; lower max_tokens",
                         param="max_tokens")
    return sp.max_tokens
