"""OpenAPI descriptions of the request and response bodies, for `/openapi.json`, clients and fuzzers.

The handlers validate bodies by hand (`protocol.py`: every refusal names its field), so FastAPI
does not derive these; they are written here to match that validation, field for field, and a test
(`tests/http/test_serve_http.py`) checks that every field the validator knows is described and that
every POST endpoint has a request-body schema. A schemathesis run generates requests from them.
"""
from __future__ import annotations

import copy

from dsv41_jax.serving.http import protocol as P
from dsv41_jax.serving.sampling import LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS
from dsv41_jax.text import special_tokens as st

# A token id; the served document bounds it by the model's vocabulary (`for_server`).
TOKEN_ID = {"type": "integer", "minimum": 0, "maximum": P.INT32_MAX, "description": "a token id"}
_TEXT_PART = {"type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
              "required": ["type", "text"]}
IMAGE_PART = {"type": "object", "properties": {"type": {"enum": ["image_url", "image", "input_image"]}},
              "required": ["type"], "description": "only on a server whose checkpoint has a vision tower"}
_CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": [_TEXT_PART, IMAGE_PART]}},
                      {"type": "null"}]}
_TEXT_ONLY = {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART}]}
_SOME_TEXT = {"anyOf": [{"type": "string", "minLength": 1},
                        {"type": "array", "minItems": 1, "items": {**_TEXT_PART, "properties": {
                            **_TEXT_PART["properties"], "text": {"type": "string", "minLength": 1}}}}]}
_TOOL_CALL = {"type": "object", "required": ["function"], "properties": {
    "id": {"type": ["string", "null"]}, "type": {"enum": ["function", None]},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "minLength": 1}, "arguments": {
            "description": "a JSON object or its JSON text; any other value is passed on as one parameter named "
                           "arguments, as DeepSeek's encoder does"}}}}}


def _when(roles: list, then: dict) -> dict:
    return {"if": {"required": ["role"], "properties": {"role": {"enum": roles}}}, "then": then}


# What the chat encoder asks of each role (text/chat.py `_validated`): content on every role but the
# assistant (whose content may be left out when it calls tools), text only where images cannot go,
# non-empty text on a developer message.
MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"enum": ["system", "developer", "user", "assistant", "tool", "latest_reminder"]},
    "task": {"enum": ["action", "query", "authority", "domain", "title", "read_url", None],
             "description": "V4.1 quick-instruction task marker after this message"},
    "content": _CONTENT, "name": {"type": ["string", "null"]},
    "reasoning_content": {"type": ["string", "null"]}, "reasoning": {"type": ["string", "null"]},
    "tool_calls": {"type": ["array", "null"], "items": _TOOL_CALL}, "tool_call_id": {"type": ["string", "null"]},
    "mask": {"anyOf": [{"type": "boolean"}, {"enum": [0, 1]}], "description": "a training field: no effect here"},
    "wo_eos": {"type": "boolean", "description": "assistant: continue this reply (no EOS after it)"}},
    "allOf": [
        _when(["system", "developer", "user", "tool", "latest_reminder"], {"required": ["content"]}),
        _when(["system", "latest_reminder", "assistant"], {"properties": {"content": {"anyOf": [_TEXT_ONLY, {"type": "null"}]}}}),
        _when(["developer"], {"properties": {"content": _SOME_TEXT}}),
        {"if": {"required": ["role"], "properties": {"role": {"const": "assistant"}}, "not": {"required": ["content"]}},
         "then": {"required": ["tool_calls"], "properties": {"tool_calls": {"type": "array", "minItems": 1}}}},
        _when(["system", "developer", "user", "tool", "latest_reminder"], {"properties": {"content": {"not": {"type": "null"}}}}),
    ]}
TOOL = {"type": "object", "required": ["function"], "properties": {  # type may be left out, as vLLM takes it
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}, "description": {"type": ["string", "null"]},
        "parameters": {"type": ["object", "null"]}, "strict": {"type": ["boolean", "null"]}}}}}
_STOP = {"anyOf": [{"type": "string"}, {"type": "array", "maxItems": 4, "items": {"type": "string", "minLength": 1}},
                   {"type": "null"}]}
