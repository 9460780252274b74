"""`dsv41 serve` across two real processes: the same command on both, 4 CPU devices each,
joined through JAX's distributed runtime on 127.0.0.1, one mesh `expert=4,tensor=2` over all 8
devices. Process 0 serves HTTP and publishes every engine call; process 1 follows (serving/lockstep.py).

Oracle: one `dsv41 serve` process over 8 devices with the same mesh and flags, in exact numerics
(float64 dots rounded once, so sums split across devices and processes round to the same value):
a chat completion with logprobs, its streamed copy, a resumed second turn (the conversation cache
on process 0's disk travels to process 1 with the request), a completion, a seeded sampled reply
and a thinking-mode question asked twice (the second resumes from the prefix the server stores
after the first: a prefill published to process 1) are equal field by field, usage (cached
tokens) included, and an echoed prompt's logprobs. (Images, constrained decoding and speculation
across processes: tests/http/test_serve_matrix.py.)

Then a fresh pair: process 1 is killed while process 0 streams a reply; process 0 answers the open
request with an error naming process 1 and exits non-zero (the test bounds that it ends, generously,
not how fast: the documented bound is --process-timeout + about 2 s).

Both server tests are slow (about 4 minutes together here); the default suite keeps the flag check
and tests/serving/test_lockstep.py (the channel and the watchdog across two processes).
"""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

from dsv41_jax.checkpoint.hf_writer import save_hf_checkpoint  # noqa: E402
from dsv41_jax.checkpoint.synthetic import synthetic_model  # noqa: E402
from dsv41_jax.train.data import ByteTokenizer  # noqa: E402
from tests.support.serve_process import launch, reserve_port, stop, wait_ready  # noqa: E402
from test_serve_http import tiny_config  # noqa: E402
from test_serve_mesh import LETTERS, MESH  # noqa: E402
from test_serve_mesh import _conversation as mesh_conversation  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_serve_bad_distributed_flags_exit_2(tmp_path):
    """Refused before JAX starts (and before the checkpoint is read): exit 2, one line naming the flag."""
    r = subprocess.run([sys.executable, "-m", "dsv41_jax.cli", "serve", "--checkpoint", str(tmp_path),
                        "--coordinator", "127.0.0.1:1234", "--num-processes", "2"], cwd=REPO, capture_output=True,
                       text=True, env=_env(1), timeout=120)
    assert r.returncode == 2 and "dsv41 serve: --coordinator 127.0.0.1:1234, --num-processes 2 given without " \
        "--process-id" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def _cmd(folder, port, cache_dir, *extra):
    return [sys.executable, "-m", "dsv41_jax.cli", "serve", "--checkpoint", str(folder), "--port", str(port),
            "--numerics", "exact", "--exact-prefill", "--max-batch", "2", "--prefill-chunk", "4",
            "--max-model-len", "128", "--prefix-cache-dir", str(cache_dir), "--quiet", "--mesh", MESH, *extra]


def _env(devices: int) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}


def _pair(folder, port, cache_dir, log, coordinator: int, *extra) -> tuple:
    """(process 0, process 1) of one two-process server: the same command, their own --process-id.
    stderr to files: XLA and uvicorn keep writing there, and an undrained pipe would block a server."""
    flags = ("--coordinator", f"127.0.0.1:{coordinator}", "--num-processes", "2")
    return tuple(subprocess.Popen(_cmd(folder, port, cache_dir, *flags, "--process-id", str(i), *extra), env=_env(4),
                                  stderr=open(f"{log}.{i}", "w"), stdout=subprocess.DEVNULL) for i in range(2))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_multihost")
    tok = ByteTokenizer().save_json(root / "tokenizer.json")
    save_hf_checkpoint(synthetic_model(tiny_config(), seed=3), root / "ckpt", tokenizer=tok)
    return root


