"""`dsv41 train` and `dsv41 demo` end to end (slow: each compiles a training step)."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from dsv41_jax.cli.main import main

from tests.support.train_fixtures import micro_config


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
    # resuming with other settings: shape changes are refused outright, others need the flag
    for extra, message in ((["--lora", "4"], "lora_rank: checkpoint 0, now 4 changes the shapes"),
                           (["--optimizer", "muon"], "optim.optimizer: checkpoint 'adamw', now 'muon'"),
                           (["--lr", "1e-2"], "optim.lr: checkpoint 0.001, now 0.01. Resuming would silently change the "
                                              "run; pass the same settings, a new --ckpt-dir, or --accept-changed-settings"),
                           (["--seed", "5"], "seed: checkpoint 0, now 5"),
                           (["--lora", "4", "--accept-changed-settings"], "changes the shapes")):
        assert main(common + ["--steps", "3"] + extra) == 2, extra
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err and "asyncio" not in err, (extra, err)
    assert main(common + ["--steps", "3", "--export", str(tmp_path / "served"), "--json", "--lr", "2e-3",
                          "--accept-changed-settings"]) == 0
    captured = capsys.readouterr()
    err = captured.err
    assert "starting at step 2" in err and "step     3" in err
    assert "warning: resuming the checkpoint at step 2" in err and "optim.lr: checkpoint 0.001, now 0.002" in err
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
    junk = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
    (tmp_path / "junk.bin").write_bytes(junk.replace(b"\0", b"\1") + b"\0")
    (tmp_path / "latin1.txt").write_bytes("caf\u00e9 ol\u00e9\n".encode("latin-1"))
    (tmp_path / "ctrl.txt").write_bytes(bytes(range(1, 9)) * 50 + b"text")
    (tmp_path / "junk.jsonl").write_bytes(b'{"text": "ok"}\n' + junk[:64].replace(b"\0", b"\xff"))
    cases = [
        (["--data", str(tmp_path / "junk.bin")], "junk.bin is not text (a NUL byte at offset 4096)"),
        (["--data", str(tmp_path / "latin1.txt")], "latin1.txt is not UTF-8 text (byte 0xe9 at offset 3"),
        (["--data", str(tmp_path / "ctrl.txt")], "ctrl.txt is not text (400 of 404 bytes are control characters)"),
        (["--data", str(tmp_path / "junk.jsonl")], "junk.jsonl is not"),
        (["--data", str(tmp_path / "missing.txt")], "does not exist"),
        (["--data", str(tmp_path / "data.txt"), "--mesh", "data=64"], "devices"),
        (["--data", str(tmp_path / "data.txt"), "--mesh", "rows=2"], "axis=size"),
        (["--data", str(tmp_path / "data.txt"), "--mesh", "data=8", "--batch-size", "4"], "batch size"),
        (["--config", str(tmp_path / "nope.json"), "--data", str(tmp_path / "data.txt")], ""),
        (["--data", str(tmp_path / "data.txt"), "--dspark"], "--dspark: the config has no DSpark drafter (n_mtp_layers=0"),
    ]
    for extra, message in cases:
        assert main(base + extra) == 2, extra
        err = capsys.readouterr().err
        assert err.startswith("dsv41 train: ") and message in err and "Traceback" not in err, (extra, err)
    with pytest.raises(SystemExit) as e:  # argparse's own usage errors
        main(base + ["--data", str(tmp_path / "data.txt"), "--steps", "0"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(base + ["--data", str(tmp_path / "data.txt"), "--seed", "-1"])
    assert e.value.code == 2 and "argument --seed: must be >= 0, got -1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(base + ["--data", str(tmp_path / "data.txt"), "--dspark", "--dspark-decay-gamma", "-1"])
    assert e.value.code == 2 and "argument --dspark-decay-gamma: must be >= 0.0, got -1" in capsys.readouterr().err
    (tmp_path / "demo" / "checkpoints" / "0").mkdir(parents=True)
    assert main(["demo", "--out", str(tmp_path / "demo")]) == 2
    assert "already holds a run" in capsys.readouterr().err


def test_bad_ckpt_dir_is_refused_before_any_step(tmp_path, capsys):
    """--ckpt-dir that is a file, or a folder of other things, fails up front (it used to fail at
    the first save, after the steps were spent)."""
    import subprocess
    import sys

    cfg = micro_config(32)
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_flat_dict()))
    (tmp_path / "data.txt").write_text("def f(x):\n    return x\n" * 20)
    (tmp_path / "a_file").write_text("not a folder")
    base = ["train", "--config", str(tmp_path / "config.json"), "--data", str(tmp_path / "data.txt"), "--no-progress"]
    out = subprocess.run([sys.executable, "-m", "dsv41_jax.cli.main", *base, "--ckpt-dir", str(tmp_path / "a_file")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and f"--ckpt-dir {tmp_path / 'a_file'} is a file" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "starting at step" not in out.stderr
    junk = tmp_path / "junk"
    (junk / "7").mkdir(parents=True)
    (junk / "notes.txt").write_text("mine")
    assert main(base + ["--ckpt-dir", str(junk / "notes.txt" / "sub")]) == 2
    assert "sub cannot be created: Not a directory" in capsys.readouterr().err
    assert main(base + ["--ckpt-dir", str(junk)]) == 2
    err = capsys.readouterr().err
    assert "not dsv41 training checkpoints: 7/ (a step folder without state and meta), notes.txt" in err, err
    assert sorted(p.name for p in junk.iterdir()) == ["7", "notes.txt"]  # nothing written or removed


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
    # the drafter trained after the backbone, and the served checkpoint speculated with it
    assert out["drafter_steps"] > 0 and "speculation: mean acceptance length" in text and out["acceptance_length"] >= 1
    assert (tmp_path / "served" / "model.safetensors.index.json").exists() and (tmp_path / "checkpoints" / "40").is_dir()


def test_resume_compares_stored_settings_before_restoring(tmp_path, capsys):
    """A checkpoint's meta is compared with the run's settings before orbax reads the state: shape
    changes refused, other changes refused unless accepted, and a state that does not fit is
    one clear error (not orbax's text and an asyncio traceback)."""
    import dataclasses
    import types

    import jax.numpy as jnp

    from dsv41_jax.train.checkpoint import Checkpointer
    from dsv41_jax.train.loop import _meta, prepare
    from dsv41_jax.train.optim import OptimConfig
    from dsv41_jax.train.step import TrainConfig

    cfg = micro_config(32)
    tcfg = TrainConfig(seq_len=32, batch_size=8, steps=4, optim=OptimConfig(lr=1e-3, total_steps=4))
    settings = {"corpus": "3 documents, sha256 0123456789abcdef"}
    ck = Checkpointer(tmp_path / "ck", async_save=False)
    # meta exactly as a run writes it, over a state that is not this model's (so a restore would fail)
    ck.save(2, {"step": jnp.int32(2), "junk": jnp.zeros(3)}, _meta(types.SimpleNamespace(cfg=cfg, tcfg=tcfg, settings=settings), 2))
    ck.wait()

    def resume(tc=tcfg, st=settings, c=cfg, **kw):
        return prepare(c, tc, mesh_spec="data=1", checkpointer=ck, settings=st, **kw)

    cases = [
        (dict(c=micro_config(32, window_size=16)), "another model config (window_size: checkpoint 8, now 16)"),
        (dict(tc=dataclasses.replace(tcfg, lora_rank=2)), "lora_rank: checkpoint 0, now 2 changes the shapes"),
        (dict(tc=dataclasses.replace(tcfg, batch_size=4)), "batch_size: checkpoint 8, now 4"),
        (dict(tc=dataclasses.replace(tcfg, seed=3)), "seed: checkpoint 0, now 3"),
        (dict(tc=dataclasses.replace(tcfg, optim=OptimConfig(lr=5e-4, total_steps=4))), "optim.lr: checkpoint 0.001, now 0.0005"),
        (dict(st={"corpus": "4 documents, sha256 fedcba9876543210"}), "corpus: checkpoint '3 documents"),
    ]
    for kw, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            resume(**kw)
    # more steps is no change; an accepted change is logged; the unfit state is one clear error
    lines = []
    with pytest.raises(ValueError, match=r"step 2 in .* does not fit this run \(") as e:
        resume(tc=dataclasses.replace(tcfg, steps=9, optim=OptimConfig(lr=5e-4, total_steps=9)), accept_changes=True,
               log=lines.append)
    assert e.value.__cause__ is None and "asyncio" not in str(e.value)
    assert lines == [f"warning: resuming the checkpoint at step 2 in {ck.directory} with changed settings: "
                     "optim.lr: checkpoint 0.001, now 0.0005"]
    ck.close()


@pytest.mark.slow
def test_demo_export_is_served(tmp_path, capsys):
    """`dsv41 demo --out D` then `dsv41 serve --checkpoint D/served` (no other step) answers a chat
    completion through the real HTTP server and `openai` client."""
    openai = pytest.importorskip("openai")
    from dsv41_jax.cli.main import build_parser
    from dsv41_jax.cli.serve import load_server
    from dsv41_jax.serving.http.server import BackgroundServer

    assert main(["demo", "--out", str(tmp_path), "--steps", "10", "--time-budget", "60"]) in (0, 1)  # 10 steps may not learn
    report = capsys.readouterr().out
    assert report.startswith("dsv41 demo: starting")  # progress from the first second
    assert f"dsv41 serve --checkpoint {tmp_path / 'served'}" in report and "curl http://127.0.0.1:8000" in report
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
        # the served context holds a tools prompt and a thinking turn (it used to be 128 tokens: both refused)
        assert opts.max_model_len == 8192
        tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                                    "parameters": {"type": "object",
                                                                   "properties": {"city": {"type": "string"}}}}}]
        r = client.chat.completions.create(model=opts.model_name, messages=[{"role": "user", "content": "weather?"}],
                                           tools=tools, max_tokens=4, temperature=0)
        assert r.usage.prompt_tokens > 1000 and r.choices[0].finish_reason in ("stop", "length", "tool_calls")
        r = client.chat.completions.create(model=opts.model_name, messages=[{"role": "user", "content": "def "}],
                                           reasoning_effort="high", max_tokens=4, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length")
    finally:
        srv.close()
