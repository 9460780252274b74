"""`dsv41 serve --speculative dspark [--num-draft-tokens K]`: the refusals (no
drafter, K above the drafter's block, K without --speculative), the warm-up of the speculative
programs (no request compiles after /ready), and a real server answering the `openai` client with
the same tokens as the same server without speculation (greedy, exact numerics) while /metrics
shows the drafter at work.

The checkpoint is the serving tests' one-layer tiny model plus a one-stage DSpark drafter (random
weights: it is rarely right, so acceptance is low; the equality with the plain server is what
shows that verification, acceptance and the commit are exact).
"""
from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from dsv41_jax.checkpoint.hf_writer import save_hf_checkpoint  # noqa: E402
from dsv41_jax.checkpoint.synthetic import synthetic_model  # noqa: E402
from dsv41_jax.cli.main import main  # noqa: E402
from dsv41_jax.serving.engine import EngineSettings  # noqa: E402
from dsv41_jax.serving.http.server import BackgroundServer, ServeOptions, build  # noqa: E402
from dsv41_jax.text.tokenizer import load_tokenizer  # noqa: E402
from dsv41_jax.train.data import ByteTokenizer  # noqa: E402
from tests.support.serve_process import launch, stop, wait_ready  # noqa: E402
from test_serve_http import tiny_config  # noqa: E402
from test_serve_warmup import count_compiles  # noqa: E402

BLOCK = 4
DSPARK = dict(n_mtp_layers=1, dspark_block_size=BLOCK, dspark_noise_token_id=3, dspark_target_layer_ids=(0,),
              dspark_markov_rank=16, dspark_n_routed_experts=4, dspark_n_activated_experts=2)


def dspark_config(max_len: int = 128):
    return tiny_config().replace(max_seq_len=max_len, **DSPARK)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """{"dspark": folder with mtp.* tensors, "plain": the backbone alone}, byte tokenizer."""
    root = tmp_path_factory.mktemp("serve_spec")
    tok = ByteTokenizer().save_json(root / "tokenizer.json")
    save_hf_checkpoint(synthetic_model(dspark_config(), seed=3), root / "dspark", tokenizer=tok)
    save_hf_checkpoint(synthetic_model(tiny_config().replace(max_seq_len=128), seed=3), root / "plain", tokenizer=tok)
    return {"dspark": root / "dspark", "plain": root / "plain"}


def _serve(argv, capsys):
    code = main(["serve", *map(str, argv), "--quiet", "--no-warm"])
    return code, capsys.readouterr().err


def test_speculation_is_refused_clearly_before_any_weight_is_read(ckpts, capsys):
    code, err = _serve(["--checkpoint", ckpts["plain"], "--speculative", "dspark"], capsys)
    assert code == 2 and "no DSpark drafter" in err and "mtp.*" in err and "n_mtp_layers=0" in err
    code, err = _serve(["--checkpoint", ckpts["dspark"], "--speculative", "dspark", "--num-draft-tokens", BLOCK + 1],
                       capsys)
    assert code == 2 and f"at most dspark_block_size={BLOCK}" in err and f"1 .. {BLOCK}" in err
    code, err = _serve(["--checkpoint", ckpts["dspark"], "--num-draft-tokens", 2], capsys)
    assert code == 2 and "--num-draft-tokens 2 needs --speculative dspark" in err
    code, err = _serve(["--checkpoint", ckpts["dspark"], "--speculative-acceptance", "match"], capsys)
    assert code == 2 and "--speculative-acceptance match needs --speculative dspark" in err


