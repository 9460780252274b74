"""Every request feature of `dsv41 serve` on every deployment, as real processes on 127.0.0.1 answering
the real `openai` client: one device, one process's mesh (`--mesh expert=4,tensor=2` over 8 CPU devices)
and two processes of 4 CPU devices each (`--coordinator ...`, the same mesh over all 8).

The checkpoint is one tiny model with everything a feature needs: a vision tower (images), a DSpark
drafter (`--speculative dspark`) and an Engram layer (`--engram host`), with the byte tokenizer and its
image placeholder. Every deployment serves it with `--speculative dspark --speculative-acceptance match
--engram host`, exact numerics.

Oracles:
- across deployments (`test_every_feature_answers_alike_on_every_deployment`): each deployment's answers
  equal the one-device server's field by field (logprobs bitwise, usage with cached tokens included),
  images, echo, constrained replies and the drafter's acceptance counts (/metrics) included; every
  constrained reply is valid against its schema, regex or tool in every deployment;
- against plain decoding (`test_speculation_and_host_tables_decode_as_plain_decoding`): a one-device
  server without speculation, its Engram tables on the device, gives the same text, tool calls and
  finish reasons for every request (speculation with the "match" rule emits the tokens plain decoding
  draws, seeded sampling included; host tables give the device tables' numbers).
`test_new_features_across_two_processes` is the new cells in brief (one request per feature that used
to be refused across processes); the default suite's cell for them is the engine's
(tests/serving/test_engine_multihost.py), since two server processes take minutes here.
"""
from __future__ import annotations

import base64
import io
import json
import os
import re
import subprocess
import sys

import httpx
import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
from PIL import Image  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from dsv41_jax.checkpoint.hf_writer import save_hf_checkpoint  # noqa: E402
from dsv41_jax.checkpoint.synthetic import synthetic_model  # noqa: E402
from dsv41_jax.config import ModelConfig  # noqa: E402
from dsv41_jax.serving.http.worker import HOLD_ENV  # noqa: E402
from dsv41_jax.train.data import ByteTokenizer  # noqa: E402
from tests.support.serve_process import launch, reserve_port, stop, wait_ready  # noqa: E402
from test_serve_mesh import LETTERS, MESH  # noqa: E402
from test_serve_speculative import DSPARK  # noqa: E402

MAX_LEN = 2048  # a tools prompt is over 1,100 byte-level tokens
FEATURES = ("--speculative", "dspark", "--speculative-acceptance", "match", "--engram", "host")
# name -> (processes, devices per process, extra flags)
DEPLOYMENTS = {"one": (1, 1, FEATURES), "mesh": (1, 8, ("--mesh", MESH) + FEATURES),
               "two": (2, 4, ("--mesh", MESH) + FEATURES), "plain": (1, 1, ()),
               "kill": (2, 4, ("--mesh", MESH) + FEATURES + ("--process-timeout", "5"))}
SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "green"]},
                                          "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["color", "n"], "additionalProperties": False}
PICK = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {"size": {"type": "string", "enum": ["s", "m"]}, "k": {"type": "boolean"}},
    "required": ["size", "k"]}}}
REGEX = "[0-9]{3}-[ab]{2}"
LARK = 'start: "yes" | "no" | "maybe"'


def png(color, size=(12, 9)) -> str:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


RED, BLUE = png((220, 20, 20)), png((20, 20, 220), size=(9, 14))


def matrix_config(tokenizer_json) -> ModelConfig:
    from dsv41_jax.engram.tokens import build_token_map

    return ModelConfig.tiny_vision(n_layers=1, compress_ratios=(0,), kv_source_layers=(), index_source_layers=(),
                                   candidate_source_layer=-1, n_routed_experts=4, max_seq_len=MAX_LEN,
                                   max_batch_size=2, engram_layer_ids=(0,),
                                   engram_compressed_vocab_size=build_token_map(str(tokenizer_json))[1], **DSPARK)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve_matrix")
    tok = ByteTokenizer().save_json(root / "tokenizer.json", image_token=True)
    save_hf_checkpoint(synthetic_model(matrix_config(tok), seed=3), root / "ckpt", tokenizer=tok)
    return root


