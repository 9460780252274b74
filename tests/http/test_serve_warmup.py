"""Warm start: `dsv41 serve` compiles every program before /ready says ready, and after
that no request compiles anything, whatever its prompt length.

"Compiles" is counted with JAX's own monitoring events (an XLA compile or a persistent-cache
load), so the test fails if any program a request needs was missed by the warm-up.
"""
from __future__ import annotations

import contextlib
import threading

import httpx
import pytest

from dsv41_jax.checkpoint.synthetic import synthetic_model
from dsv41_jax.config import ModelConfig
from dsv41_jax.serving.engine import Engine, EngineSettings, Request, pieces
from dsv41_jax.serving.http.server import BackgroundServer, ServeOptions, build
from dsv41_jax.serving.sampling import SamplingParams
from dsv41_jax.serving.steps import piece_set
from dsv41_jax.serving.warmup import piece_sizes, program_list, warm
from dsv41_jax.text.tokenizer import load_tokenizer
from dsv41_jax.train.data import ByteTokenizer

_counting = []


def _on_duration(event, duration, **_):
    if _counting and event == "/jax/core/compile/backend_compile_duration":
        _counting[-1].append(event)


def _on_event(event, **_):
    if _counting and event == "/jax/compilation_cache/cache_hits":
        _counting[-1].append(event)


_listening = False


@contextlib.contextmanager
def count_compiles():
    """The XLA compiles and persistent-cache loads that happen inside the block."""
    global _listening
    from jax._src import monitoring

    if not _listening:  # listeners cannot be removed; one pair for the module, inert outside blocks
        monitoring.register_event_duration_secs_listener(_on_duration)
        monitoring.register_event_listener(_on_event)
        _listening = True
    seen = []
    _counting.append(seen)
    try:
        yield seen
    finally:
        _counting.remove(seen)


def tiny_app(folder, max_len: int, seed: int = 1, **opts):
    """(app, worker) of `build` on a one-layer tiny model (SWA, MoE, mHC) with the byte tokenizer,
    2 slots, chunk 16, exact prefill: the cheapest model the whole serving path runs on."""
    cfg = ModelConfig.tiny(vocab_size=ByteTokenizer().vocab_size, n_layers=1, compress_ratios=(0,),
                           kv_source_layers=(), index_source_layers=(), candidate_source_layer=-1,
                           engram_layer_ids=(), n_routed_experts=4, max_seq_len=max_len, max_batch_size=2)
    tokenizer = load_tokenizer(ByteTokenizer().save_json(folder / "tokenizer.json"))
    return build(synthetic_model(cfg, seed=seed), tokenizer,
                 ServeOptions(model_name="tiny", engine=EngineSettings(slots=2, max_seq_len=max_len, prefill_chunk=16,
                                                                       exact_prefill=True), **opts))


@pytest.mark.parametrize("padded", [True, False])
@pytest.mark.parametrize("chunk", [1, 3, 8, 16, 100, 512])
def test_piece_sizes_are_those_of_every_reachable_length(chunk, padded):
    for lo, hi in [(1, 1), (1, 7), (5, 63), (129, 8191), (300, 310), (9, 8)]:
        want = sorted({s for n in range(lo, hi + 1) for s in pieces(n, chunk, padded)})
        assert piece_sizes(lo, hi, chunk, padded) == want, (lo, hi)


