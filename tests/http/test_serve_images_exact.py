"""Images through `dsv41 serve` in exact numerics, bit for bit.

A real `dsv41 serve --numerics exact --exact-prefill` process on a tiny vision checkpoint (config and
byte-level tokenizer agree on the image token) answers the `openai` client; the oracle is a separate
process (exact numerics need float64, which is not switched on inside the test process) that builds the
prompt and spans from the same images with the vision modules and runs `model.forward`: a prefill of
the whole prompt, then one decode step per greedy token. One prefill chunk on both sides, so the
schedules match and every logprob must be equal, not close.

A second server prefills in chunks of 8, so chunk boundaries fall inside the image spans: exact mode
reproduces torch's per-call scalar tails, so that schedule is compared on its decisions (the greedy
tokens), not bitwise.

Split prefill (CED, the server's default): a server on a splittable vision checkpoint answers as the
split-prefill driver called directly on the oracle's spans (first token and every top logprob equal),
and the oracle checks that the driver's first decoder layer selects as exact prefill does.
"""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

import numpy as np
import pytest

openai = pytest.importorskip("openai")

from dsv41_jax.checkpoint.hf_writer import save_hf_checkpoint  # noqa: E402
from dsv41_jax.checkpoint.synthetic import synthetic_model  # noqa: E402
from dsv41_jax.train.data import ByteTokenizer  # noqa: E402
from tests.support.serve_process import launch, stop, wait_ready  # noqa: E402
from test_serve_images import BLUE, RED, image_part, vision_config  # noqa: E402

pytestmark = pytest.mark.slow
N_TOKENS = 3
ORACLE = r"""
import base64, json, sys
import jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp, numpy as np
from flax import nnx
from dsv41_jax.checkpoint.hf_loader import load_checkpoint
from dsv41_jax.model.transformer import make_step
from dsv41_jax.runtime import Runtime
from dsv41_jax.serving import buckets
from dsv41_jax.serving.http.server import banned_ids
from dsv41_jax.text.chat import encode_chat_ids
from dsv41_jax.text.tokenizer import load_tokenizer
from dsv41_jax.vision.merge import make_image_encoder, span_rows
from dsv41_jax.vision.processor import decode_image, expand_prompt

folder, requests, n_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
cfg, model, _ = load_checkpoint(folder, progress=False)
tok = load_tokenizer(folder + "/tokenizer.json")
rt = Runtime(mode="exact")
gd, params = nnx.split(model)
step, encode = make_step(gd, rt), make_image_encoder(gd, rt)
banned = banned_ids(cfg, tok)


def prompt_and_spans(content):  # the message's ids with each image's span expanded, and the spans
    ids = encode_chat_ids(tok, [{"role": "user", "content": content}], thinking=False, images=True)
    pictures = [decode_image(base64.b64decode(p["image_url"]["url"].split(",", 1)[1]))
                for p in content if p["type"] == "image_url"]
    tokens, types, inputs = expand_prompt(ids, pictures, cfg)
    embeds = [np.asarray(encode(params, im.patches, im.n_vit_h, im.n_vit_w)[1]) for im in inputs]
    rows = span_rows(model, np.asarray(types), inputs, embeds)
    return tokens, (jnp.asarray(rows[None]), jnp.asarray(np.asarray(types)[None], jnp.int32))


out = []
for content in requests:
    tokens, spans = prompt_and_spans(content)
    cache = buckets.empty_cache(cfg, 1, cfg.max_seq_len)
    logits, cache, _ = step(params, jnp.asarray([tokens], jnp.int32), cache, None, None, None, spans)
    got, tops = [], []
    for i in range(n_tokens):
        row = np.array(logits[0, -1], np.float32)
        row[banned] = -np.inf
        lp = np.asarray(jax.nn.log_softmax(jax.device_get(jnp.asarray(row))))
        t = int(np.argmax(lp))
        got.append(t)
        tops.append(sorted(lp.tolist(), reverse=True)[:5])
        logits, cache, _ = step(params, jnp.asarray([[t]], jnp.int32), cache)
    out.append({"tokens": got, "top": tops, "prompt_tokens": len(tokens)})
print(json.dumps(out))
"""


SPLIT_ORACLE = ORACLE.split("out = []")[0] + r"""
from dsv41_jax.serving import split_prefill as sp
split = sp.make_split_prefill(gd, rt, collect_topk=True)
exact = sp.make_exact_prefill(gd, rt, collect_topk=True)
out = []
for content in requests:
    tokens, spans = prompt_and_spans(content)
    t = jnp.asarray([tokens], jnp.int32)
    logits, _, aux = split(params, t, buckets.empty_cache(cfg, 1, cfg.max_seq_len), None, spans=spans)
    _, _, e_aux = exact(params, t, buckets.empty_cache(cfg, 1, cfg.max_seq_len), None, spans=spans)
    d = cfg.decoder_start
    n = aux["topk"][d].shape[1]
    row = np.array(logits[0, -1], np.float32)
    row[banned] = -np.inf
    lp = np.asarray(jax.nn.log_softmax(jnp.asarray(row)))
    out.append({"tokens": [int(np.argmax(lp))], "top": [sorted(lp.tolist(), reverse=True)[:5]],
                "prompt_tokens": len(tokens), "tail": int(n),
                "first_decoder_layer_equal": bool(np.array_equal(aux["topk"][d], e_aux["topk"][d][:, -n:])
                                                  and np.array_equal(aux["pool"], e_aux["pool"][:, -n:]))})
print(json.dumps(out))
"""


