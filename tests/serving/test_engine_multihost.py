"""The serving engine on a mesh spanning two processes, driven in lockstep.

Process 0 runs the engine and publishes every engine call (submit, step) through
`serving.lockstep.Channel` before making it; process 1 makes the same calls on its own engine
and serves nothing. Oracle: the same engine in one process over all 8 devices. A greedy and a
seeded temperature-1 request give the same tokens and the same top log-probabilities, bit for bit
(fast numerics: the steps' logits are replicated, so the sampler sums whole rows either way; slow).

`test_echo_constrained_image_and_speculated_requests_across_two_processes` (the default suite's): the
features whose work used to run beside the lockstep (echo's scoring pass, the grammar matcher, the
vision tower) and speculation, two processes of one device against one device, exact numerics.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]

SCENARIO = r'''
import argparse, json, os, sys
n, pid = int(sys.argv[2]), int(sys.argv[3])
if n > 1:
    from dsv41_jax.cli.distributed import join
    join(argparse.Namespace(coordinator=sys.argv[1], num_processes=n, process_id=pid), "engine-multihost")
import numpy as np
from dsv41_jax.config import ModelConfig
from dsv41_jax.serving.engine import Engine, Request
from dsv41_jax.serving.random_weights import random_model
from dsv41_jax.serving.sampling import SamplingParams
from sharding.mesh import make_mesh
from sharding.serving import engine_strategies
cfg = ModelConfig.tiny(max_seq_len=64, n_routed_experts=8, vocab_size=256, engram_layer_ids=())
model = random_model(cfg, seed=7)
# the engine's own fingerprint: on a mesh across processes each tensor's digest is taken on the devices
eng = Engine(model, slots=2, min_capacity=64, prefill_chunk=8,
             **engine_strategies(make_mesh("expert=4,tensor=2"), "inference"))
reqs = [Request([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=5), request_id="a", want_logprobs=True),
        Request([7, 8, 9], SamplingParams(max_tokens=5, temperature=1.0, seed=3), request_id="b", want_logprobs=True)]
seen, out = {}, {}
ch = None
if n > 1:
    from dsv41_jax.serving.lockstep import Channel
    ch = Channel()
if pid == 0:
    for r in reqs:
        if ch: ch.publish(("submit", r))  # before the callback is attached: commands carry no callables
        r.on_token = (lambda rid: lambda tok, lp: seen.setdefault(rid, []).append(float(np.max(lp))))(r.request_id)
        eng.submit(r)
    while not eng.idle():
        if ch: ch.publish(("step",))
        for res in eng.step():
            out[res.request_id] = res.tokens
    if ch: ch.publish(("stop",))
    print(json.dumps({"tokens": out, "top_logprob": seen, "fingerprint": eng.fingerprint}), flush=True)
else:
    steps = 0
    while True:
        cmd = ch.receive(timeout=600)
        if cmd[0] == "submit":
            eng.submit(cmd[1])
        elif cmd[0] == "step":
            eng.step()
            steps += 1
        else:
            break
    print(json.dumps({"steps": steps, "fingerprint": eng.fingerprint}), flush=True)
os._exit(0)  # not jax.distributed.shutdown's barrier
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(processes: int, devices: int, tmp: pathlib.Path) -> list[dict]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "-c", SCENARIO, f"127.0.0.1:{port}", str(processes), str(i)], cwd=REPO,
                              env=env, stdout=subprocess.PIPE, stderr=open(tmp / f"err{processes}.{i}", "w"), text=True)
             for i in range(processes)]
    out = []
    try:
        for i, p in enumerate(procs):
            stdout, _ = p.communicate(timeout=900)
            assert p.returncode == 0, (tmp / f"err{processes}.{i}").read_text()[-3000:]
            out.append(json.loads([l for l in stdout.splitlines() if l.startswith("{")][-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


@pytest.mark.slow
def test_engine_across_two_processes_equals_one_process(tmp_path):
    one = _run(1, 8, tmp_path)[0]
    leader, follower = _run(2, 4, tmp_path)
    assert leader == one  # tokens, top log-probabilities (floats through JSON: bitwise) and the fingerprint
    assert follower["steps"] >= 4 and set(one["tokens"]) == {"a", "b"}
    # every process names the weights as one process does (conversation caches are keyed on it)
    assert follower["fingerprint"] == one["fingerprint"]


FEATURES = r'''
import argparse, base64, io, json, os, sys
coordinator, pid, tmp = sys.argv[1], sys.argv[2], sys.argv[3]  # pid: "0", "1" or "one" (the oracle)
if pid != "one":
    from dsv41_jax.cli.distributed import join
    join(argparse.Namespace(coordinator=coordinator, num_processes=2, process_id=int(pid)), "lockstep-features")
import jax
jax.config.update("jax_enable_x64", True)  # exact numerics: a mesh's split sums round as one device's
import numpy as np
from PIL import Image
from dsv41_jax.config import ModelConfig
from dsv41_jax.runtime import Runtime
from dsv41_jax.serving.constraints import Grammars
from dsv41_jax.serving.engine import Engine, Request
from dsv41_jax.serving.generate import banned_ids
from dsv41_jax.serving.http.images import ImageOptions, ImagePrompter
from dsv41_jax.serving.lockstep import Channel, LeaderEngine, follow
from dsv41_jax.serving.random_weights import random_model
from dsv41_jax.serving.sampling import SamplingParams
from dsv41_jax.text.tokenizer import load_tokenizer
from sharding.mesh import make_mesh
from sharding.serving import engine_strategies
tok = load_tokenizer(os.path.join(tmp, "tokenizer.json"))
cfg = ModelConfig.tiny_vision(n_layers=1, compress_ratios=(0,), kv_source_layers=(), index_source_layers=(),
                              candidate_source_layer=-1, engram_layer_ids=(), n_routed_experts=4, max_seq_len=128,
                              n_mtp_layers=1, dspark_block_size=2, dspark_noise_token_id=3,
                              dspark_target_layer_ids=(0,), dspark_markov_rank=16, dspark_n_routed_experts=4,
                              dspark_n_activated_experts=2)
model = random_model(cfg, seed=7)
settings = dict(slots=2, min_capacity=128, prefill_chunk=8, exact_prefill=True, speculative=2,
                runtime=Runtime(mode="exact"), banned_ids=tuple(banned_ids(cfg, tok)))
grammars = Grammars(tok, cfg.vocab_size)
buf = io.BytesIO()
Image.new("RGB", (12, 9), (220, 20, 20)).save(buf, "PNG")
# "look at it" and the 12 x 9 image make a 24-token prompt: every prompt here is a whole number of
# prefill pieces of 8 (exact numerics compiles a piece program per remainder length, `steps.piece_set`)
look = [{"role": "user", "content": [{"type": "text", "text": "look at it"}, {"type": "image_url", "image_url": {
    "url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}}]}]


def answers(eng):
    """An echo's prompt logprobs, a constrained reply, an image reply and a speculated reply on `eng`."""
    out, rows = {"echo": eng.prompt_logprobs([0, 70, 80, 90, 100, 110, 120, 121])}, {}
    made = ImagePrompter(eng, ImageOptions()).build(tok, look, thinking=False)
    assert len(made.tokens) == 24, len(made.tokens)
    sp = lambda n: SamplingParams(max_tokens=n, stop_tokens=(tok.eos_id,))
    regex = grammars.constraint(grammars.regex("[a-c]{2}x"))
    reqs = [Request([0, 70, 80, 81, 82, 83, 84, 85], sp(6), request_id="regex", constraint=regex),
            Request(made.tokens, sp(4), request_id="image", spans=made.spans),
            Request([0, 71, 72, 73, 74, 75, 76, 77], sp(8), request_id="speculated")]
    for r in reqs:
        r.want_logprobs = True
        r.on_token = (lambda rid: lambda t, lp: rows.setdefault(rid, []).append((t, float(lp[t]))))(r.request_id)
        eng.submit(r)
    while not eng.idle():  # the calls themselves (Engine.run would reach past a LeaderEngine's publishing)
        eng.step()
    for r in reqs:
        out[r.request_id] = (eng.done[r.request_id].tokens, rows[r.request_id])
    out["spec_stats"] = dict(eng.spec_stats)
    return out


