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
from dsv41_jax.serving.engine import Engine, Request, pieces
from dsv41_jax.serving.http.server import BackgroundServer, ServeOptions, build
from dsv41_jax.serving.sampling import SamplingParams
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
                 ServeOptions(model_name="tiny", max_batch=2, max_model_len=max_len, prefill_chunk=16,
                              exact_prefill=True, **opts))


@pytest.mark.parametrize("chunk", [1, 3, 8, 16, 100, 512])
def test_piece_sizes_are_those_of_every_reachable_length(chunk):
    for lo, hi in [(1, 1), (1, 7), (5, 63), (129, 8191), (300, 310), (9, 8)]:
        want = sorted({s for n in range(lo, hi + 1) for s in pieces(n, chunk)})
        assert piece_sizes(lo, hi, chunk) == want, (lo, hi)


def test_warm_server_reports_ready_after_compiling_and_then_no_request_compiles(tmp_path):
    app, worker = tiny_app(tmp_path, 64, warm=True)
    assert [k for k, _ in program_list(worker.engine)] == ["exact"] * 5 + ["decode"]  # pieces 1, 2, 4, 8, 16
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
            assert body["status"] == "ready" and body["done"] == body["total"] == 6 and body["error"] is None
            assert worker.engine.capacity >= 64
            with count_compiles() as seen:
                for prompt in ["a", "hello", "x" * 17, "y" * 40, "z" * 61]:
                    r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2,
                                                          "temperature": 1.0, "logprobs": 2})
                    assert r.status_code == 200, r.text
                r = http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 3,
                                                            "messages": [{"role": "user", "content": "hey"}]})
                assert r.status_code == 200, r.text
            assert seen == [], f"{len(seen)} programs compiled after /ready"
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
