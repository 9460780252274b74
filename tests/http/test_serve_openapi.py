"""The OpenAPI contract is the server: /openapi.json states what the server accepts, and a schemathesis
run with every check (`--checks all`: no 5xx, schema-valid bodies accepted, schema-violating bodies
refused, responses and SSE events as described, status codes and content types as documented, 404/405
in OpenAI's error shape) passes against a real server.

The few refusals no JSON Schema can state (relations between values, the language inside a regex or
grammar) are listed, each with its reason, in tests/support/schemathesis_hooks.py."""
from __future__ import annotations

import copy
import os
import pathlib
import subprocess
import sys

import jsonschema
import pytest

from dsv41_jax.serving.http import schema as S
from tests.support.schemathesis_hooks import unstatable

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _served(**kw) -> dict:
    spec = {"paths": {"/v1/chat/completions": {"post": {"requestBody": {"content": {"application/json": {
        "schema": S.CHAT_REQUEST}}}}}}}
    args = dict(vocab_size=264, slots=2, max_model_len=2048, vision=False, markers=frozenset())
    return S.for_server(spec, "tiny", **(args | kw))["paths"]["/v1/chat/completions"]["post"]["requestBody"][
        "content"]["application/json"]["schema"]


def _valid(schema: dict, body: dict) -> bool:
    return jsonschema.Draft202012Validator(schema).is_valid(body)


def test_served_document_states_this_servers_limits():
    before = copy.deepcopy(S.CHAT_REQUEST)
    chat = _served()
    assert S.CHAT_REQUEST == before  # a copy: another server's document is not this one's
    user = [{"role": "user", "content": "hi"}]
    assert _valid(chat, {"messages": user, "n": 2, "max_tokens": 2048, "model": "tiny"})
    assert not _valid(chat, {"messages": user, "n": 3})  # more choices than batch slots
    assert not _valid(chat, {"messages": user, "max_tokens": 2049})  # longer than the context
    assert not _valid(chat, {"messages": user, "model": "other"})
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
    assert not _valid(chat, {"messages": image})  # no vision tower
    assert _valid(_served(vision=True), {"messages": image})
    reminder = [{"role": "latest_reminder", "content": "x"}]
    assert not _valid(chat, {"messages": reminder})  # its special token is not in this tokenizer
    from dsv41_jax.text import special_tokens as st
    assert _valid(_served(markers=frozenset({st.LATEST_REMINDER})), {"messages": reminder})


@pytest.mark.parametrize("message, ok", [
    ({"role": "tool", "content": ""}, True),
    ({"role": "tool"}, False),  # every role but the assistant needs content
    ({"role": "assistant"}, False),  # neither content nor tool calls
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}, True),
    ({"role": "assistant", "tool_calls": None}, False),
    ({"role": "developer", "content": ""}, False),  # a developer message needs text
    ({"role": "system", "content": [{"type": "image_url"}]}, False),  # images only where the encoder takes them
    ({"role": "user", "content": "x", "mask": 1}, True),  # DeepSeek's own fixtures write mask as 1
])
def test_message_schema_follows_the_chat_encoder(message, ok):
    """The per-role rules of the schema agree with what the chat encoder accepts."""
    from dsv41_jax.text.chat import encode_chat
    assert _valid(_served(vision=True), {"messages": [message]}) is ok
    if ok:
        encode_chat([message] if message["role"] != "assistant" else [{"role": "user", "content": "q"}, message],
                    thinking=False)
    else:
        with pytest.raises(ValueError):
            encode_chat([message], thinking=False)


def test_only_the_listed_refusals_are_excused():
    excused = {"message": "tool_choice: names the function 'f', which is not in tools", "param": "tool_choice"}
    assert unstatable(400, excused)
    assert not unstatable(500, excused)  # a server error is never excused
    assert not unstatable(400, {**excused, "param": "messages"})  # the rule belongs to its field
    assert not unstatable(400, {"message": "top_logprobs: needs logprobs=true", "param": "top_logprobs"})


@pytest.mark.slow
def test_schemathesis_all_checks_pass(tmp_path):
    """`schemathesis run --checks all` on every endpoint of a real server: 0 failures."""
    from tests.http.test_serve_http import KEY, MAX_LEN, tiny_config
    from dsv41_jax.checkpoint.synthetic import synthetic_model
    from dsv41_jax.serving.engine import EngineSettings
    from dsv41_jax.serving.http.server import BackgroundServer, ServeOptions, build
    from dsv41_jax.text.tokenizer import load_tokenizer
    from dsv41_jax.train.data import ByteTokenizer

    tokenizer = load_tokenizer(ByteTokenizer().save_json(tmp_path / "tokenizer.json"))
    opts = ServeOptions(model_name="tiny", engine=EngineSettings(slots=2, max_seq_len=MAX_LEN, min_capacity=MAX_LEN,
                                                                 prefill_chunk=16, exact_prefill=True),
                        max_queue=1, api_key=KEY, cache_dir=str(tmp_path / "conv"), cache_bytes=1 << 20,
                        max_request_bytes=1 << 20)
    srv = BackgroundServer(*build(synthetic_model(tiny_config(), seed=1), tokenizer, opts)).start()
    try:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "SCHEMATHESIS_HOOKS": "tests.support.schemathesis_hooks"}
        run = subprocess.run(
            [sys.executable, "-m", "schemathesis.cli", "run", srv.url + "/openapi.json", "--checks", "all",
             "-H", f"Authorization: Bearer {KEY}", "--max-examples", "100", "--workers", "1", "--seed", "20261204",
             "--request-timeout", "120", "--phases", "examples,coverage,fuzzing,stateful", "--continue-on-failure",
             "--no-color"], env=env, capture_output=True, text=True, timeout=3000, cwd=tmp_path)  # its cache there
    finally:
        srv.close()
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-4000:]
    assert "No issues found" in run.stdout
