"""Constrained decoding through the real server and the real `openai` client on a trained demo
checkpoint (`dsv41 demo`): for a JSON schema with nested objects, enums and arrays,
`tool_choice: "required"` and a named function, 20 requests each at T = 0 and T = 1. Every
constrained reply that ends (stop / tool_calls) parses and validates; the same requests
unconstrained fail validation most of the time, so the constraint is what makes them valid.

Slow: the demo trains a model first (about a minute; `DSV41_DEMO_SERVED=DIR` reuses the `served`
folder of an earlier `dsv41 demo --out`). Run the quick checks in tests/http/test_serve_http.py.
"""
from __future__ import annotations

import json
import os
import pathlib
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "kind", "tags", "owner"],
          "properties": {
              "name": {"type": "string", "maxLength": 12},
              "kind": {"enum": ["cat", "dog", "fish"]},
              "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "enum": ["a", "b", "c"]}},
              "owner": {"type": "object", "additionalProperties": False, "required": ["age", "city"],
                        "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                                       "city": {"type": "string", "maxLength": 10}}}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city", "parameters": {
             "type": "object", "required": ["city", "days"],
             "properties": {"city": {"type": "string", "maxLength": 16},
                            "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}},
         {"type": "function", "function": {"name": "set_alarm", "description": "an alarm", "parameters": {
             "type": "object", "required": ["hour"],
             "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                            "label": {"type": "string", "enum": ["work", "gym"]}}}}}]
PROMPTS = [f"def f{i}(x):\n    return x * {i}" for i in range(20)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from dsv41_jax.cli.main import build_parser, main
    from dsv41_jax.cli.serve import load_server
    from dsv41_jax.serving.http.server import BackgroundServer

    folder = os.environ.get("DSV41_DEMO_SERVED")
    if folder is None:
        out = tmp_path_factory.mktemp("demo")
        assert main(["demo", "--out", str(out), "--steps", "40", "--time-budget", "600"]) in (0, 1)
        folder = out / "served"
    args = build_parser().parse_args(["serve", "--checkpoint", str(pathlib.Path(folder)), "--quiet", "--max-batch", "4"])
    app, worker, opts = load_server(args)
    srv = BackgroundServer(app, worker).start()
    srv.model = opts.model_name
    yield srv
    srv.close()


def _run(served, kind: str, temperature: float, constrained: bool):
    client = openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=900)

    def one(i):
        body = dict(model=served.model, messages=[{"role": "user", "content": PROMPTS[i]}], temperature=temperature,
                    seed=i, max_tokens=160 if kind == "schema" else 320)  # a DSML call is ~170 byte tokens
        if kind == "schema" and constrained:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA,
                                                                               "strict": True}}
        elif kind != "schema":
            body["tools"] = TOOLS
            if constrained:
                body["tool_choice"] = "required" if kind == "required" else {"type": "function",
                                                                             "function": {"name": "set_alarm"}}
        return client.chat.completions.create(**body).choices[0]

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, range(len(PROMPTS))))


def _valid(kind: str, choice) -> bool:
    """Whether a reply is what the constrained request asks for."""
    try:
        if kind == "schema":
            jsonschema.validate(json.loads(choice.message.content), SCHEMA)
            return True
        calls = choice.message.tool_calls or []
        allowed = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        if kind == "named":
            allowed = {"set_alarm": allowed["set_alarm"]}
        for call in calls:
            jsonschema.validate(json.loads(call.function.arguments), allowed[call.function.name])
        return bool(calls)
    except (ValueError, TypeError, KeyError, jsonschema.ValidationError):
        return False


@pytest.mark.parametrize("kind", ["schema", "required", "named"])
def test_constrained_replies_validate_where_unconstrained_do_not(served, kind):
    figures = {}
    for temperature in (0.0, 1.0):
        replies = _run(served, kind, temperature, constrained=True)
        ended = [c for c in replies if c.finish_reason != "length"]
        bad = [(c.finish_reason, c.message.content, c.message.tool_calls) for c in ended if not _valid(kind, c)]
        assert not bad, bad[:3]
        if kind != "schema":
            assert all(c.finish_reason == "tool_calls" for c in ended)
        assert len(ended) >= len(replies) // 2, [c.finish_reason for c in replies]  # most finish within max_tokens
        free = _run(served, kind, temperature, constrained=False)
        free_valid = sum(_valid(kind, c) for c in free)
        assert free_valid <= len(free) // 2, free_valid
        figures[temperature] = (len(ended), len(replies), free_valid)
    print(f"\n{kind}: T -> (constrained replies ended and valid, requests, unconstrained valid): {figures}")