_SAMPLING = {
    "model": {"type": "string"},
    "max_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": P.INT32_MAX},
    "temperature": {"type": ["number", "null"], "minimum": 0, "maximum": 2},
    "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"type": ["integer", "null"], "minimum": -1, "maximum": P.INT32_MAX},
    "seed": {"type": ["integer", "null"], "minimum": 0, "maximum": 2**32 - 1},
    "stop": _STOP,
    "stream": {"type": ["boolean", "null"]},
    "stream_options": {"type": ["object", "null"], "properties": {"include_usage": {"type": "boolean"}}},
    "n": {"type": ["integer", "null"], "minimum": 1, "maximum": P.MAX_N,
          "description": "choices; also at most the server's --max-batch"},
    "presence_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2,
                         "description": "over generated tokens (OpenAI)"},
    "frequency_penalty": {"type": ["number", "null"], "minimum": -2, "maximum": 2,
                          "description": "over generated tokens (OpenAI)"},
    "repetition_penalty": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 10,
                           "description": "over prompt and generated tokens (HF/vLLM); 1 is off"},
    "logit_bias": {"type": ["object", "null"], "additionalProperties": {"type": "number", "minimum": -LOGIT_BIAS_RANGE,
                                                                        "maximum": LOGIT_BIAS_RANGE},
                   "propertyNames": {"pattern": "^[0-9]+$"}, "maxProperties": MAX_LOGIT_BIAS,
                   "description": "token id -> bias in [-100, 100], at most 300 entries"},
    "structured_outputs": {"anyOf": [{"type": "null"}, {
        "type": "object", "additionalProperties": False, "minProperties": 1, "maxProperties": 1,
        "description": "exactly one of regex (str), grammar (Lark, llguidance dialect) or json (a schema)",
        "properties": {"regex": {"type": "string"}, "grammar": {"type": "string"}, "json": {"type": "object"}}}]},
    **{k: {"description": "accepted and ignored: cannot change the output"} for k in sorted(P.IGNORED_FIELDS)},
}
# A forced call needs a tool to call (protocol.chat_options).
FORCED_CALL_NEEDS_TOOLS = {
    "if": {"required": ["tool_choice"], "properties": {"tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]}}},
    "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}}
CHAT_REQUEST = {"type": "object", "required": ["messages"], "additionalProperties": False, "properties": {
    **_SAMPLING,
    "messages": {"type": "array", "minItems": 1, "items": MESSAGE},
    "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": P.INT32_MAX},
    "logprobs": {"type": ["boolean", "null"]},
    "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 20},
    "tools": {"type": ["array", "null"], "items": TOOL},
    "tool_choice": {"anyOf": [{"enum": ["auto", "none", "required"]}, {"type": "null"},
                              {"type": "object", "required": ["function"], "properties": {
                                  "type": {"const": "function"},
                                  "function": {"type": "object", "required": ["name"],
                                               "properties": {"name": {"type": "string"}}}}}]},
    "parallel_tool_calls": {"type": ["boolean", "null"], "description": "false: at most one call"},
    "reasoning_effort": {"anyOf": [{"enum": ["low", "high", "max", "none"]}, {"type": "null"},
                                   {"type": "integer", "minimum": 1, "maximum": 100}]},
    "chat_template_kwargs": {"type": ["object", "null"], "properties": {
        "thinking": {"type": ["boolean", "null"]}, "enable_thinking": {"type": ["boolean", "null"]}}},
    "response_format": {"anyOf": [
        {"type": "null"}, {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
        {"type": "object", "required": ["type", "json_schema"], "properties": {
            "type": {"const": "json_schema"},
            "json_schema": {"type": "object", "required": ["schema"], "properties": {
                "name": {"type": "string"}, "schema": {"type": "object"}, "strict": {"type": ["boolean", "null"]}}}}}],
        "description": "text, json_object or json_schema: constrains the reply"},
}, "allOf": [
    # top_logprobs (alternatives per token) only with logprobs (protocol.sampling)
    {"if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer", "minimum": 1}}},
     "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}},
    FORCED_CALL_NEEDS_TOOLS]}
COMPLETION_REQUEST = {"type": "object", "required": ["prompt"], "additionalProperties": False, "properties": {
    **_SAMPLING,
    "prompt": {"anyOf": [{"type": "string", "minLength": 1},
                         {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
                         {"type": "array", "minItems": 1, "items": TOKEN_ID},
                         {"type": "array", "minItems": 1, "items": {"type": "array", "minItems": 1, "items": TOKEN_ID}}],
               "description": "one prompt, or a list of prompts (each prompt's n choices in turn)"},
    "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 20},
    "max_tokens": {"type": ["integer", "null"], "minimum": 0, "maximum": P.INT32_MAX,
                   "description": "0 only with echo: score the prompt without generating; default 16 (OpenAI's)"},
    "echo": {"type": ["boolean", "null"], "description": "return the prompt (and its tokens' logprobs with "
                                                         "logprobs) before the completion"},
    "suffix": {"enum": ["", None], "description": "fill-in-the-middle is not served: only empty"},
    "best_of": {"enum": [1, None], "description": "only 1 is served"},
    "split_special_tokens": {"type": ["boolean", "null"], "description": (
        "ours (Hugging Face's name): true keeps special-token text in a text prompt as characters; "
        "default false, the text of a special token becomes its id as in tokenizers and vLLM")},
}, "if": {"required": ["max_tokens"], "properties": {"max_tokens": {"const": 0}}},
   "then": {"required": ["echo"], "properties": {"echo": {"const": True}}}}
TOKENIZE_REQUEST = {"type": "object", "additionalProperties": False, "properties": {
    "model": {"type": "string"},
    "prompt": {"anyOf": [{"type": "string", "description": "empty: no ids (BOS alone with add_special_tokens)"},
                         {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string", "minLength": 1}},
                         {"type": "array", "minItems": 1, "items": TOKEN_ID}]},
    "messages": CHAT_REQUEST["properties"]["messages"],
    "add_special_tokens": {"type": ["boolean", "null"], "description": "prompt only: BOS first (default true)"},
    "split_special_tokens": COMPLETION_REQUEST["properties"]["split_special_tokens"],
    **{k: CHAT_REQUEST["properties"][k] for k in ("tools", "tool_choice", "reasoning_effort", "chat_template_kwargs")},
}, "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}], "allOf": [FORCED_CALL_NEEDS_TOOLS],
   "description": "exactly one of prompt and messages"}
TOKENIZE_RESPONSE = {"type": "object", "required": ["count", "max_model_len", "tokens"], "properties": {
    "count": {"type": "integer"}, "max_model_len": {"type": "integer"},
    "tokens": {"type": "array", "items": {"type": "integer"}}}}
DETOKENIZE_REQUEST = {"type": "object", "required": ["tokens"], "additionalProperties": False, "properties": {
    "model": {"type": "string"}, "tokens": {"type": "array", "items": TOKEN_ID}}}
DETOKENIZE_RESPONSE = {"type": "object", "required": ["prompt"], "properties": {"prompt": {"type": "string"}}}
ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
        "code": {"type": "integer"}}}}}
