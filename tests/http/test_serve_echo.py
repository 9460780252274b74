"""Prompt logprobs: `/v1/completions` with `echo` returns the prompt and, with
`logprobs`, its tokens' logprobs (the first null); `max_tokens: 0` scores without generating. The
request shapes are those lm-eval's `local-completions` sends for a loglikelihood task.

Oracle: `model.forward` (every layer over every token) run independently on the same tokens in
the engine's prefill pieces: bitwise equal.
"""
from __future__ import annotations

import json

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax.model.transformer import forward
from dsv41_jax.serving.buckets import empty_cache
from dsv41_jax.serving.engine import pieces
from dsv41_jax.serving.http.server import BackgroundServer
from test_serve_warmup import tiny_app

PROMPT = "Q: 2+2=?\nA: four, 4"  # with BOS 18 tokens: prefill pieces 16 and 2


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    app, worker = tiny_app(tmp_path_factory.mktemp("echo"), 128, seed=5)
    srv = BackgroundServer(app, worker).start()
    yield srv
    srv.close()


def _post(server, **body):
    return httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": PROMPT, **body}, timeout=600)


def _oracle(engine, ids: list[int]) -> np.ndarray:
    """log_softmax of model.forward's logits [T, V] for the prompt, run in the engine's pieces."""
    # jitted: one program per piece size (measured: the test took 17 s instead of 60 s on 2 cores with every
    # op dispatched eagerly)
    step = jax.jit(lambda params, tokens, cache: forward(nnx.merge(engine.graphdef, params), tokens, cache,
                                                         runtime=engine.runtime)[:2])
    cache = empty_cache(engine.cfg, 1, engine.capacity)
    out, done = [], 0
    for size in pieces(len(ids), engine.prefill_chunk):
        logits, cache = step(engine.params, jnp.asarray([ids[done:done + size]], jnp.int32), cache)
        out.append(np.asarray(jax.nn.log_softmax(logits[0].astype(jnp.float32), -1)))
        done += size
    return np.concatenate(out)


def test_echo_scores_the_prompt_like_model_forward(server):
    ids = httpx.post(server.url + "/tokenize", json={"model": "tiny", "prompt": PROMPT}, timeout=60).json()["tokens"]
    r = _post(server, echo=True, logprobs=3, max_tokens=0, temperature=0)
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 0, "total_tokens": len(ids)}
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    engine = server.worker.engine
    oracle = _oracle(engine, ids)
    want = [float(oracle[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert lp["token_logprobs"][1:] == want  # bitwise: JSON floats round-trip float64 exactly
    for i, top in enumerate(lp["top_logprobs"][1:], 1):
        # the legacy block keys entries by token text (byte tokens that decode alike collapse)
        best = np.sort(oracle[i - 1])[-3:]
        assert 1 <= len(top) <= 3 and all(np.isclose(best, v, rtol=0, atol=1e-6).any() for v in top.values())


def test_echo_with_a_generated_token_and_stream(server):
    # lm-eval's loglikelihood request: echo, logprobs 1, max_tokens 1; it drops the last (generated) entry
    r = _post(server, echo=True, logprobs=1, max_tokens=1, temperature=0)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    scored = _post(server, echo=True, logprobs=1, max_tokens=0).json()["choices"][0]
    assert choice["text"].startswith(PROMPT) and len(choice["text"]) > len(PROMPT) - 1
    n = len(scored["logprobs"]["tokens"])
    assert choice["logprobs"]["token_logprobs"][:n] == scored["logprobs"]["token_logprobs"]
    assert len(choice["logprobs"]["token_logprobs"]) == n + 1
    # streamed, scoring only: one chunk per choice, then [DONE]
    with httpx.stream("POST", server.url + "/v1/completions", timeout=600,
                      json={"model": "tiny", "prompt": PROMPT, "echo": True, "max_tokens": 0, "stream": True}) as s:
        lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "data: [DONE]" and json.loads(lines[0][6:])["choices"][0]["text"] == PROMPT
    # echo without logprobs: the text only
    plain = _post(server, echo=True, max_tokens=2, temperature=0).json()["choices"][0]
    assert plain["text"].startswith(PROMPT) and plain["logprobs"] is None


def test_max_tokens_zero_needs_echo(server):
    r = _post(server, max_tokens=0)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert "echo" in r.json()["error"]["message"]
