"""`dsv41 train` and `dsv41 demo` end to end (slow: each compiles a training step)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dsv41_jax.cli.main import main

from train_fixtures import micro_config


@pytest.mark.slow
def test_train_cli_resumes_and_exports(tmp_path, capsys):
    cfg = micro_config(32)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_flat_dict()))
    corpus = tmp_path / "data.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n"}) for i in range(60)) + "\n"
                      + json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                 {"role": "assistant", "content": "hello"}]}) + "\n")
    common = ["train", "--config", str(tmp_path / "config.json"), "--data", str(corpus), "--batch-size", "8",
              "--ckpt-dir", str(tmp_path / "ck"), "--save-every", "2", "--no-progress", "--log-every", "1",
              "--mesh", "data=2,tensor=2", "--lr", "1e-3"]
    assert main(common + ["--steps", "2"]) == 0
    capsys.readouterr()
    assert main(common + ["--steps", "3", "--export", str(tmp_path / "served"), "--json"]) == 0
    captured = capsys.readouterr()
    err = captured.err
    assert "starting at step 2" in err and "step     3" in err
    summary = json.loads(captured.out)  # stdout holds only the JSON summary
    assert summary["start_step"] == 2 and summary["step"] == 3 and summary["last"]["step"] == 3
    assert summary["export"] == str(tmp_path / "served") and summary["mesh"] == {"data": 2, "tensor": 2}
    assert {"loss", "ce", "balance", "indexer_kl", "load_imbalance", "tokens_per_s", "mfu"} <= set(summary["last"])
    assert (tmp_path / "served" / "model.safetensors.index.json").exists()
    from dsv41_jax.train.export import load_exported

    _, model = load_exported(tmp_path / "served", cfg)
    assert model.layers[1].attn.wq_a.weight[...].dtype == np.dtype("float8_e4m3fn")
    assert main(["train", "--config", "nope", "--data", str(corpus)]) == 2


def test_train_cli_usage_errors_exit_2(tmp_path, capsys):
    """Bad inputs stop before any compilation, with one clear line on stderr and exit code 2."""
    cfg = micro_config(32)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_flat_dict()))
    (tmp_path / "data.txt").write_text("def f(x):\n    return x\n" * 20)
    base = ["train", "--config", str(tmp_path / "config.json"), "--no-progress"]
    cases = [
        (["--data", str(tmp_path / "missing.txt")], "does not exist"),
        (["--data", str(tmp_path / "data.txt"), "--mesh", "data=64"], "devices"),
        (["--data", str(tmp_path / "data.txt"), "--mesh", "rows=2"], "axis=size"),
        (["--data", str(tmp_path / "data.txt"), "--mesh", "data=8", "--batch-size", "4"], "batch size"),
        (["--config", str(tmp_path / "nope.json"), "--data", str(tmp_path / "data.txt")], ""),
    ]
    for extra, message in cases:
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("dsv41 train: ") and message in err and "Traceback" not in err, (extra, err)
    with pytest.raises(SystemExit) as e:  # argparse's own usage errors
        main(base + ["--data", str(tmp_path / "data.txt"), "--steps", "0"])
    assert e.value.code == 2
    (tmp_path / "demo" / "checkpoints" / "0").mkdir(parents=True)
    assert main(["demo", "--out", str(tmp_path / "demo")]) == 2
    assert "already holds a run" in capsys.readouterr().err


@pytest.mark.slow
def test_demo_runs_and_learns(tmp_path, capsys):
    """`dsv41 demo` as CI runs it (fewer steps, no time budget): exit 0 only when the loss
    fell below 70% of its start; the report (stderr under --json) shows the sample and the
    cache/prefill figures; the orbax checkpoint and the served export are in --out."""
    code = main(["demo", "--out", str(tmp_path), "--steps", "40", "--time-budget", "600", "--json"])
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert code == 0, captured.err
    assert out["steps"] == 40 and out["last_ce"] < 0.7 * out["first_ce"], out
    text = captured.err
    assert "DeepSeek-V4.1-Flash" in text and "890.0 B/token" in text and "saved)" in text
    assert out["figures"]["v41_flash_128k"]["global_kv_bytes_per_token"] == 890
    assert 0 < out["figures"]["v41_flash_128k"]["prefill_saving"] < 1
    assert out["sample"].startswith("def ") and len(out["sample"]) > 10
    assert (tmp_path / "served" / "model.safetensors.index.json").exists() and (tmp_path / "checkpoints" / "40").is_dir()


@pytest.mark.slow
def test_demo_export_is_served(tmp_path, capsys):
    """`dsv41 demo --out D` then `dsv41 serve --checkpoint D/served` (no other step) answers a chat
    completion through the real HTTP server and `openai` client."""
    openai = pytest.importorskip("openai")
    from dsv41_jax.cli.main import build_parser
    from dsv41_jax.cli.serve import load_server
    from dsv41_jax.serving.http.server import BackgroundServer

    assert main(["demo", "--out", str(tmp_path), "--steps", "10", "--time-budget", "60"]) in (0, 1)  # 10 steps may not learn
    capsys.readouterr()
    assert (tmp_path / "served" / "tokenizer.json").is_file()
    args = build_parser().parse_args(["serve", "--checkpoint", str(tmp_path / "served"), "--quiet", "--max-batch", "1"])
    app, worker, opts = load_server(args)
    srv = BackgroundServer(app, worker).start()
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=600)
        r = client.chat.completions.create(model=opts.model_name, messages=[{"role": "user", "content": "def "}],
                                           max_tokens=8, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length") and 1 <= r.usage.completion_tokens <= 8
        assert isinstance(r.choices[0].message.content, str)
    finally:
        srv.close()
