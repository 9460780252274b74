"""A request that makes the engine fail fails alone: the others in flight continue and
return what they return when served alone.

The real server and engine on a tiny model; the test-only `dsv41_test: {"fail": k}` field raises
inside the engine while the k-th token of that request is emitted (k = 1: during its admission
and prefill; k > 1: inside a decode step that also carries the other request). The quiet request
streams 200 tokens, with the engine thread paused 10 ms after each step (so it runs for seconds
on any machine), and the failing one is sent once its first token has arrived: it is in flight
when the other fails.
"""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from dsv41_jax.serving.http.server import BackgroundServer
from test_serve_warmup import tiny_app


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    app, worker = tiny_app(tmp_path_factory.mktemp("iso"), 512, seed=3, test_hooks=True)
    step = worker.engine.step

    def slow_step():  # the real step, then a pause: the quiet request stays in flight for seconds
        out = step()
        time.sleep(0.01)
        return out

    worker.engine.step = slow_step
    srv = BackgroundServer(app, worker).start()
    yield srv
    srv.close()


QUIET = {"model": "tiny", "prompt": "the quiet one", "max_tokens": 200, "temperature": 0}


def _complete(server, prompt: str, **extra) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, **extra}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=600)


def _stream_text(server, started: threading.Event) -> tuple[str, float]:
    """The quiet request, streamed: (its text, when it ended); `started` is set at its first token."""
    import json

    text = ""
    with httpx.stream("POST", server.url + "/v1/completions", json={**QUIET, "stream": True}, timeout=600) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
                started.set()
    return text, time.monotonic()


@pytest.mark.parametrize("fail_at", [1, 3])
def test_a_failing_request_fails_alone(server, fail_at):
    alone = httpx.post(server.url + "/v1/completions", json=QUIET, timeout=600).json()["choices"][0]["text"]
    assert _complete(server, "the failing one").status_code == 200  # its programs compiled: it fails fast below
    started, out = threading.Event(), {}
    quiet = threading.Thread(target=lambda: out.update(quiet=_stream_text(server, started)))
    quiet.start()
    assert started.wait(600)
    bad = _complete(server, "the failing one", dsv41_test={"fail": fail_at})
    bad_done = time.monotonic()
    quiet.join(600)
    text, quiet_done = out["quiet"]
    assert bad.status_code == 500 and "test fault" in bad.json()["error"]["message"], bad.text
    assert quiet_done > bad_done, "the quiet request ended before the failing one: nothing was shown"
    assert text == alone
    again = _complete(server, "the quiet one")  # and the server goes on serving
    assert again.status_code == 200