def _start_pair(root, name, procs, urls, *extra):
    """Start a two-process server under `name` (process 1 under name + "-1"); the coordinator's port is
    reserved like the HTTP port (its lock is held while the test runs)."""
    coordinator, lock = reserve_port()
    procs[name + "-lock"] = lock  # held until the test ends (stop() skips it)

    def start(port):
        p0, p1 = _pair(root / "ckpt", port, root / f"conv-{name}", root / f"{name}.log", coordinator, *extra)
        procs[name + "-1"] = p1
        return p0

    launch({name: start}, procs, urls)
    return {name: root / f"{name}.log.0"}


def _stop(procs: dict) -> None:
    locks = [procs.pop(k) for k in [k for k in procs if k.endswith("-lock")]]
    stop(procs)
    for lock in locks:
        lock.close()


def _conversation(url):
    """tests/http/test_serve_mesh.py's conversation, then a thinking-mode question asked twice: after the first reply the server also stores the prompt less
    its final <think> (a conversation-cache prefill on process 0's store, published to process 1), and
    the second resumes from that file."""
    out = mesh_conversation(url)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    q = [{"role": "user", "content": "hi"}]  # short: the effort instruction makes a long prompt (model length 128)
    th = [client.chat.completions.create(model="ckpt", messages=q, max_tokens=4, reasoning_effort="high",
                                         temperature=0, logit_bias=LETTERS) for _ in range(2)]
    out["thinking"] = [(t.choices[0].message.model_dump(), t.usage.model_dump()) for t in th]
    return out


@pytest.mark.slow
def test_two_processes_answer_as_one_process(checkpoint):
    root, procs, urls = checkpoint, {}, {}
    try:
        logs = _start_pair(root, "two", procs, urls)

        def one(port):  # the oracle compiles only what the requests use
            return subprocess.Popen(_cmd(root / "ckpt", port, root / "conv-one", "--no-warm"), env=_env(8),
                                    stderr=open(root / "one.log", "w"))

        launch({"one": one}, procs, urls)
        logs["one"] = root / "one.log"
        wait_ready(procs, urls, logs)
        assert httpx.get(urls["two"] + "/ready").json()["status"] == "ready"  # warmed up on both processes
        health = httpx.get(urls["two"] + "/health").json()
        assert [p["process"] for p in health["processes"]] == [0, 1] and all(p["alive"] for p in health["processes"])
        two, ref = _conversation(urls["two"]), _conversation(urls["one"])
        text, _, finish, usage = two["r1"]
        assert finish == "length" and len(text) == 8 and text.isalpha() and text.islower()
        assert two["streamed"] == text
        # the second turn resumed the stored first one (on both processes): its prompt and the reply but the last token
        assert two["r2"][2]["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] + 8 - 1
        (_, first), (_, again) = two["thinking"]
        assert again["prompt_tokens_details"]["cached_tokens"] == first["prompt_tokens"] - 1
        assert two == ref
        assert procs["two-1"].poll() is None  # the follower serves on
    finally:
        _stop(procs)


@pytest.mark.slow
def test_killed_process_ends_the_server_with_an_error(checkpoint):
    root, procs, urls = checkpoint, {}, {}
    try:
        logs = _start_pair(root, "kill", procs, urls, "--no-warm", "--process-timeout", "5")
        wait_ready(procs, urls, logs)
        client = openai.OpenAI(base_url=urls["kill"] + "/v1", api_key="none", max_retries=0, timeout=600)
        stream = client.chat.completions.create(model="ckpt", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=110, temperature=0, logit_bias=LETTERS, stream=True)
        pieces = []
        with pytest.raises(openai.APIError) as err:
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    pieces.append(chunk.choices[0].delta.content)
                    if len(pieces) == 1:  # mid-request: the reply has begun, the engine keeps stepping
                        procs["kill-1"].send_signal(signal.SIGKILL)
        assert "process 1" in str(err.value) and "stopped answering" in str(err.value), str(err.value)
        assert len("".join(pieces)) < 110
        t0 = time.monotonic()
        code = procs["kill"].wait(timeout=300)  # generous: the bound is --process-timeout + about 2 s
        assert code != 0, (root / "kill.log.0").read_text()[-3000:]
        print(f"process 0 exited {code} {time.monotonic() - t0:.1f} s after the error answer")
    finally:
        _stop(procs)
