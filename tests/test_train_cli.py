"""`dsv41 train` and `dsv41 demo` end to end (slow: each compiles a training step)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from dsv41_jax.cli import main

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
    assert main(common + ["--steps", "3", "--export", str(tmp_path / "served")]) == 0
    err = capsys.readouterr().err
    assert "starting at step 2" in err and "step     3" in err
    assert (tmp_path / "served" / "model.safetensors").exists()
    from dsv41_jax.train.export import load_exported

    _, model = load_exported(tmp_path / "served", cfg)
    assert model.layers[1].attn.wq_a.weight[...].dtype == np.dtype("float8_e4m3fn")
    assert main(["train", "--config", "nope", "--data", str(corpus)]) == 2


@pytest.mark.slow
def test_demo_runs_and_learns(tmp_path):
    from dsv41_jax.train.demo import run_demo

    lines = []
    out = run_demo(tmp_path, steps=40, time_budget=600, progress=False, print_fn=lines.append)
    text = "\n".join(lines)
    assert out["last_ce"] < 0.7 * out["first_ce"], out
    assert "DeepSeek-V4.1-Flash" in text and "890.0 B/token" in text
    assert out["sample"].startswith("def ") and len(out["sample"]) > 10