try:
    if pid == "one":  # one device, no collectives
        print(json.dumps(answers(Engine(model, **settings))), flush=True)
        os._exit(0)
    mesh_engine = Engine(model, **settings, **engine_strategies(make_mesh("expert=2"), "inference"))
    channel = Channel()
    if pid == "1":
        follow(mesh_engine, channel, grammars=lambda: grammars)
        os._exit(0)
    print(json.dumps(answers(LeaderEngine(mesh_engine, channel))), flush=True)
    channel.publish(("stop",))
    channel.drained(timeout=60)
except BaseException:
    import traceback
    traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)  # at once: jax.distributed.shutdown's barrier would wait minutes for the other process
os._exit(0)
'''


# slow: three processes compiling every step kind in exact numerics on two cores took 117-266 s of the
# default suite (over its budget, and it starves the other xdist worker meanwhile);
# tests/serving/test_lockstep.py keeps the default suite's cross-process check of the lockstep itself
@pytest.mark.slow
def test_echo_constrained_image_and_speculated_requests_across_two_processes(tmp_path):
    """Two processes of one CPU device each, one mesh `expert=2` over both, driven in lockstep
    (`LeaderEngine` on process 0, `follow` on process 1): an echo's prompt logprobs (the scoring pass
    published), a regex-constrained reply (each process runs its own matcher), an image reply (the
    tower published, the span rows sent with the submit) and greedy speculation give the tokens and
    logprobs (bitwise, exact numerics) and the drafter's counts of one device in a third process (the
    oracle, run beside the pair: the two cores compile both at once). The default suite's cross-process
    check of those features: one request each, every prompt a whole number of prefill pieces, so each
    process compiles one program per step kind."""
    from dsv41_jax.train.data import ByteTokenizer

    ByteTokenizer().save_json(tmp_path / "tokenizer.json", image_token=True)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=1",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    port = _free_port()
    procs = {pid: subprocess.Popen([sys.executable, "-c", FEATURES, f"127.0.0.1:{port}", pid, str(tmp_path)],
                                   cwd=REPO, env=env, stdout=subprocess.PIPE, text=True,
                                   stderr=open(tmp_path / f"err{pid}", "w"))
             for pid in ("0", "1", "one")}
    out = {}
    try:
        for pid in ("0", "one"):
            stdout, _ = procs[pid].communicate(timeout=900)
            assert procs[pid].returncode == 0, (tmp_path / f"err{pid}").read_text()[-3000:]
            out[pid] = json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])
        assert procs["1"].wait(timeout=120) == 0, (tmp_path / "err1").read_text()[-3000:]
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    across, one = out["0"], out["one"]
    assert re.fullmatch("[a-c]{2}x", bytes(t - 8 for t in across["regex"][0][:-1]).decode()), across["regex"]
    assert across["spec_stats"]["drafted"] > 0 and len(across["echo"][0]) == 8
    assert across == one
