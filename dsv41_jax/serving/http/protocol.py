"""OpenAI request bodies -> validated parameters, and the OpenAI error shape.

Validation is by hand rather than through pydantic models so that every refusal says, in
OpenAI's `{"error": {"message", "type", "param", "code"}}` shape, which field was wrong, the value
and what is accepted.

The field policy (docs/SERVING.md "Request fields"): every field is honoured, or refused with a
400, or, only when it cannot change the output (`user`, `metadata`, `store`, ...), accepted and
ignored. A field this server does not know is refused too, as OpenAI's own API does
("Unrecognized request argument supplied"), so a typo never silently changes nothing.
"""
from __future__ import annotations

import dataclasses
import numbers
import secrets
from collections.abc import Mapping

from dsv41_jax.serving.sampling import LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS, MAX_REPETITION_PENALTY
from dsv41_jax.text.chat import DEFAULT_EFFORT_TABLE, IMAGE_PART_TYPES, resolve_effort, tool_functions


class APIError(Exception):
    """An error answered in OpenAI's shape with an HTTP status."""

    def __init__(self, status: int, message: str, *, param: str | None = None, kind: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error",
                             429: "rate_limit_error"}.get(status, "internal_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


def is_int(v) -> bool:
    """An integer as JSON Schema counts them (and pydantic's lax mode, which vLLM's server uses): 3 and a
    client's 3.0, never true/false or 3.5."""
    return (isinstance(v, numbers.Integral) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())


def _is_num(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _get(body: Mapping, key: str, check, expect: str, default=None):
    v = body.get(key)
    if v is None:
        return default
    if not check(v):
        raise bad(key, f"expected {expect}, got {type(v).__name__} {v!r:.80}")
    return v


def _get_int(body: Mapping, key: str, default=None) -> int | None:
    v = _get(body, key, is_int, "an integer", default)
    return v if v is None else int(v)


@dataclasses.dataclass
class Sampling:
    """The sampling fields both endpoints share."""

    max_tokens: int | None
    temperature: float
    top_p: float
    top_k: int
    seeds: tuple[int, ...]  # one per choice (n)
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: bool
    top_logprobs: int
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()


INT32_MAX = 2**31 - 1
MAX_N = 128  # choices per request; each takes an engine slot, so the server also checks n <= --max-batch

# Fields that cannot change the output: accepted and ignored (docs/SERVING.md lists them).
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})
_SAMPLING = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n",
             "logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
             "structured_outputs"}  # structured_outputs: our constraint field (vLLM's name), constraint_spec
CHAT_FIELDS = _SAMPLING | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                           "parallel_tool_calls", "reasoning_effort", "chat_template_kwargs", "response_format"}
# split_special_tokens: ours (Hugging Face's name), whether special-token text in a text prompt stays characters.
COMPLETION_FIELDS = _SAMPLING | {"prompt", "echo", "suffix", "best_of", "split_special_tokens"}
# Fields that select behaviour this server does not have yet: refused unless they ask for the default.
# (value is the default, which is accepted)
_NOT_YET = {
    "suffix": ("", "suffix (fill-in-the-middle) is not supported by this model's completions; leave it out"),
    "best_of": (1, "best_of > 1 is not served; send best_of 1 or leave it out"),
}


def check_fields(body: Mapping, *, chat: bool, extra: frozenset = frozenset()) -> None:
    """Refuse unknown fields and fields whose behaviour is not served (the field policy above).
    `extra`: fields a caller adds (the tests' `dsv41_test`)."""
    known = (CHAT_FIELDS if chat else COMPLETION_FIELDS) | IGNORED_FIELDS | extra
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        other = COMPLETION_FIELDS if chat else CHAT_FIELDS
        hint = (f" ({unknown[0]!r} belongs to {'/v1/completions' if chat else '/v1/chat/completions'})"
                if unknown[0] in other else "")
        raise bad(unknown[0], f"unrecognized request field{hint}; the fields this endpoint takes are listed in "
                              "docs/SERVING.md \"Request fields\"")
    for key, (default, why) in _NOT_YET.items():
        v = body.get(key)
        if v is None or (v == default and not isinstance(v, bool)):  # true == 1 in Python, not in JSON
            continue
        raise bad(key, f"{why} (got {v!r:.80})")


TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", "split_special_tokens", "tools", "reasoning_effort",
                             "chat_template_kwargs", "tool_choice"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def _check_known(body: Mapping, known: frozenset, where: str) -> None:
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        raise bad(unknown[0], f"unrecognized request field for {where}; it takes {sorted(known)}")


def check_tokenize_fields(body: Mapping) -> None:
    _check_known(body, TOKENIZE_FIELDS, "/tokenize")


def check_detokenize_fields(body: Mapping) -> None:
    _check_known(body, DETOKENIZE_FIELDS, "/detokenize")


def sampling_fields(body: Mapping, *, chat: bool) -> Sampling:
    max_tokens = _get_int(body, "max_tokens")
    if chat:
        alt = _get_int(body, "max_completion_tokens")
        max_tokens = alt if alt is not None else max_tokens
    if max_tokens is not None and not (0 if not chat else 1) <= max_tokens <= INT32_MAX:
        raise bad("max_tokens", f"must be in [{0 if not chat else 1}, {INT32_MAX}], got {max_tokens}")
    if max_tokens == 0 and body.get("echo") is not True:  # completions only (chat refused it above)
        raise bad("max_tokens", "0 generates nothing: it scores the prompt, with echo: true (and logprobs); "
                                "otherwise ask for at least 1 token")
    temperature = float(_get(body, "temperature", _is_num, "a number", 1.0))
    if not 0 <= temperature <= 2:
        raise bad("temperature", f"must be in [0, 2], got {temperature}")
    top_p = float(_get(body, "top_p", _is_num, "a number", 1.0))
    if not 0 < top_p <= 1:
        raise bad("top_p", f"must be in (0, 1], got {top_p}")
    top_k = _get_int(body, "top_k", 0)
    if not -1 <= top_k <= INT32_MAX:  # the engine's per-slot arrays are int32
        raise bad("top_k", f"must be in [-1, {INT32_MAX}] (0 or -1 = off; a value >= the vocabulary is off too), "
                           f"got {top_k}")
    n = _get_int(body, "n", 1)
    if not 1 <= n <= MAX_N:
        raise bad("n", f"must be in [1, {MAX_N}], got {n}")
    seed = _get_int(body, "seed")
    if seed is None:  # fresh draws: without a seed, two samples must not be the same sample
        seeds = tuple(secrets.randbits(32) for _ in range(n))
    elif not 0 <= seed < 2**32:
        raise bad("seed", f"must be in [0, 2**32), got {seed}")
    else:  # choice i samples as a request with seed + i would
        seeds = tuple((seed + i) % 2**32 for i in range(n))
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
    if chat:
        logprobs = _get(body, "logprobs", lambda v: isinstance(v, bool), "true or false", False)
        top = _get_int(body, "top_logprobs", 0)
        if not 0 <= top <= 20:
            raise bad("top_logprobs", f"must be in 0-20, got {top}")
        if top and not logprobs:
            raise bad("top_logprobs", "needs logprobs=true")
    else:  # completions: logprobs is the number of top alternatives
        top = _get_int(body, "logprobs", None)
        logprobs = top is not None
        top = top or 0
        if not 0 <= top <= 20:
            raise bad("logprobs", f"must be in 0-20, got {top}")
    penalties = {}
    for key, lo, hi, neutral in (("presence_penalty", -2, 2, 0.0), ("frequency_penalty", -2, 2, 0.0),
                                 ("repetition_penalty", 0, MAX_REPETITION_PENALTY, 1.0)):
        v = float(_get(body, key, _is_num, "a number", neutral))
        if not (lo <= v <= hi if lo < 0 else lo < v <= hi):
            raise bad(key, f"must be in {'[' if lo < 0 else '('}{lo:g}, {hi:g}] ({neutral:g} = off), got {v}")
        penalties[key] = v
    return Sampling(max_tokens, temperature, top_p, max(top_k, 0), seeds, stop, stream, include_usage, logprobs, top,
                    logit_bias=_logit_bias(body.get("logit_bias")), **penalties)


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias`: an object from token id (a JSON key, so a string of digits) to a bias in
    [-100, 100]. The ids are checked against the vocabulary by the caller (`_start`)."""
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise bad("logit_bias", f"expected an object from token id to bias, got {type(value).__name__} {value!r:.80}")
    if len(value) > MAX_LOGIT_BIAS:
        raise bad("logit_bias", f"has {len(value)} entries; at most {MAX_LOGIT_BIAS} are accepted")
    out = []
    for key, bias in value.items():
        key_text = str(key).strip()
        if not key_text.isdigit() or not key_text.isascii():
            raise bad("logit_bias", f"keys are token ids (non-negative integers), got {key!r:.40}")
        if not _is_num(bias) or not -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE:
            raise bad("logit_bias", f"the bias of token {key_text} must be a number in [-100, 100], got {bias!r:.40}")
        out.append((int(key_text), float(bias)))
    return tuple(out)


@dataclasses.dataclass
class ChatMode:
    """How the conversation is rendered: thinking or chat, the effort, which tools; `continues`: the
    messages end with an assistant message, whose reply the model continues (with `"wo_eos": true`
    that reply is left open: DeepSeek's encoder writes no EOS and no new `<｜Assistant｜>` header)."""

    thinking: bool
    effort: int | None  # the resolved budget 1-100 (None: reasoning_effort "none")
    tools: list | None
    parse_tools: bool
    continues: bool = False

    @property
    def reply_thinking(self) -> bool:
        """The reply starts in reasoning: thinking mode and the prompt ends with `<think>` (a continued
        assistant message already has its reasoning and `</think>` in the prompt: the reply is content)."""
        return self.thinking and not self.continues


def chat_mode(body: Mapping, effort_table: Mapping[str, int] | None = None) -> ChatMode:
    """Thinking is on when `reasoning_effort` names a budget (not "none") or
    `chat_template_kwargs.thinking` is true; an explicit `thinking` wins over the effort.
    Names are those of `effort_table` (the server's --effort-table; default DEFAULT_EFFORT_TABLE);
    the mode carries the resolved budget (an int), so rendering needs no table."""
    effort = body.get("reasoning_effort")
    names = dict(DEFAULT_EFFORT_TABLE if effort_table is None else effort_table)
    try:  # chat.resolve_effort is the one check of a name or a number
        budget = None if effort == "none" else resolve_effort(effort, names)
    except ValueError:
        raise bad("reasoning_effort", f"expected one of {sorted(names)}, 'none' or an integer 1-100, got {effort!r:.80}") from None
    kwargs = _get(body, "chat_template_kwargs", lambda v: isinstance(v, Mapping), "an object", {})
    for name in ("thinking", "enable_thinking"):  # DeepSeek's name and the one Qwen-style clients send
        if kwargs.get(name) is not None and not isinstance(kwargs[name], bool):
            raise bad(f"chat_template_kwargs.{name}", f"expected true or false, got {kwargs[name]!r:.80}")
    thinking = kwargs.get("thinking", kwargs.get("enable_thinking"))
    if thinking is None:
        thinking = effort is not None and effort != "none"
    tools = _get(body, "tools", lambda v: isinstance(v, list), "a list of tools")
    try:
        functions = tool_functions(tools)
    except ValueError as e:
        raise bad("tools", str(e)) from None
    choice = body.get("tool_choice")
    choice = "auto" if choice is None else choice
    if isinstance(choice, Mapping):
        name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), Mapping) else None
        if not isinstance(name, str):
            raise bad("tool_choice", f"a named choice is {{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r:.80}")
        named = [t for t, f in zip(tools or [], functions) if f["name"] == name]
        if not named:
            raise bad("tool_choice", f"names the function {name!r}, which is not in tools")
        tools = named
    elif choice not in ("auto", "none", "required"):
        raise bad("tool_choice", f"expected 'auto', 'none', 'required' or a named function, got {choice!r:.80}")
    if choice == "none":
        tools = None
    elif choice == "required" and not tools:
        raise bad("tool_choice", "'required' needs a non-empty tools list")
    messages = body.get("messages")
    continues = (isinstance(messages, list) and bool(messages) and isinstance(messages[-1], Mapping)
                 and messages[-1].get("role") == "assistant")
    # a system or developer message's own tools are rendered too (the reference encoder): parse calls
    hosted = isinstance(messages, list) and any(isinstance(m, Mapping) and m.get("role") in ("system", "developer")
                                                and m.get("tools") for m in messages)
    return ChatMode(thinking, budget, tools or None, bool(tools) or (hosted and choice != "none"), continues)


def check_images(messages, has_vision: bool):
    """Image content blocks are refused by a server without an image prompter (dsv41_jax.serving.http.images):
    the checkpoint has no vision tower, or its app was built without one. The message says which."""
    if not isinstance(messages, list):
        return
    for i, msg in enumerate(messages):
        content = msg.get("content") if isinstance(msg, Mapping) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, Mapping) and part.get("type") in IMAGE_PART_TYPES:
                    why = ("this server was started without image support although the checkpoint has a vision "
                           "tower; send text only" if has_vision else
                           "images are not supported: this checkpoint has no vision tower (its config has no "
                           "vision section); send text only, or serve a checkpoint with a vision tower")
                    raise bad(f"messages[{i}].content", why)


@dataclasses.dataclass
class ConstraintSpec:
    """What a request constrains its reply to. kind: "json" (value: a schema), "regex", "grammar"
    (Lark, llguidance's dialect) or "tools" (a DSML call to one of the rendered tools; `parallel`
    False allows exactly one). `param` is the field it came from, for errors."""

    kind: str
    value: object
    param: str
    parallel: bool = True


def parallel_tool_calls(body: Mapping) -> bool:
    return _get(body, "parallel_tool_calls", lambda v: isinstance(v, bool), "true or false", True)


def constraint_spec(body: Mapping, *, chat: bool) -> ConstraintSpec | None:
    """The request's constraint from `response_format` (chat), `structured_outputs` (both) and a
    forced `tool_choice` ("required" or a named function; chat); at most one of them."""
    found = []
    if chat:
        fmt = body.get("response_format")
        if fmt is not None:
            kind = fmt.get("type") if isinstance(fmt, Mapping) else None
            if kind == "json_object":
                found.append(ConstraintSpec("json", {"type": "object"}, "response_format"))
            elif kind == "json_schema":
                spec = fmt.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, Mapping) else None
                if not isinstance(schema, Mapping):
                    raise bad("response_format", "json_schema needs {'json_schema': {'name': ..., 'schema': {...}, "
                                                 f"'strict': true}}}}, got {fmt!r:.120}")
                strict = spec.get("strict")
                if strict is not None and not isinstance(strict, bool):
                    raise bad("response_format.json_schema.strict", f"expected true or false, got {strict!r:.40}")
                found.append(ConstraintSpec("json", dict(schema), "response_format.json_schema.schema"))
            elif kind != "text":
                raise bad("response_format", f"type must be 'text', 'json_object' or 'json_schema', got {fmt!r:.80}")
        choice = body.get("tool_choice")
        if choice == "required" or isinstance(choice, Mapping):
            found.append(ConstraintSpec("tools", None, "tool_choice", parallel_tool_calls(body)))
        else:
            parallel_tool_calls(body)  # checked; without a forced choice false keeps the first call only
    so = body.get("structured_outputs")
    if so is not None:
        keys = [k for k in ("regex", "grammar", "json") if so.get(k) is not None] if isinstance(so, Mapping) else []
        extra = sorted(set(so) - {"regex", "grammar", "json"}) if isinstance(so, Mapping) else []
        if len(keys) != 1 or extra:
            raise bad("structured_outputs", "expected exactly one of {'regex': str}, {'grammar': str (Lark)} or "
                                            f"{{'json': schema}}, got {so!r:.120}")
        key = keys[0]
        value = so[key]
        if key in ("regex", "grammar") and not isinstance(value, str):
            raise bad(f"structured_outputs.{key}", f"expected a string, got {type(value).__name__}")
        found.append(ConstraintSpec(key, value, f"structured_outputs.{key}"))
    if len(found) > 1:
        raise bad(found[1].param.split(".")[0], f"one constraint per request: {found[0].param.split('.')[0]} "
                                                f"already constrains the reply")
    return found[0] if found else None