_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"], "properties": {
    "prompt_tokens": {"type": "integer"}, "completion_tokens": {"type": "integer"},
    "total_tokens": {"type": "integer"}}}
CHAT_RESPONSE = {"type": "object", "required": ["id", "object", "choices", "usage"], "properties": {
    "id": {"type": "string"}, "object": {"const": "chat.completion"}, "created": {"type": "integer"},
    "model": {"type": "string"}, "usage": _USAGE, "choices": {"type": "array", "items": {
        "type": "object", "required": ["index", "message", "finish_reason"], "properties": {
            "index": {"type": "integer"}, "finish_reason": {"enum": ["stop", "length", "tool_calls"]},
            "message": {"type": "object", "properties": {"role": {"const": "assistant"},
                                                          "content": {"type": ["string", "null"]}}}}}}}}
COMPLETION_RESPONSE = {"type": "object", "required": ["id", "object", "choices", "usage"], "properties": {
    "id": {"type": "string"}, "object": {"const": "text_completion"}, "created": {"type": "integer"},
    "model": {"type": "string"}, "usage": _USAGE, "choices": {"type": "array", "items": {
        "type": "object", "required": ["index", "text", "finish_reason"], "properties": {
            "index": {"type": "integer"}, "text": {"type": "string"},
            "finish_reason": {"enum": ["stop", "length"]}}}}}}


MODEL_CARD = {"type": "object", "required": ["id", "object", "created", "owned_by"], "properties": {
    "id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
    "owned_by": {"type": "string"}, "max_model_len": {"type": "integer"}}}
MODEL_LIST = {"type": "object", "required": ["object", "data"], "properties": {
    "object": {"const": "list"}, "data": {"type": "array", "items": MODEL_CARD}}}
HEALTH = {"type": "object", "required": ["status", "ready"], "properties": {
    "status": {"type": "string"}, "ready": {"type": "boolean"}, "processes": {"type": "array"}}}