def test_speculative_acceptance_flag_selects_the_engine_rule(ckpts, capsys):
    """--speculative-acceptance: 'rejection' by default, 'match' when asked; another value is refused by
    the parser, naming the choices."""
    from dsv41_jax.cli.main import build_parser
    from dsv41_jax.cli.serve import load_server

    base = ["serve", "--checkpoint", str(ckpts["dspark"]), "--quiet", "--no-warm", "--speculative", "dspark",
            "--exact-prefill"]  # a one-layer model: nothing to split
    for extra, rule in (([], "rejection"), (["--speculative-acceptance", "match"], "match"),
                        (["--speculative-acceptance", "rejection"], "rejection")):
        _, worker, opts = load_server(build_parser().parse_args(base + extra))
        assert opts.engine.spec_acceptance == rule and worker.engine.spec_acceptance == rule
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(base + ["--speculative-acceptance", "greedy"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "invalid choice: 'greedy'" in err and "'rejection', 'match'" in err


def _metrics(text: str) -> dict:
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.mark.slow  # 59 s (-n 2): over the default suite's budget
def test_warm_speculative_server_compiles_nothing_after_ready(tmp_path):
    """`build` with speculative=K and the warm-up: after /ready no request compiles (prefill with
    the drafter's rings, greedy and sampled drafts, verify, targets, rejection sampling, commit,
    the plain step near max_tokens), and
    /metrics counts what was drafted from zero (the warm-up's own steps are not counted)."""
    tokenizer = load_tokenizer(ByteTokenizer().save_json(tmp_path / "tokenizer.json"))
    k = BLOCK - 1
    app, worker = build(synthetic_model(dspark_config(64), seed=3), tokenizer,
                        ServeOptions(model_name="tiny", engine=EngineSettings(slots=2, max_seq_len=64, prefill_chunk=16,
                                                                              exact_prefill=True, speculative=k),
                                     warm=True))
    srv = BackgroundServer(app, worker).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=600) as http:
            assert worker.ready.wait(600)
            assert http.get("/ready").json()["status"] == "ready"
            assert _metrics(http.get("/metrics").text)["dsv41_spec_drafted_tokens"] == 0
            with count_compiles() as seen:
                for prompt, t in [("a", 0), ("hello", 1.0), ("x" * 17, 0)]:
                    r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 9,
                                                          "temperature": t, "logprobs": 2})
                    assert r.status_code == 200, r.text
            assert seen == [], f"{len(seen)} programs compiled after /ready"
            m = _metrics(http.get("/metrics").text)
    finally:
        srv.close()
    assert m["dsv41_spec_drafted_tokens"] == k * m["dsv41_spec_slot_steps"] > 0
    assert m["dsv41_spec_mean_acceptance_length"] == pytest.approx(
        (m["dsv41_spec_accepted_tokens"] + m["dsv41_spec_slot_steps"]) / m["dsv41_spec_slot_steps"])


def _start(folder, port, log, extra):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    cmd = [sys.executable, "-m", "dsv41_jax.cli", "serve", "--checkpoint", str(folder), "--port", str(port),
           "--numerics", "exact", "--exact-prefill", "--max-batch", "2", "--prefill-chunk", "4",
           "--max-model-len", "128", "--quiet", *extra]
    return subprocess.Popen(cmd, env=env, stderr=open(log, "w"))  # a file: an undrained pipe would block it


@pytest.mark.slow
def test_openai_client_streams_the_same_tokens_with_speculation(ckpts, tmp_path):
    """Two real `dsv41 serve` processes on the DSpark checkpoint, exact numerics: one with
    `--speculative dspark --num-draft-tokens 3`, one without. A streamed completion, a streamed
    chat and a completion with logprobs (greedy) are equal field by field; /metrics of the
    speculating one shows drafted tokens."""
    procs, urls = {}, {}
    starts = {name: (lambda port, name=name, extra=extra: _start(ckpts["dspark"], port, tmp_path / f"{name}.log", extra))
              for name, extra in (("spec", ["--speculative", "dspark", "--num-draft-tokens", "3"]), ("plain", []))}
    try:
        launch(starts, procs, urls)
        wait_ready(procs, urls, {name: tmp_path / f"{name}.log" for name in urls}, starts=starts)
        got = {name: _ask(url) for name, url in urls.items()}
        m = _metrics(httpx.get(urls["spec"] + "/metrics").text)
        assert "dsv41_spec_drafted_tokens" not in _metrics(httpx.get(urls["plain"] + "/metrics").text)
    finally:
        stop(procs)
    assert got["spec"] == got["plain"]
    assert len(got["spec"]["logprobs"][0]) == 12  # the completion ran to max_tokens
    assert m["dsv41_spec_drafted_tokens"] == 3 * m["dsv41_spec_slot_steps"] > 0


def _ask(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
    stream = client.completions.create(model="dspark", prompt="def f(x):", max_tokens=14, temperature=0, stream=True)
    chat = client.chat.completions.create(model="dspark", messages=[{"role": "user", "content": "what is the weather"}],
                                          max_tokens=10, temperature=0, stream=True)
    c = client.completions.create(model="dspark", prompt="hello there", max_tokens=12, temperature=0, logprobs=2)
    return {"stream": "".join(x.choices[0].text for x in stream if x.choices),
            "chat": "".join(x.choices[0].delta.content or "" for x in chat if x.choices),
            "text": c.choices[0].text, "finish": c.choices[0].finish_reason,
            "logprobs": (c.choices[0].logprobs.tokens, c.choices[0].logprobs.token_logprobs)}
