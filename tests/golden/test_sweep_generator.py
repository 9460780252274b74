"""The sweep's generator side without the oracle: what `dspark_wide` asks the oracle's dspark.py for, and the
token-source folder it hands it (the oracle itself runs only when a folder is made, docs/NUMERICS.md)."""
from __future__ import annotations

import json
import pathlib

import numpy as np
from safetensors.numpy import load_file

from dsv41_jax.config import ModelConfig
from dsv41_jax.golden import oracle_host, sweep


def _dspark_wide_config() -> tuple[ModelConfig, dict]:
    """The config dspark.py builds: the backbone's args updated by the replacements, a ratio 0 per stage."""
    _, _, replace, over, _, opts = sweep.FULL_WIDTH_EXTENSIONS["dspark_wide"]
    args = {**sweep.BASE, **over, **replace}
    args["compress_ratios"] = list(args["compress_ratios"]) + [0] * replace["n_mtp_layers"]
    return ModelConfig.from_dict(args), dict(zip(opts[::2], opts[1::2]))


def test_dspark_wide_is_the_released_drafter_on_a_released_width_backbone():
    cfg, opts = _dspark_wide_config()
    released = ModelConfig()
    assert cfg.has_dspark and cfg.n_mtp_layers == 3
    assert (cfg.dspark_block_size, cfg.dspark_markov_rank) == (released.dspark_block_size, released.dspark_markov_rank)
    # 32 routed experts per stage instead of 128 (memory, see sweep.py); 3 active as released
    assert cfg.dspark_moe == (32, released.dspark_n_activated_experts)
    for k, v in sweep.RELEASED_LAYER.items():
        if k != "n_routed_experts":
            assert getattr(cfg, k) == v, k
    assert cfg.dspark_target_layer_ids == (0, 1, 2) and cfg.n_layers == 3
    # the prompt selects: more ratio-1 positions than the top-k, and wraps the window ring
    (case,) = opts["--cases"].split()
    P, S = (int(p[1:]) for p in case.split("_")[1:])
    assert cfg.compress_ratios[1] == 1 and P > cfg.index_topk and P > cfg.window_size
    seed, n = sweep.TOKEN_STREAMS["dspark_wide"]
    assert n == P + S <= cfg.max_seq_len


def test_the_token_source_is_what_dspark_reads(tmp_path):
    opts = sweep.write_token_source(tmp_path / "src", 226, 532, 512)
    assert opts == ["--token-source", str(tmp_path / "src"), "--token-case", sweep.TOKEN_CASE]
    # dspark.py: safe_open(f"{source}/{case}.safetensors").get_tensor("tokens").tolist(), and
    # json.load(f"{source}/cases.json")["cases"][0]["token_seed"]
    tokens = load_file(str(tmp_path / "src" / f"{sweep.TOKEN_CASE}.safetensors"))["tokens"]
    assert tokens.dtype == np.int64 and tokens.shape == (532,)
    assert np.array_equal(tokens, np.random.default_rng(226).integers(0, 512, 532))
    assert json.loads((tmp_path / "src" / "cases.json").read_text())["cases"][0]["token_seed"] == 226


def test_write_extension_hands_dspark_the_token_source(tmp_path, monkeypatch):
    """The generator's command line: the replacements, the backbone and the token source (which exists while
    it runs, under a fixed name: the generator records it in the case)."""
    seen = {}

    def fake_weights(path, args, seed, all_logical=False):
        path.write_bytes(b"")
        seen["backbone"] = args
        return "0" * 64, {}

    def fake_run(cmd, check, cwd, stdout, env):
        i = cmd.index("--token-source")
        src = pathlib.Path(cmd[i + 1])
        seen["tokens"] = load_file(str(src / f"{sweep.TOKEN_CASE}.safetensors"))["tokens"]
        seen["source_name"], seen["cmd"], seen["env"] = src.name, cmd, env
        out = pathlib.Path(cmd[cmd.index("--backbone") - 1])
        (out / "config.json").write_text(json.dumps({"name": "dspark_fp8"}))

    monkeypatch.setattr(sweep, "write_weights", fake_weights)
    monkeypatch.setattr(sweep.subprocess, "run", fake_run)
    monkeypatch.setenv("ORACLE_REF", str(tmp_path))
    sweep.write_extension(tmp_path / "out", "dspark_wide", tmp_path, "python")
    cmd = seen["cmd"]
    assert seen["source_name"] == "dspark_wide_tokens" and seen["tokens"].shape == (532,)
    assert cmd[cmd.index("--token-case") + 1] == sweep.TOKEN_CASE and "--mtp-seed" in cmd
    assert json.loads(cmd[cmd.index("DSPARK_ARGS") + 1])["dspark_n_routed_experts"] == 32
    assert seen["backbone"]["dim"] == 5120 and seen["env"]["MKL_ENABLE_INSTRUCTIONS"] == "SSE4_2"
    assert json.loads((tmp_path / "out" / "dspark_wide" / "config.json").read_text())["name"] == "dspark_wide"


def test_the_generators_run_the_chunked_gemm_too():
    """At the released width the oracle's whole-call GEMM holds every float64 block dot (5.5 GB for a 526-token
    wq_b): the generators get the harness's row-chunked stand-in."""
    code = oracle_host.generator_code("main()")
    assert "kernels._blocked_gemm = _blocked_gemm" in code and code.endswith("main()")
    assert "kernels._blocked_gemm = _blocked_gemm" in oracle_host.harness_command("python", "run")[2]


def test_the_generator_frees_the_previous_model_before_building_the_next(tmp_path):
    """dspark.py builds a model per run (published, corrected, rerun) and its hooks put each in reference cycles:
    at the released width a model left for the garbage collector is another copy of the weights (4 GB)."""
    import subprocess
    import sys

    (tmp_path / "harness.py").write_text("def build_model():\n    m = type('M', (), {})()\n    m.me = m\n    return m\n")
    (tmp_path / "gen.py").write_text(
        "import gc, weakref\nimport harness as H\nARGS = {}\n\ndef main():\n    gc.disable()\n"
        "    first = weakref.ref(H.build_model())\n    H.build_model()\n"
        "    print('freed' if first() is None else 'held')\n")
    code = sweep._RUN_GENERATOR
    out = subprocess.run([sys.executable, "-c", code, "gen", "ARGS", "{}"], cwd=tmp_path, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "freed"