READINESS = {"type": "object", "required": ["status"], "properties": {"status": {"type": "string"}}}


def get_route(response: dict, errors: dict | None = None) -> dict:
    """`openapi_extra` for a GET route: its 200 JSON body and the error codes it can answer
    (`errors`: status -> (description, schema))."""
    return {"responses": {"200": {"description": "OK", "content": {"application/json": {"schema": response}}},
                          **{str(c): {"description": d, "content": {"application/json": {"schema": sch}}}
                             for c, (d, sch) in (errors or {}).items()}}}


KEY_ERROR = {401: ("missing or wrong key (--api-key)", ERROR)}
METRICS_ROUTE = {"responses": {"200": {"description": "Prometheus text exposition format 0.0.4",
                                       "content": {"text/plain": {"schema": {"type": "string"}}}}}}


def _walk(node, visit) -> None:
    """Call visit(d) on every dict inside node, outermost first."""
    if isinstance(node, dict):
        visit(node)
        for v in node.values():
            _walk(v, visit)
    elif isinstance(node, list):
        for v in node:
            _walk(v, visit)


def for_server(spec: dict, name: str, *, vocab_size: int, slots: int, max_model_len: int, vision: bool,
               markers: frozenset = frozenset()) -> dict:
    """The OpenAPI document of one server, stating its own limits where the generic one cannot: every
    request body's `model` is the served name, or empty or null (the default model, as vLLM takes it;
    `checks.check_model` refuses any other); a token id is below the vocabulary size (`checks.check_ids`);
    `n` is at most the batch slots (`runs._check_capacity`); a message's role and task marker are those
    whose special token the tokenizer has (`markers`: its added tokens; `chat.pieces_to_ids`); a reply
    fits the context; image parts only with a vision tower (`protocol.check_images`).
    A copy: the module's schemas stay generic."""
    spec = copy.deepcopy(spec)
    roles = [r for r in MESSAGE["properties"]["role"]["enum"] if r != "latest_reminder" or st.LATEST_REMINDER in markers]
    tasks = [t for t in MESSAGE["properties"]["task"]["enum"] if t is None or st.TASKS[t] in markers]

    def visit(d: dict) -> None:
        if d.get("description") == TOKEN_ID["description"] and d.get("type") == "integer":
            d["maximum"] = vocab_size - 1
        if d.get("enum") == MESSAGE["properties"]["role"]["enum"]:
            d["enum"] = roles
        if d.get("enum") == MESSAGE["properties"]["task"]["enum"]:
            d["enum"] = tasks
        if d.get("description") == _SAMPLING["n"]["description"]:
            d["maximum"] = min(P.MAX_N, slots)
        for budget in ("max_tokens", "max_completion_tokens"):  # no reply is longer than the context
            if isinstance(d.get("properties"), dict) and isinstance(d["properties"].get(budget), dict):
                d["properties"][budget]["maximum"] = max_model_len
        if not vision and isinstance(d.get("anyOf"), list):
            d["anyOf"] = [a for a in d["anyOf"] if a != IMAGE_PART]
    _walk(spec, visit)
    for ops in spec.get("paths", {}).values():
        for op in ops.values():
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
            if "model" in body.get("properties", {}):
                body["properties"]["model"] = {"enum": [name, "", None],
                                               "description": "the served model (GET /v1/models); empty or null: "
                                                              "the same"}
    return spec


# One server-sent event of a stream (OpenAPI describes an event stream by its events): `data` is one JSON
# chunk of the response, and the last event's is `[DONE]`, as OpenAI sends it.
SSE_EVENT = {"type": "object", "required": ["data"], "properties": {
    "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"},
    "data": {"type": "string", "description": "a JSON chunk, or [DONE] after the last one"}}}


def route(request: dict, response: dict) -> dict:
    """`openapi_extra` for a POST route: its JSON request body, the 200 body (or an SSE stream when
    `stream` is true) and the error bodies."""
    err = {"content": {"application/json": {"schema": ERROR}}}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
            "responses": {"200": {"description": "the completion (an SSE stream of chunks when stream=true)",
                                  "content": {"application/json": {"schema": response},
                                              "text/event-stream": {"schema": SSE_EVENT}}},
                          **{str(c): {"description": d, **err} for c, d in (
                              (400, "invalid request: the message names the field"), (401, "missing or wrong key"),
                              (413, "request body over --max-request-bytes"),
                              (429, "queue full; retry after Retry-After seconds"), (500, "internal error"))}}}
