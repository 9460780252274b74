"""OpenAPI descriptions of the request and response bodies, for `/openapi.json`, clients and fuzzers.

The handlers validate bodies by hand (`protocol.py`: every refusal names its field), so FastAPI
does not derive these; they are written here to match that validation, field for field, and a test
(`tests/http/test_serve_http.py`) checks that every field the validator knows is described and that
every POST endpoint has a request-body schema. A schemathesis run generates requests from them.
"""
from __future__ import annotations

from dsv41_jax.serving.http import protocol as P

_INT32 = {"type": "integer", "minimum": 0, "maximum": P.INT32_MAX}
_TEXT_PART = {"type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
              "required": ["type", "text"]}
_IMAGE_PART = {"type": "object", "properties": {"type": {"enum": ["image_url", "image", "input_image"]}},
               "required": ["type"]}
_CONTENT = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"anyOf": [_TEXT_PART, _IMAGE_PART]}},
                      {"type": "null"}]}
_TOOL_CALL = {"type": "object", "required": ["function"], "properties": {
    "id": {"type": "string"}, "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}, "arguments": {"anyOf": [{"type": "string"}, {"type": "object"}]}}}}}
MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"enum": ["system", "developer", "user", "assistant", "tool", "latest_reminder"]},
    "task": {"enum": ["action", "query", "authority", "domain", "title", "read_url", None],
             "description": "V4.1 quick-instruction task marker after this message"},
    "content": _CONTENT, "name": {"type": "string"},
    "reasoning_content": {"type": ["string", "null"]}, "reasoning": {"type": ["string", "null"]},
    "tool_calls": {"type": "array", "items": _TOOL_CALL}, "tool_call_id": {"type": "string"}}}
TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}, "description": {"type": "string"}, "parameters": {"type": "object"},
        "strict": {"type": "boolean"}}}}}
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
    "logit_bias": {"type": ["object", "null"], "additionalProperties": {"type": "number"},
                   "description": "token id -> bias in [-100, 100], at most 300 entries"},
    "structured_outputs": {"type": ["object", "null"], "description": "exactly one of regex (str), grammar (Lark, "
                                                                      "llguidance dialect) or json (a schema)",
                           "properties": {"regex": {"type": "string"}, "grammar": {"type": "string"},
                                          "json": {"type": "object"}}},
    **{k: {"description": "accepted and ignored: cannot change the output"} for k in sorted(P.IGNORED_FIELDS)},
}
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
        "thinking": {"type": "boolean"}, "enable_thinking": {"type": "boolean"}}},
    "response_format": {"type": ["object", "null"], "description": "text, json_object or json_schema "
                                                                    "({'name', 'schema', 'strict'}): constrains the reply"},
}}
COMPLETION_REQUEST = {"type": "object", "required": ["prompt"], "additionalProperties": False, "properties": {
    **_SAMPLING,
    "prompt": {"anyOf": [{"type": "string", "minLength": 1},
                         {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
                         {"type": "array", "minItems": 1, "items": _INT32},
                         {"type": "array", "minItems": 1, "items": {"type": "array", "minItems": 1, "items": _INT32}}],
               "description": "one prompt, or a list of prompts (each prompt's n choices in turn)"},
    "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 20},
    "max_tokens": {"type": ["integer", "null"], "minimum": 0, "maximum": P.INT32_MAX,
                   "description": "0 only with echo: score the prompt without generating; default 16 (OpenAI's)"},
    "echo": {"type": ["boolean", "null"], "description": "return the prompt (and its tokens' logprobs with "
                                                         "logprobs) before the completion"},
    "suffix": {"type": ["string", "null"], "description": "only empty is accepted"},
    "best_of": {"type": ["integer", "null"], "description": "only 1 is accepted"},
    "split_special_tokens": {"type": ["boolean", "null"], "description": (
        "ours (Hugging Face's name): true keeps special-token text in a text prompt as characters; "
        "default false, the text of a special token becomes its id as in tokenizers and vLLM")},
}}
TOKENIZE_REQUEST = {"type": "object", "additionalProperties": False, "properties": {
    "model": {"type": "string"},
    "prompt": {"anyOf": [{"type": "string", "description": "empty: no ids (BOS alone with add_special_tokens)"},
                         {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string", "minLength": 1}},
                         {"type": "array", "minItems": 1, "items": _INT32}]},
    "messages": CHAT_REQUEST["properties"]["messages"],
    "add_special_tokens": {"type": ["boolean", "null"], "description": "prompt only: BOS first (default true)"},
    "split_special_tokens": COMPLETION_REQUEST["properties"]["split_special_tokens"],
    **{k: CHAT_REQUEST["properties"][k] for k in ("tools", "tool_choice", "reasoning_effort", "chat_template_kwargs")},
}, "description": "exactly one of prompt and messages"}
TOKENIZE_RESPONSE = {"type": "object", "required": ["count", "max_model_len", "tokens"], "properties": {
    "count": {"type": "integer"}, "max_model_len": {"type": "integer"},
    "tokens": {"type": "array", "items": {"type": "integer"}}}}
DETOKENIZE_REQUEST = {"type": "object", "required": ["tokens"], "additionalProperties": False, "properties": {
    "model": {"type": "string"}, "tokens": {"type": "array", "items": _INT32}}}
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


def with_model_name(spec: dict, name: str) -> dict:
    """The OpenAPI document of one server: every request body's `model` is the served name, or empty or
    null (the default model, as vLLM takes it); `checks.check_model` refuses any other."""
    for ops in spec.get("paths", {}).values():
        for op in ops.values():
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema", {})
            if "model" in body.get("properties", {}):
                body["properties"]["model"] = {"enum": [name, "", None],
                                               "description": "the served model (GET /v1/models); empty or null: "
                                                              "the same"}
    return spec


def route(request: dict, response: dict) -> dict:
    """`openapi_extra` for a POST route: its JSON request body, the 200 body (or an SSE stream when
    `stream` is true) and the error bodies."""
    err = {"content": {"application/json": {"schema": ERROR}}}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": request}}},
            "responses": {"200": {"description": "the completion (an SSE stream of chunks when stream=true)",
                                  "content": {"application/json": {"schema": response},
                                              "text/event-stream": {"schema": {"type": "string"}}}},
                          **{str(c): {"description": d, **err} for c, d in (
                              (400, "invalid request: the message names the field"), (401, "missing or wrong key"),
                              (413, "request body over --max-request-bytes"),
                              (429, "queue full; retry after Retry-After seconds"), (500, "internal error"))}}}