@pytest.mark.parametrize("chunk", [1, 3, 8, 16, 100, 512])
def test_pieces_cover_a_prompt_with_only_the_last_padded(chunk):
    """Padded: the shapes of `piece_set`, at most one of them (the last) with padding, by less than the
    next smaller shape (or less than the smallest); unpadded: exactly n tokens in the old shapes."""
    shapes = set(piece_set(chunk))
    assert len(shapes) <= 4
    for n in range(1, 3 * chunk + 70):
        got = pieces(n, chunk)
        assert set(got) <= shapes and 0 <= sum(got) - n < max(got[-1] // 4, min(shapes)), (n, got)
        assert sum(got[:-1]) < n, (n, got)  # only the last piece holds padding
        exact = pieces(n, chunk, padded=False)
        assert sum(exact) == n and all(s == chunk or s & (s - 1) == 0 for s in exact), (n, exact)


def test_warm_server_reports_ready_after_compiling_and_then_no_request_compiles(tmp_path):
    """After /ready, every request kind at several lengths (completions, chat, echo scoring, a
    conversation resumed from its cache file) runs without a compile: counted here with JAX's events
    and by the server itself (/metrics dsv41_compiles_after_ready_total)."""
    app, worker = tiny_app(tmp_path, 64, warm=True, cache_dir=str(tmp_path / "conversations"))
    assert [k for k, _ in program_list(worker.engine)] == ["exact"] * 3 + ["decode"]  # pieces 1, 4, 16
    gate = threading.Event()
    real_warm = worker.warm

    def gated_warm(engine, progress):  # hold the warm-up so the test sees the server while it warms
        gate.wait(120)
        return real_warm(engine, progress)

    worker.warm = gated_warm
    srv = BackgroundServer(app, worker).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=600) as http:
            r = http.get("/ready")
            assert r.status_code == 503 and r.json()["status"] == "warming"
            h = http.get("/health")
            assert h.status_code == 200 and h.json() == {"status": "ok", "ready": False}
            early = {}
            # a request sent while warming waits in the queue and is answered afterwards
            t = threading.Thread(target=lambda: early.update(r=http.post(
                "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})))
            t.start()
            gate.set()
            t.join(600)
            assert early["r"].status_code == 200, early["r"].text
            r = http.get("/ready")
            assert r.status_code == 200, r.text
            body = r.json()
            # 3 prefill pieces, the replay, 3 echo pieces, the decode path
            assert body["status"] == "ready" and body["done"] == body["total"] == 8 and body["error"] is None
            assert worker.engine.capacity >= 64
            with count_compiles() as seen:
                for prompt in ["a", "hello", "x" * 17, "y" * 40, "z" * 61]:
                    r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2,
                                                          "temperature": 1.0, "logprobs": 2})
                    assert r.status_code == 200, r.text
                for prompt in ["ab", "q" * 13, "w" * 33, "e" * 62]:
                    r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 0,
                                                          "echo": True, "logprobs": 1})
                    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["tokens"]) > 1, r.text
                r = http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 3,
                                                            "messages": [{"role": "user", "content": "hey"}]})
                assert r.status_code == 200, r.text
                for n in (5, 20):  # conversations shorter and longer than the window (8) resume
                    first = [(3 * i + n) % 200 + 1 for i in range(n)]
                    for prompt in (first, first + [9, 8, 7]):
                        r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1})
                        assert r.status_code == 200, r.text
                    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == n, r.text
            assert seen == [], f"{len(seen)} programs compiled after /ready"
            assert "dsv41_compiles_after_ready_total 0.0" in http.get("/metrics").text
    finally:
        srv.close()


def test_failed_warm_up_is_reported_and_the_server_still_answers(tmp_path):
    app, worker = tiny_app(tmp_path, 64)

    def broken(engine, progress):
        progress(0, 3, "start", 0.0)
        raise RuntimeError("out of device memory (test)")

    worker.warm = broken
    srv = BackgroundServer(app, worker).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=600) as http:
            worker.ready.wait(60)
            r = http.get("/ready")
            assert r.status_code == 503
            assert r.json()["status"] == "warm-up failed" and "out of device memory" in r.json()["error"]
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1})
            assert r.status_code == 200, r.text
    finally:
        srv.close()


@pytest.mark.slow
def test_warm_engine_with_split_prefill_never_compiles_again(tiny_every_role):
    """The CED split path: Graph A pieces, Graph B and the exact pieces inside the tail, with a
    stored conversation's replay; every prompt length 1..max afterwards runs without a compile."""
    from flax import nnx

    cfg, graphdef, params = tiny_every_role
    model = nnx.merge(graphdef, params)
    engine = Engine(model, slots=2, max_seq_len=cfg.max_seq_len, min_capacity=8, prefill_chunk=8)
    kinds = program_list(engine, replay=True)
    assert ("graph_b", engine.tail) in kinds and any(k == "graph_a" for k, _ in kinds)
    report = warm(engine, replay=True)
    assert report["programs"] == len(kinds) and engine.idle()
    with count_compiles() as seen:
        reqs = [Request([(7 * n + i) % cfg.vocab_size for i in range(n)], SamplingParams(max_tokens=2))
                for n in range(1, cfg.max_seq_len - 1)]
        engine.run(reqs)
    assert seen == [], f"{len(seen)} programs compiled after warm()"


