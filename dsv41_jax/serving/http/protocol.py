"""OpenAI request bodies -> validated parameters, and the OpenAI error shape.

Validation is by hand rather than through pydantic models so that every refusal says, in
OpenAI's `{"error": {"message", "type", "param", "code"}}` shape, which field was wrong, the value
and what is accepted. Unknown fields are ignored, as OpenAI's server does.
"""
from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping

from dsv41_jax.text.chat import DEFAULT_EFFORT_TABLE, EFFORT_MAX, EFFORT_MIN


class APIError(Exception):
    """An error answered in OpenAI's shape with an HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                             429: "rate_limit_error"}.get(status, "internal_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _get(body: Mapping, key: str, check, expect: str, default=None):
    v = body.get(key)
    if v is None:
        return default
    if not check(v):
        raise bad(key, f"expected {expect}, got {type(v).__name__} {v!r:.80}")
    return v


@dataclasses.dataclass
class Sampling:
    """The sampling fields both endpoints share."""

    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int


def sampling_fields(body: Mapping, *, chat: bool) -> Sampling:
    max_tokens = _get(body, "max_tokens", _is_int, "an integer")
    if chat:
        alt = _get(body, "max_completion_tokens", _is_int, "an integer")
        max_tokens = alt if alt is not None else max_tokens
    if max_tokens is not None and max_tokens < 1:
        raise bad("max_tokens", f"must be >= 1, got {max_tokens}")
    temperature = float(_get(body, "temperature", _is_num, "a number", 1.0))
    if not 0 <= temperature <= 2:
        raise bad("temperature", f"must be in [0, 2], got {temperature}")
    top_p = float(_get(body, "top_p", _is_num, "a number", 1.0))
    if not 0 < top_p <= 1:
        raise bad("top_p", f"must be in (0, 1], got {top_p}")
    top_k = _get(body, "top_k", _is_int, "an integer", 0)
    if top_k < -1:
        raise bad("top_k", f"must be >= 0 (0 or -1 = off), got {top_k}")
    seed = _get(body, "seed", _is_int, "an integer", 0)
    if not 0 <= seed < 2**32:
        raise bad("seed", f"must be in [0, 2**32), got {seed}")
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) and s for s in stop) and len(stop) <= 4:
        stop = tuple(stop)
    else:
        raise bad("stop", f"expected a string or a list of up to 4 non-empty strings, got {stop!r:.80}")
    stream = _get(body, "stream", lambda v: isinstance(v, bool), "true or false", False)
    opts = _get(body, "stream_options", lambda v: isinstance(v, Mapping), "an object", {})
    include_usage = opts.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad("stream_options.include_usage", f"expected true or false, got {include_usage!r}")
    n = _get(body, "n", _is_int, "an integer", 1)
    if n != 1:
        raise bad("n", f"only n=1 is supported, got {n}; send separate requests (with different seeds) instead")
    if chat:
        logprobs = _get(body, "logprobs", lambda v: isinstance(v, bool), "true or false", False)
        top = _get(body, "top_logprobs", _is_int, "an integer", 0)
        if not 0 <= top <= 20:
            raise bad("top_logprobs", f"must be in 0-20, got {top}")
        if top and not logprobs:
            raise bad("top_logprobs", "needs logprobs=true")
    else:  # completions: logprobs is the number of top alternatives
        top = _get(body, "logprobs", _is_int, "an integer", None)
        logprobs = top is not None
        top = top or 0
        if not 0 <= top <= 20:
            raise bad("logprobs", f"must be in 0-20, got {top}")
    return Sampling(max_tokens, temperature, top_p, max(top_k, 0), seed, stop, stream, include_usage, logprobs, top)


@dataclasses.dataclass
class ChatMode:
    """How the conversation is rendered: thinking or chat, the effort, which tools."""

    thinking: bool
    effort: int | str | None
    tools: list | None
    parse_tools: bool


def chat_mode(body: Mapping) -> ChatMode:
    """Thinking is on when `reasoning_effort` names a budget (not "none") or
    `chat_template_kwargs.thinking` is true; an explicit `thinking` wins over the effort."""
    effort = body.get("reasoning_effort")
    names = dict(DEFAULT_EFFORT_TABLE)
    if effort is not None and not (effort == "none" or effort in names or
                                   (_is_int(effort) and EFFORT_MIN <= effort <= EFFORT_MAX)):
        raise bad("reasoning_effort", f"expected one of {sorted(names)}, 'none' or an integer 1-100, got {effort!r:.80}")
    kwargs = _get(body, "chat_template_kwargs", lambda v: isinstance(v, Mapping), "an object", {})
    thinking = kwargs.get("thinking", kwargs.get("enable_thinking"))
    if thinking is not None and not isinstance(thinking, bool):
        raise bad("chat_template_kwargs.thinking", f"expected true or false, got {thinking!r:.80}")
    if thinking is None:
        thinking = effort is not None and effort != "none"
    tools = _get(body, "tools", lambda v: isinstance(v, list), "a list of tools")
    choice = body.get("tool_choice", "auto")
    if isinstance(choice, Mapping):
        name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), Mapping) else None
        if not isinstance(name, str):
            raise bad("tool_choice", f"a named choice is {{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r:.80}")
        named = [t for t in tools or [] if isinstance(t, Mapping) and (t.get("function") or {}).get("name") == name]
        if not named:
            raise bad("tool_choice", f"names the function {name!r}, which is not in tools")
        tools = named
    elif choice not in ("auto", "none", "required"):
        raise bad("tool_choice", f"expected 'auto', 'none', 'required' or a named function, got {choice!r:.80}")
    if choice == "none":
        tools = None
    elif choice == "required" and not tools:
        raise bad("tool_choice", "'required' needs a non-empty tools list")
    return ChatMode(thinking, None if effort == "none" else effort, tools or None, bool(tools))


def check_images(messages, has_vision: bool):
    """An image content block is refused unless the checkpoint has a vision tower."""
    if has_vision or not isinstance(messages, list):
        return
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, Mapping) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, Mapping) and part.get("type") in ("image_url", "image", "input_image"):
                    raise bad(f"messages[{i}].content", "images are not supported: this checkpoint has no vision tower")