def _env(devices: int, hold=None) -> dict:
    """hold: the file that holds a full batch (`worker.HOLD_ENV`) while it exists."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "JAX_PLATFORMS": "cpu",
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", HOLD_ENV: str(hold or "")}


def _cmd(root, name, port, *extra):
    return [sys.executable, "-m", "dsv41_jax.cli", "serve", "--checkpoint", str(root / "ckpt"), "--port", str(port),
            "--numerics", "exact", "--exact-prefill", "--max-batch", "2", "--prefill-chunk", "64",
            "--max-model-len", str(MAX_LEN), "--prefix-cache-dir", str(root / f"conv-{name}"), "--quiet",
            "--no-warm", *extra]


class Fleet:
    """The deployments' servers, each started on first use and stopped with the module."""

    def __init__(self, root):
        self.root, self.procs, self.urls, self.answers = root, {}, {}, {}

    def url(self, name: str, *extra) -> str:
        if name not in self.urls:
            processes, devices, flags = DEPLOYMENTS[name]
            log = self.root / f"{name}.log"
            if processes == 1:
                start = lambda port: subprocess.Popen(_cmd(self.root, name, port, *flags, *extra),  # noqa: E731
                                                      env=_env(devices, self.hold(name)), stderr=open(log, "w"))
            else:
                coordinator, lock = reserve_port()
                self.procs[name + "-lock"] = lock

                def start(port):
                    procs = [subprocess.Popen(_cmd(self.root, name, port, *flags, *extra, "--coordinator",
                                                   f"127.0.0.1:{coordinator}", "--num-processes", str(processes),
                                                   "--process-id", str(i)), env=_env(devices, self.hold(name)),
                                              stderr=open(f"{log}.{i}" if i else log, "w"), stdout=subprocess.DEVNULL)
                             for i in range(processes)]
                    for i, p in enumerate(procs[1:], 1):
                        self.procs[f"{name}-{i}"] = p
                    return procs[0]
            launch({name: start}, self.procs, self.urls)
            wait_ready({name: self.procs[name]}, {name: self.urls[name]}, {name: log})
        return self.urls[name]

    def hold(self, name: str):
        """The file whose existence holds deployment `name`'s full batch (`worker.HOLD_ENV`)."""
        return self.root / f"{name}.hold"

    def close(self):
        locks = [self.procs.pop(k) for k in [k for k in self.procs if k.endswith("-lock")]]
        stop(self.procs)
        for lock in locks:
            lock.close()


@pytest.fixture(scope="module")
def fleet(checkpoint):
    f = Fleet(checkpoint)
    yield f
    f.close()


def _message(m) -> dict:
    """A chat message, less its tool calls' ids (drawn at random per reply, as OpenAI's are)."""
    out = m.model_dump()
    for call in out.get("tool_calls") or ():
        call["id"] = None
    return out


def _chat(r) -> dict:
    """A chat reply as the client sees it, less its id and time."""
    return {"choices": [{"message": _message(c.message), "logprobs": c.logprobs and c.logprobs.model_dump(),
                         "finish_reason": c.finish_reason} for c in r.choices], "usage": r.usage.model_dump()}


def _text(r) -> dict:
    """A completion as the client sees it, less its id and time."""
    return {"choices": [{"text": c.text, "logprobs": c.logprobs and c.logprobs.model_dump(),
                         "finish_reason": c.finish_reason} for c in r.choices], "usage": r.usage.model_dump()}


def _spec_metrics(url) -> dict:
    fams = text_string_to_metric_families(httpx.get(url + "/metrics").text)
    return {f.name: f.samples[0].value for f in fams if f.name.startswith("dsv41_spec_")}