# ------------------------------------------------------------------------------ a real `dsv41 serve` process
def _checkpoint(root):
    """A one-layer synthetic HF checkpoint with the byte tokenizer (tiny_app's model)."""
    from dsv41_jax.checkpoint.hf_writer import save_hf_checkpoint
    from dsv41_jax.train.data import ByteTokenizer as Bytes

    cfg = ModelConfig.tiny(vocab_size=Bytes().vocab_size, n_layers=1, compress_ratios=(0,), kv_source_layers=(),
                           index_source_layers=(), candidate_source_layer=-1, engram_layer_ids=(), n_routed_experts=4,
                           max_seq_len=64, max_batch_size=2)
    tok = Bytes().save_json(root / "tokenizer.json")
    save_hf_checkpoint(synthetic_model(cfg, seed=1), root / "ckpt", tokenizer=tok)
    return root / "ckpt"


def _serve_cmd(ckpt, cache, *extra):
    import sys

    return [sys.executable, "-m", "dsv41_jax.cli", "serve", "--checkpoint", str(ckpt), "--compile-cache", str(cache),
            "--max-model-len", "64", "--max-batch", "2", "--prefill-chunk", "16", "--exact-prefill", *extra]


def _entries_complete(cache) -> list:
    """The cache's entries, each checked to decompress whole (a half-written one does not)."""
    from jax._src.compilation_cache import decompress_executable

    entries = [p for p in cache.iterdir() if p.name.endswith("-cache")]
    for p in entries:
        decompress_executable(p.read_bytes())
    return entries


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_signal_during_the_warm_up_stops_the_server_with_exit_code_0(tmp_path, sig):
    """The warm-up compiles in the engine thread and a compile cannot be interrupted; a signal then
    ends the process at once (exit 0) instead of waiting for it, and no cache entry is left half-written."""
    import os
    import signal
    import subprocess

    from tests.support.serve_process import reserve_port

    ckpt = _checkpoint(tmp_path)
    port, lock = reserve_port()
    log = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(__import__("sys").path)}
    with open(log, "w") as err:
        proc = subprocess.Popen(_serve_cmd(ckpt, tmp_path / "xla", "--port", str(port)), stderr=err, env=env)
    try:
        while "warming up: compiling" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]
            __import__("time").sleep(0.1)
        proc.send_signal(getattr(signal, sig))
        rc = proc.wait(timeout=120)  # a hang guard, not a timing assertion
    finally:
        if proc.poll() is None:
            proc.kill()
        lock.close()
    text = log.read_text()
    assert rc == 0, text[-3000:]
    assert f"{sig} during the warm-up" in text and "dsv41 serve: ready" not in text, text[-3000:]
    _entries_complete(tmp_path / "xla")


