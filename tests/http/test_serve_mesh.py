"""`dsv41 serve --mesh expert=4,tensor=2` as a real process on 8 fake CPU devices (the root
conftest's XLA_FLAGS reach the subprocess), warmed up (every program compiled on the mesh before
/ready), answering the real `openai` client: chat, streaming and a resumed conversation.

Oracle: the same `dsv41 serve` on one device, started from the same checkpoint with the same
flags, in exact numerics (float64 dots rounded once, so sums split across devices round to the
same value): every reply, its logprobs and its usage (cached tokens included) are equal, field by
field, a seeded sampled reply (temperature 1, top_p 0.9) and an echoed prompt's logprobs included.
The replies come from a random model; a logit bias on the letters keeps them plain ASCII so
that the assistant message sent back in the next turn re-encodes to the tokens generated, which is
what lets the stored conversation be found (the model still picks which letter).
"""
from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

openai = pytest.importorskip("openai")

from dsv41_jax.checkpoint.hf_writer import save_hf_checkpoint  # noqa: E402
from dsv41_jax.checkpoint.synthetic import synthetic_model  # noqa: E402
from dsv41_jax.train.data import ByteTokenizer  # noqa: E402
from tests.support.serve_process import launch, stop, wait_ready  # noqa: E402
from test_serve_http import tiny_config  # noqa: E402

MESH = "expert=4,tensor=2"  # the tiny config's 4 experts one per expert shard, its 4 heads 2 per tensor shard
# the byte tokenizer's id of byte b is 8 + b: +100 on 'a'..'z' keeps greedy replies to lowercase letters
LETTERS = {str(ByteTokenizer().encode(c)[0]): 100 for c in "abcdefghijklmnopqrstuvwxyz"}


def _start(folder, port, cache_dir, mesh, log, extra=(), warm=None):
    """warm: run the warm-up (default: on the mesh only)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "dsv41_jax.cli", "serve", "--checkpoint", str(folder), "--port", str(port),
           "--numerics", "exact", "--exact-prefill", "--max-batch", "2", "--prefill-chunk", "4",
           "--max-model-len", "128", "--prefix-cache-dir", str(cache_dir), "--quiet"]
    # stderr to a file: XLA and uvicorn keep writing there, and an undrained pipe would block the server
    # the one-device reference skips the warm-up (it compiles only the programs the requests use): the
    # warm-up on one device is tests/http/test_serve_warmup.py's; here the mesh server's warm-up is the one tested
    warm = bool(mesh) if warm is None else warm
    cmd += (["--mesh", mesh] if mesh else []) + ([] if warm else ["--no-warm"]) + list(extra)
    return subprocess.Popen(cmd, env=env, stderr=open(log, "w"))


def _servers(tmp_path_factory, warm: bool):
    """{"mesh": url, "one": url}, both answering GET /ready with 200; `warm`: the mesh server runs its
    warm-up (every program compiled on the mesh before /ready), else both compile what requests use."""
    root = tmp_path_factory.mktemp("serve_mesh")
    tok = ByteTokenizer().save_json(root / "tokenizer.json")
    save_hf_checkpoint(synthetic_model(tiny_config(), seed=3), root / "ckpt", tokenizer=tok)
    procs, urls = {}, {}
    starts = {name: (lambda port, name=name, mesh=mesh: _start(root / "ckpt", port, root / f"conv-{name}", mesh,
                                                             root / f"{name}.log", warm=warm and bool(mesh)))
              for name, mesh in (("mesh", MESH), ("one", None))}
    try:
        launch(starts, procs, urls)
        wait_ready(procs, urls, {name: root / f"{name}.log" for name in urls}, starts=starts)
        yield urls
    finally:
        stop(procs)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    yield from _servers(tmp_path_factory, warm=True)


@pytest.fixture(scope="module")
def cold_servers(tmp_path_factory):
    yield from _servers(tmp_path_factory, warm=False)


def _conversation(url, echo: bool = True, every_kind: bool = True):
    """What the client sees over one chat, its streamed copy and its resumed second turn; with
    `every_kind`, a completion and a seeded sampled reply too, and with `echo` an echoed prompt's
    logprobs."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    kw = dict(model="ckpt", temperature=0, logit_bias=LETTERS)
    q1 = [{"role": "user", "content": "what is the weather in paris"}]
    r1 = client.chat.completions.create(messages=q1, max_tokens=8, logprobs=True, **kw)
    streamed = [c.choices[0].delta.content or "" for c in
                client.chat.completions.create(messages=q1, max_tokens=8, stream=True, **kw) if c.choices]
    q2 = q1 + [{"role": "assistant", "content": r1.choices[0].message.content},
               {"role": "user", "content": "and tomorrow"}]
    r2 = client.chat.completions.create(messages=q2, max_tokens=6, logprobs=True, **kw)
    lp = lambda r: [(e.token, e.logprob) for e in r.choices[0].logprobs.content]  # noqa: E731
    out = {"r1": (r1.choices[0].message.content, lp(r1), r1.choices[0].finish_reason, r1.usage.model_dump()),
           "streamed": "".join(streamed),
           "r2": (r2.choices[0].message.content, lp(r2), r2.usage.model_dump())}
    if not every_kind:
        return out
    c = client.completions.create(model="ckpt", prompt="def f", max_tokens=6, temperature=0, logprobs=2)
    # sampled, seeded: the sampler's softmax and top-p sums over the whole row, as on one device
    t1 = client.chat.completions.create(messages=q1, max_tokens=8, logprobs=True, top_logprobs=3,
                                        **{**kw, "temperature": 1.0}, top_p=0.9, seed=7)
    top = lambda r: [[(t.token, t.logprob) for t in e.top_logprobs] for e in r.choices[0].logprobs.content]  # noqa: E731
    out.update(completion=(c.choices[0].text, c.choices[0].logprobs.model_dump()),
               sampled=(t1.choices[0].message.content, lp(t1), top(t1)))
    if echo:  # the prompt's own logprobs (serving/prompt_logprobs.py's log-softmax on the device)
        e = client.completions.create(model="ckpt", prompt="def f", max_tokens=1, temperature=0, echo=True, logprobs=2)
        out["echo"] = (e.choices[0].text, e.choices[0].logprobs.model_dump())
    return out