def _serve(folder, port, chunk, log, exact_prefill=True):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "dsv41_jax.cli", "serve", "--checkpoint", str(folder), "--port", str(port),
           "--numerics", "exact", *(["--exact-prefill"] if exact_prefill else []), "--max-batch", "1",
           "--prefill-chunk", str(chunk), "--max-model-len", "512", "--quiet"]
    return subprocess.Popen(cmd, env=env, stderr=open(log, "w"))


def test_image_requests_in_exact_numerics_equal_forward_bitwise(tmp_path):
    folder = tmp_path / "ckpt"
    tok = ByteTokenizer().save_json(tmp_path / "tokenizer.json", image_token=True)
    save_hf_checkpoint(synthetic_model(vision_config(), seed=3), folder, tokenizer=tok)
    requests = [[{"type": "text", "text": "look"}, image_part(RED)],
                [{"type": "text", "text": "compare"}, image_part(RED), {"type": "text", "text": "with"},
                 image_part(BLUE)]]
    procs, urls = {}, {}
    starts = {name: (lambda port, name=name, chunk=chunk: _serve(folder, port, chunk, tmp_path / f"{name}.log"))
              for name, chunk in (("one_chunk", 512), ("chunks_of_8", 8))}
    try:
        launch(starts, procs, urls)
        oracle = subprocess.run([sys.executable, "-c", ORACLE, str(folder), json.dumps(requests), str(N_TOKENS)],
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, capture_output=True,
                                text=True, timeout=1800)
        assert oracle.returncode == 0, oracle.stderr[-4000:]
        want = json.loads(oracle.stdout.strip().splitlines()[-1])
        wait_ready(procs, urls, {name: tmp_path / f"{name}.log" for name in urls}, starts=starts)
        for name, url in urls.items():
            client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=900)
            served = client.models.list().data[0].id
            for content, w in zip(requests, want):
                r = client.chat.completions.create(model=served, messages=[{"role": "user", "content": content}],
                                                   max_tokens=N_TOKENS, temperature=0, logprobs=True, top_logprobs=5)
                assert r.usage.prompt_tokens == w["prompt_tokens"]
                entries = r.choices[0].logprobs.content
                # token texts of bytes that are not UTF-8 print alike (U+FFFD); the logprobs after them pin them
                assert [bytes(e.bytes) for e in entries] == [ByteTokenizer().decode([t]).encode() for t in w["tokens"]]
                if name == "one_chunk":  # the same schedule as the oracle: every logprob equal
                    tops = [sorted((t.logprob for t in e.top_logprobs), reverse=True) for e in entries]
                    assert tops == w["top"], (name, len(content))
    finally:
        stop(procs)


def test_image_requests_through_split_prefill_equal_the_split_driver(tmp_path):
    from dsv41_jax.config import ModelConfig

    cfg = ModelConfig.tiny_vision(n_layers=5, compress_ratios=(0, 2, 1, 1, 1), kv_source_layers=(1, 2),
                                  index_source_layers=(1, 2, 3), candidate_source_layer=2, engram_layer_ids=(),
                                  n_routed_experts=4, max_seq_len=512, max_batch_size=2)
    folder = tmp_path / "ckpt"
    tok = ByteTokenizer().save_json(tmp_path / "tokenizer.json", image_token=True)
    save_hf_checkpoint(synthetic_model(cfg, seed=4), folder, tokenizer=tok)
    requests = [[{"type": "text", "text": "look"}, image_part(RED)],
                [{"type": "text", "text": "compare"}, image_part(RED), {"type": "text", "text": "with"},
                 image_part(BLUE)]]
    procs, urls = {}, {}
    starts = {"split": lambda port: _serve(folder, port, 512, tmp_path / "split.log", exact_prefill=False)}
    try:
        launch(starts, procs, urls)
        oracle = subprocess.run([sys.executable, "-c", SPLIT_ORACLE, str(folder), json.dumps(requests), "1"],
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}, capture_output=True,
                                text=True, timeout=1800)
        assert oracle.returncode == 0, oracle.stderr[-4000:]
        want = json.loads(oracle.stdout.strip().splitlines()[-1])
        wait_ready(procs, urls, {"split": tmp_path / "split.log"}, starts=starts)
        client = openai.OpenAI(base_url=urls["split"] + "/v1", api_key="x", max_retries=0, timeout=900)
        served = client.models.list().data[0].id
        for content, w in zip(requests, want):
            assert w["prompt_tokens"] > w["tail"], w  # the prompt is split: Graph A, then Graph B on the tail
            assert w["first_decoder_layer_equal"], w
            r = client.chat.completions.create(model=served, messages=[{"role": "user", "content": content}],
                                               max_tokens=1, temperature=0, logprobs=True, top_logprobs=5)
            assert r.usage.prompt_tokens == w["prompt_tokens"]
            entries = r.choices[0].logprobs.content
            assert [bytes(e.bytes) for e in entries] == [ByteTokenizer().decode([t]).encode() for t in w["tokens"]]
            tops = [sorted((t.logprob for t in e.top_logprobs), reverse=True) for e in entries]
            assert tops == w["top"], len(content)
    finally:
        stop(procs)
