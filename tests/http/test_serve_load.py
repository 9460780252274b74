"""Bounded load on `dsv41 serve` run as a real process (`python -m dsv41_jax.cli serve`) on a
synthetic checkpoint in exact numerics: 64 concurrent streaming requests of mixed lengths at
temperature 0 each equal the same request served alone, nothing hangs, and the server keeps
serving after clients disconnect mid-stream (slow: 128 requests through a compiled engine)."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")

from dsv41_jax.checkpoint.hf_writer import save_hf_checkpoint  # noqa: E402
from dsv41_jax.checkpoint.synthetic import synthetic_model  # noqa: E402
from dsv41_jax.serving.http.server import free_port  # noqa: E402
from dsv41_jax.train.data import ByteTokenizer  # noqa: E402
from test_serve_http import tiny_config  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def exact_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("load")
    tok = ByteTokenizer().save_json(root / "tokenizer.json")
    save_hf_checkpoint(synthetic_model(tiny_config(), seed=2), root / "ckpt", tokenizer=tok)
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-m", "dsv41_jax.cli", "serve", "--checkpoint", str(root / "ckpt"),
                             "--port", str(port), "--numerics", "exact", "--exact-prefill", "--max-batch", "16",
                             "--prefill-chunk", "16", "--max-queue", "1024", "--quiet"], env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"dsv41 serve did not come up (exit code {proc.poll()})")
        time.sleep(0.5)
    yield url
    proc.terminate()
    proc.wait(timeout=60)


async def _stream(client, prompt: str, max_tokens: int, drop_after: int | None = None) -> str:
    stream = await client.completions.create(model="ckpt", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             stream=True)
    text, chunks = "", 0
    async for part in stream:
        text += part.choices[0].text
        chunks += 1
        if drop_after is not None and chunks >= drop_after:
            await stream.close()  # the client goes away mid-stream
            break
    return text


def test_64_concurrent_equal_alone_and_disconnects(exact_server):
    client = openai.AsyncOpenAI(base_url=exact_server + "/v1", api_key="none", max_retries=0, timeout=1800)
    rng = np.random.default_rng(0)
    words = "the weather in paris is sunny and the answer is forty two".split()
    jobs = [(" ".join(rng.choice(words, int(rng.integers(1, 30)))), int(rng.integers(1, 24))) for _ in range(64)]

    async def run():
        together = await asyncio.wait_for(asyncio.gather(*(_stream(client, p, m) for p, m in jobs)), timeout=1800)
        alone = [await _stream(client, p, m) for p, m in jobs]
        dropped = await asyncio.gather(*(_stream(client, p, 24, drop_after=2) for p, _ in jobs[:8]))
        after = await _stream(client, jobs[0][0], jobs[0][1])
        return together, alone, dropped, after

    together, alone, dropped, after = asyncio.run(run())
    assert together == alone
    assert after == alone[0] and all(isinstance(d, str) for d in dropped)
    m = httpx.get(exact_server + "/metrics").text
    assert "dsv41_running_requests 0.0" in m