def _check_chat(mesh):
    text, _, finish, usage = mesh["r1"]
    assert finish == "length" and len(text) == 8 and text.isalpha() and text.islower()
    assert mesh["streamed"] == text
    # the second turn resumed the stored first one: its prompt and the reply but the last token
    assert mesh["r2"][2]["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] + 8 - 1


def test_server_on_a_mesh_answers_as_on_one_device(cold_servers):
    """The default suite's check (the rest is -m slow, below): both servers compile on
    demand, the client's chat, its streamed copy and the resumed second turn are equal field by field."""
    mesh, one = (_conversation(cold_servers[name], echo=False, every_kind=False) for name in ("mesh", "one"))
    _check_chat(mesh)
    assert mesh == one


@pytest.mark.slow
def test_warm_server_on_a_mesh_answers_every_request_kind_as_on_one_device(servers):
    """The mesh server's warm-up compiles every program before /ready, then every request kind (a
    completion, a seeded sampled reply, an echoed prompt's logprobs too) answers as on one device."""
    ready = httpx.get(servers["mesh"] + "/ready").json()
    assert ready["status"] == "ready", ready  # the warm-up compiled every program on the mesh
    mesh, one = _conversation(servers["mesh"]), _conversation(servers["one"])
    _check_chat(mesh)
    sampled, sampled_lp, sampled_top = mesh["sampled"]
    assert len(sampled) == 8 and sampled.isalpha() and len(sampled_top[0]) == 3
    echo_text, echo_lp = mesh["echo"]
    assert echo_text.startswith("def f") and echo_lp["token_logprobs"][0] is None  # the first prompt token has none
    assert len(echo_lp["token_logprobs"]) == len(echo_lp["tokens"]) >= 6 and None not in echo_lp["token_logprobs"][1:]
    assert mesh == one


@pytest.mark.slow
def test_server_with_engram_in_host_memory_answers_as_with_the_tables_on_device(tmp_path_factory):
    """`dsv41 serve --engram host` (the Engram tables in host RAM, each step's rows sent to the device)
    answers the real `openai` client as the same server with the tables on the device does: every
    reply, logprob and usage field equal (exact numerics), over a model with an Engram layer, through
    chat, streaming, a resumed conversation (the replay reads the stored tokens' rows), a completion,
    a seeded sampled reply and an echoed prompt's logprobs. The host server runs its warm-up (every
    program compiled with the compact tables) before /ready.

    The tokenizer's Engram token map sets the config's compressed vocabulary, as a released checkpoint's
    does (`serving.generate.engram_tables` checks the two agree)."""
    from dsv41_jax.engram.tokens import build_token_map

    root = tmp_path_factory.mktemp("serve_engram_host")
    tok = ByteTokenizer().save_json(root / "tokenizer.json")
    cfg = tiny_config().replace(engram_layer_ids=(0,), engram_compressed_vocab_size=build_token_map(str(tok))[1])
    save_hf_checkpoint(synthetic_model(cfg, seed=3), root / "ckpt", tokenizer=tok)
    procs, urls = {}, {}
    starts = {name: (lambda port, name=name, extra=extra: _start(root / "ckpt", port, root / f"conv-{name}", None,
                                                               root / f"{name}.log", extra, warm=bool(extra)))
              for name, extra in (("host", ("--engram", "host")), ("hbm", ()))}
    try:
        launch(starts, procs, urls)
        wait_ready(procs, urls, {name: root / f"{name}.log" for name in urls}, starts=starts)
        host, hbm = _conversation(urls["host"]), _conversation(urls["hbm"])
    finally:
        stop(procs)
    text, _, finish, usage = host["r1"]
    assert finish == "length" and len(text) == 8 and text.isalpha() and host["streamed"] == text
    assert host["r2"][2]["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] + 8 - 1  # resumed
    assert host == hbm