def answers(fleet: Fleet, name: str) -> dict:
    """Every feature's answer from deployment `name` (computed once per deployment)."""
    if name in fleet.answers:
        return fleet.answers[name]
    url = fleet.url(name)
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=900)
    kw = dict(model="ckpt", temperature=0, logit_bias=LETTERS)
    chat = lambda messages, **k: client.chat.completions.create(messages=messages, **{**kw, **k})  # noqa: E731
    out = {}
    q1 = [{"role": "user", "content": "what is the weather in paris"}]
    r1 = chat(q1, max_tokens=8, logprobs=True, top_logprobs=2)
    out["chat"] = _chat(r1)
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(q1, max_tokens=8, stream=True) if c.choices)
    out["stream"] = {"choices": [{"text": streamed}]}
    q2 = q1 + [{"role": "assistant", "content": r1.choices[0].message.content},
               {"role": "user", "content": "and tomorrow"}]
    out["resumed"] = _chat(chat(q2, max_tokens=6, logprobs=True))
    out["sampled"] = _chat(chat(q1, max_tokens=8, logprobs=True, top_logprobs=3, temperature=1.0, top_p=0.9, seed=7))
    out["n"] = _chat(chat(q1, max_tokens=5, n=2, temperature=1.0, seed=5))
    out["penalties"] = _chat(chat(q1, max_tokens=8, frequency_penalty=1.0, presence_penalty=0.5, logprobs=True))
    hi = [{"role": "user", "content": "hi"}]
    out["thinking"] = [_chat(chat(hi, max_tokens=4, reasoning_effort="high")) for _ in range(2)]
    out["completion"] = _text(client.completions.create(model="ckpt", prompt="def f", max_tokens=6, temperature=0,
                                                        logprobs=2))
    out["echo"] = _text(client.completions.create(model="ckpt", prompt="def f", max_tokens=1, temperature=0,
                                                  echo=True, logprobs=2))
    out["echo_only"] = _text(client.completions.create(model="ckpt", prompt="def fun", max_tokens=0, echo=True,
                                                       logprobs=1))
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA, "strict": True}}
    out["json"] = _chat(chat(q1, max_tokens=60, response_format=fmt, logprobs=True))
    out["json_sampled"] = _chat(chat(q1, max_tokens=60, response_format=fmt, temperature=1.0, seed=3))
    out["regex"] = _text(client.completions.create(model="ckpt", prompt="def f", max_tokens=12, temperature=0,
                                                   extra_body={"structured_outputs": {"regex": REGEX}}))
    out["grammar"] = _text(client.completions.create(model="ckpt", prompt="ok?", max_tokens=8, temperature=0,
                                                     extra_body={"structured_outputs": {"grammar": LARK}}))
    # one call each (a random model may call again and again); a call is about 250 byte-level tokens
    out["named_tool"] = _chat(chat(q1, max_tokens=600, tools=[PICK], parallel_tool_calls=False,
                                   tool_choice={"type": "function", "function": {"name": "pick"}}))
    out["required_tool"] = _chat(chat(q1, max_tokens=600, tools=[PICK], tool_choice="required", temperature=1.0,
                                      seed=11, parallel_tool_calls=False))
    look = [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url",
                                                                         "image_url": {"url": RED}}]}]
    first = chat(look, max_tokens=6, logprobs=True)
    out["image"] = _chat(first)
    again = look + [{"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": [{"type": "text", "text": "and this"},
                                                 {"type": "image_url", "image_url": {"url": BLUE}}]}]
    out["image_resumed"] = _chat(chat(again, max_tokens=6, logprobs=True))
    out["spec"] = _spec_metrics(url)
    fleet.answers[name] = out
    return out


def _check_valid(out: dict) -> None:
    """What every deployment's replies must be, whatever the model: constrained replies valid, echo's
    logprobs one per prompt token, the image and text conversations resumed."""
    first = lambda key: out[key]["choices"][0]  # noqa: E731
    for key in ("json", "json_sampled"):
        assert first(key)["finish_reason"] == "stop", out[key]
        jsonschema.validate(json.loads(first(key)["message"]["content"]), SCHEMA)
    assert re.fullmatch(REGEX, first("regex")["text"]) and first("regex")["finish_reason"] == "stop", out["regex"]
    assert first("grammar")["text"] in ("yes", "no", "maybe"), out["grammar"]
    for key in ("named_tool", "required_tool"):
        assert first(key)["finish_reason"] == "tool_calls" and first(key)["message"]["tool_calls"], out[key]
        for call in first(key)["message"]["tool_calls"]:
            assert call["function"]["name"] == "pick"
            jsonschema.validate(json.loads(call["function"]["arguments"]), PICK["function"]["parameters"])
        assert len(first(key)["message"]["tool_calls"]) == 1  # parallel_tool_calls false
    echo = first("echo")
    lps = echo["logprobs"]["token_logprobs"]
    assert echo["text"].startswith("def f") and lps[0] is None and None not in lps[1:]
    assert first("echo_only")["text"] == "def fun" and out["echo_only"]["usage"]["completion_tokens"] == 0
    # the second turns resumed the stored first ones (an image's positions match on its pixels)
    assert out["resumed"]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert out["image_resumed"]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert out["thinking"][1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["one", "mesh", "two"])
def test_every_feature_answers_alike_on_every_deployment(fleet, name):
    out = answers(fleet, name)
    _check_valid(out)
    assert out["spec"]["dsv41_spec_drafted_tokens"] > 0  # the drafter ran (greedy replies speculate)
    if name != "one":
        ref = answers(fleet, "one")
        assert {k: v for k, v in out.items() if v != ref[k]} == {}


@pytest.mark.slow
def test_speculation_and_host_tables_decode_as_plain_decoding(fleet):
    """Text, tool calls and finish reasons of every reply equal those of a plain one-device server (no
    speculation, Engram tables on the device); logprobs are not compared (the verify step computes them
    over K+1 positions at once)."""
    def decisions(reply: dict) -> list:
        return [{k: v for k, v in c.items() if k != "logprobs"} for c in reply["choices"]]

    spec, plain = answers(fleet, "one"), answers(fleet, "plain")
    for key in spec:
        if key == "spec":
            continue
        replies = spec[key] if isinstance(spec[key], list) else [spec[key]]
        oracle = plain[key] if isinstance(plain[key], list) else [plain[key]]
        assert [decisions(r) for r in replies] == [decisions(r) for r in oracle], key
    assert plain["spec"] == {} and spec["spec"]["dsv41_spec_drafted_tokens"] > 0


