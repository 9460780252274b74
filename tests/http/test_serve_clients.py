"""What clients nobody here wrote see of `dsv41 serve`: a client that goes away, a body over the
limit sent by Python's urllib, logprob tokens and offsets. The real uvicorn server on 127.0.0.1
(the fixture of test_serve_http, an instance of its own), spoken to over raw sockets, urllib and
the `openai` client."""
from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import pytest

from tests.http.test_serve_http import KEY, MAX_LEN, client, metrics, server  # noqa: F401 (fixtures)


def _until(server, done, what: str, deadline_s: float = 300):
    """Poll /metrics until done(metrics) (a generous deadline: nothing here is about speed)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        m = metrics(server)
        if done(m):
            return m
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen within {deadline_s} s: {m}")


def _send(server, body: dict) -> socket.socket:
    """A raw HTTP request on a socket of our own, so the test decides when the client goes away."""
    data = json.dumps(body).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n").encode()
    sock = socket.create_connection((server.host, server.port), timeout=300)
    sock.sendall(head + data)
    return sock


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_is_cancelled_and_counted(server, stream):
    """A long completion (the whole context, no end token allowed) whose client closes its connection mid-
    generation is dropped: its slot is free again (`dsv41_running_requests` back to 0) and
    `dsv41_cancelled_requests_total{reason="client_disconnected"}` counts it. Only a request the engine
    still held is counted, so the count proves it was cancelled rather than finished."""
    key = 'dsv41_cancelled_requests_total{reason=client_disconnected}'
    before = metrics(server)
    ends = {str(i): -100 for i in server.app.state.serving.end_ids}
    sock = _send(server, {"prompt": "def f", "max_tokens": MAX_LEN - 8, "temperature": 0, "stream": stream,
                          "logit_bias": ends})
    if stream:  # the first chunk has arrived: the request holds a slot
        seen = b""
        while b"data: " not in seen:
            piece = sock.recv(1 << 16)
            assert piece, seen
            seen += piece
    else:
        _until(server, lambda m: m["dsv41_generation_tokens_total"] > before["dsv41_generation_tokens_total"],
               "the first generated token")
    sock.close()
    after = _until(server, lambda m: m.get(key, 0) > before.get(key, 0) and m["dsv41_running_requests"] == 0,
                   "the cancellation")
    assert after[key] == before.get(key, 0) + 1
    assert after["dsv41_generation_tokens_total"] - before["dsv41_generation_tokens_total"] < MAX_LEN - 8
    gone = 'dsv41_requests_total{endpoint=/v1/completions,status=499}'  # streamed or whole, as nginx counts it
    after = _until(server, lambda m: m.get(gone, 0) > before.get(gone, 0), "the 499 in dsv41_requests_total")
    assert after[gone] == before.get(gone, 0) + 1


def test_a_body_over_the_limit_is_a_413_that_urllib_reads(server):
    """urllib sends the whole body before it reads the answer; the server reads and drops the body, then
    answers 413 with its JSON error (answering first used to reset urllib's connection)."""
    body = json.dumps({"messages": [{"role": "user", "content": "a" * (3 << 20)}]}).encode()
    request = urllib.request.Request(server.url + "/v1/chat/completions", data=body, method="POST",
                                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=300)
    assert e.value.code == 413
    error = json.loads(e.value.read())["error"]
    assert error["code"] == 413 and "--max-request-bytes" in error["message"] and str(len(body)) in error["message"]


def test_completion_logprobs_have_text_offsets_and_show_byte_tokens(server, client):
    """A completion with echo and logprobs: `text_offset` says where each token starts in the returned text
    (the BOS the server added takes no characters), and a token that is part of a multi-byte character shows
    as OpenAI's "bytes:\\x.." rather than a replacement character; chat entries carry the bytes too."""
    tok = server.tokenizer
    r = client.completions.create(model="tiny", prompt="x中", max_tokens=5, temperature=0, echo=True, logprobs=2,
                                  extra_body={"dsv41_test": {"forced_tokens": tok.encode("a中b")}})
    c = r.choices[0]
    assert c.text == "x中a中b"
    # independent oracle: each token is one byte of the UTF-8 text (the byte tokenizer has no merges), after the
    # BOS the server added; a token starts at the character its first byte belongs to
    raws = [b""] + [bytes([b]) for b in "x中a中b".encode()]
    full, offsets = b"", []
    for raw in raws:
        offsets.append(len(full.decode("utf-8", errors="ignore")))
        full += raw
    assert full.decode("utf-8") == c.text
    assert c.logprobs.text_offset == offsets
    assert c.logprobs.tokens[2:5] == ["bytes:\\xe4", "bytes:\\xb8", "bytes:\\xad"]
    assert all("\ufffd" not in t for t in c.logprobs.tokens)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=1,
                                          extra_body={"dsv41_test": {"forced_tokens": tok.encode("中")}})
    entries = chat.choices[0].logprobs.content
    assert [e.token for e in entries] == ["bytes:\\xe4", "bytes:\\xb8", "bytes:\\xad"]
    assert b"".join(bytes(e.bytes) for e in entries).decode("utf-8") == "中"


def test_a_completion_prompt_over_the_length_names_prompt(server):
    import httpx

    r = httpx.post(server.url + "/v1/completions", json={"prompt": [65] * MAX_LEN, "max_tokens": 1},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=300)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert f"maximum model length is {MAX_LEN}" in r.json()["error"]["message"]


def test_refusals_name_flags_that_exist(capsys):
    """The image refusal names no flag `dsv41 serve` lacks (there is no --language-model-only there)."""
    import re

    from dsv41_jax.cli.main import main
    from dsv41_jax.serving.http import protocol as P

    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]
    messages = []
    for vision in (True, False):
        with pytest.raises(P.APIError) as e:
            P.check_images(msgs, has_vision=vision)
        messages.append(e.value.message)
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    flags = set(re.findall(r"--[a-z][a-z-]+", capsys.readouterr().out))
    for message in messages:
        assert set(re.findall(r"--[a-z][a-z-]+", message)) <= flags, message