@pytest.mark.slow
def test_warm_only_fills_the_cache_and_a_restart_compiles_nothing(tmp_path):
    """`dsv41 serve --warm-only` compiles every program and exits 0; a server started on that cache
    then loads every program from it and compiles nothing after /ready (its /metrics counter)."""
    import os
    import subprocess

    from tests.support.serve_process import launch, stop, wait_ready

    ckpt, cache = _checkpoint(tmp_path), tmp_path / "xla"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(__import__("sys").path)}
    done = subprocess.run(_serve_cmd(ckpt, cache, "--warm-only"), env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0 and "exiting (--warm-only)" in done.stderr, done.stderr[-3000:]
    assert len(_entries_complete(cache)) >= 6
    logs = {"warm": str(tmp_path / "serve.log")}
    procs, urls = {}, {}

    def start(port):
        with open(logs["warm"], "w") as err:
            return subprocess.Popen(_serve_cmd(ckpt, cache, "--port", str(port)), stderr=err, env=env)

    try:
        launch({"warm": start}, procs, urls)
        wait_ready(procs, urls, logs, starts={"warm": start})
        for prompt in ("a", "hello there", "x" * 40):
            r = httpx.post(urls["warm"] + "/v1/completions", json={"model": "ckpt", "prompt": prompt, "max_tokens": 2},
                           timeout=600)
            assert r.status_code == 200, r.text
        metrics = httpx.get(urls["warm"] + "/metrics").text
        assert "dsv41_compiles_after_ready_total 0.0" in metrics, metrics
    finally:
        stop(procs)


@pytest.mark.slow
def test_warm_vision_server_compiles_only_the_tower_for_a_new_image_grid(tmp_path):
    """After /ready on a model with a vision tower, image prompts of several lengths (chat with one
    image, two images, an image inside a longer prompt, the image's conversation resumed: its
    replayed window holds image positions) compile nothing but
    the tower's program for a patch grid not seen before (the tower is one program per grid, by
    design): the prefill and replay pieces with span operands are the warm-up's. A second image of
    the same grid compiles nothing at all."""
    import base64
    import io

    from PIL import Image

    from dsv41_jax.serving.http.images import ImageOptions
    from dsv41_jax.vision.sources import ImageLimits

    def image(color, size):
        buf = io.BytesIO()
        Image.new("RGB", size, color).save(buf, "PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        return {"type": "image_url", "image_url": {"url": url}}

    max_len = 160
    cfg = ModelConfig.tiny_vision(n_layers=1, compress_ratios=(0,), kv_source_layers=(), index_source_layers=(),
                                  candidate_source_layer=-1, engram_layer_ids=(), n_routed_experts=4,
                                  max_seq_len=max_len, max_batch_size=2)
    tokenizer = load_tokenizer(ByteTokenizer().save_json(tmp_path / "tokenizer.json", image_token=True))
    app, worker = build(synthetic_model(cfg, seed=3), tokenizer,
                        ServeOptions(model_name="tiny-vl", warm=True, cache_dir=str(tmp_path / "conv"),
                                     engine=EngineSettings(slots=2, max_seq_len=max_len, prefill_chunk=16,
                                                           exact_prefill=True),
                                     images=ImageOptions(ImageLimits(max_images=2))))
    srv = BackgroundServer(app, worker).start()

    def chat(http, *turns):
        messages = [{"role": ("user", "assistant")[i % 2], "content": c} for i, c in enumerate(turns)]
        r = http.post("/v1/chat/completions", json={"model": "tiny-vl", "max_tokens": 2, "temperature": 0,
                                                    "messages": messages})
        assert r.status_code == 200, r.text
        return r.json()

    try:
        with httpx.Client(base_url=srv.url, timeout=600) as http:
            assert worker.ready.wait(600) and http.get("/ready").json()["status"] == "ready"
            tower = worker.engine.steps.image
            with count_compiles() as first:
                chat(http, [{"type": "text", "text": "what is it?"}, image((220, 20, 20), (12, 9))])
            assert tower._cache_size() == 1 and len(first) == 1, f"{len(first)} programs compiled (tower: 1)"
            with count_compiles() as seen:
                asked = [image((20, 20, 220), (12, 9)), {"type": "text", "text": "and this one, longer text?"}]
                reply = chat(http, asked)["choices"][0]["message"]["content"]
                chat(http, [image((9, 200, 9), (12, 9)), {"type": "text", "text": "two"}, image((1, 2, 3), (12, 9))])
                # a longer prompt (several pieces): the image inside a full piece, text on both sides
                chat(http, [{"type": "text", "text": "x" * 60}, image((7, 7, 7), (12, 9)),
                            {"type": "text", "text": "y" * 30}])
                # the conversation resumed from its cache file: its replayed window holds image positions
                resumed = chat(http, asked, reply, "more")
            assert resumed["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, resumed["usage"]
            assert seen == [] and tower._cache_size() == 1, f"{len(seen)} programs compiled after /ready"
    finally:
        srv.close()