def new_features(url) -> dict:
    """One request per feature that used to be refused across processes: echo's prompt logprobs, a JSON
    schema, an image, and a greedy reply the drafter speculates on."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=900)
    kw = dict(model="ckpt", temperature=0, logit_bias=LETTERS)
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA, "strict": True}}
    look = [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url",
                                                                         "image_url": {"url": RED}}]}]
    before = _spec_metrics(url)  # the counters are the server's since it started: this call's share
    out = {"echo": _text(client.completions.create(model="ckpt", prompt="def f", max_tokens=1, temperature=0,
                                                    echo=True, logprobs=2)),
            "json": _chat(client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], max_tokens=40,
                                                         response_format=fmt, **kw)),
            "image": _chat(client.chat.completions.create(messages=look, max_tokens=4, logprobs=True, **kw))}
    after = _spec_metrics(url)
    out["spec"] = {k: after[k] - before[k] for k in ("dsv41_spec_drafted_tokens", "dsv41_spec_accepted_tokens")}
    return out


@pytest.mark.slow
def test_new_features_across_two_processes(fleet):
    """Two cold processes answer echo, a constrained reply, an image and a speculated reply as one device
    does, field by field (logprobs bitwise, the drafter's counts): the matrix's new cells in brief (4 min
    here; the default suite's cell is the engine's, tests/serving/test_engine_multihost.py)."""
    two, one = new_features(fleet.url("two")), new_features(fleet.url("one"))
    jsonschema.validate(json.loads(two["json"]["choices"][0]["message"]["content"]), SCHEMA)
    assert two["spec"]["dsv41_spec_drafted_tokens"] > 0
    assert two == one


@pytest.mark.slow
def test_a_killed_follower_fails_open_image_constrained_and_speculative_requests(fleet):
    """Process 1 is killed while process 0 streams an image reply, a constrained reply and a speculated
    reply (the batch holds two: the image, which starts first, and one of the others; the third waits):
    each stream ends with the error naming process 1, and process 0 exits non-zero (the test bounds
    that it ends, generously, not how fast). Process 0 holds its full batch with a request waiting
    (`worker.HOLD_ENV`) until the kill, so no request can finish before it."""
    import signal
    import threading
    import time

    hold = fleet.hold("kill")
    hold.touch()  # before the deployment starts: the batch is held as soon as it is full

    client = openai.OpenAI(base_url=fleet.url("kill") + "/v1", api_key="none", max_retries=0, timeout=900)
    kw = dict(model="ckpt", temperature=0, logit_bias=LETTERS, max_tokens=200, stream=True)
    look = [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image_url",
                                                                         "image_url": {"url": RED}}]}]
    bodies = {"image": dict(messages=look), "speculated": dict(messages=[{"role": "user", "content": "hi"}]),
              "constrained": dict(messages=[{"role": "user", "content": "hi"}],
                                  extra_body={"structured_outputs": {"regex": "[a-z]{200}"}})}
    started, errors = threading.Event(), {}

    def run(name):
        try:
            for chunk in client.chat.completions.create(**bodies[name], **kw):
                if chunk.choices and chunk.choices[0].delta.content:
                    started.set()
            errors[name] = None
        except openai.APIError as e:
            errors[name] = str(e)

    threads = {name: threading.Thread(target=run, args=(name,)) for name in bodies}
    threads["image"].start()  # running first: the batch holds it when the other two arrive
    assert started.wait(600), (fleet.root / "kill.log").read_text()[-3000:]
    for name in ("speculated", "constrained"):
        threads[name].start()
    held = hold.with_name(hold.name + ".held")
    deadline = time.monotonic() + 600
    while not held.exists():  # process 0 holds its full batch: two requests running, the third waiting
        assert time.monotonic() < deadline and fleet.procs["kill"].poll() is None, \
            (fleet.root / "kill.log").read_text()[-3000:]
        time.sleep(0.1)
    fleet.procs["kill-1"].send_signal(signal.SIGKILL)
    hold.unlink()  # the next step meets the dead process (or the watchdog answers first)
    for t in threads.values():
        t.join(600)
    assert set(errors) == set(bodies), errors
    for name, err in errors.items():
        assert err is not None and "process 1" in err and "stopped answering" in err, (name, err)
    t0 = time.monotonic()
    code = fleet.procs["kill"].wait(timeout=300)  # generous: the bound is --process-timeout + about 2 s
    assert code != 0, (fleet.root / "kill.log").read_text()[-3000:]
    print(f"process 0 exited {code} {time.monotonic() - t0:.1f} s after the error answers")
