"""`dsv41 compile`: the tiny model's decode step compiled by XLA:TPU with every Pallas kernel through Mosaic.

Runs the command in a child process (libtpu aborts its process on a failed internal check; the
child also starts clean of this session's CPU-device flags).
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

from pallas_kernels.common import tpu_compile

pytestmark = pytest.mark.skipif(tpu_compile.libtpu_missing() is not None, reason=str(tpu_compile.libtpu_missing()))
ROOT = pathlib.Path(__file__).resolve().parents[2]
KERNELS = {"sparse_sink_attention_tpu", "indexer_scores_tpu", "grouped_fp4_gemm_tpu", "fp8_block_gemm_tpu"}


def _dsv41(*argv):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), *sys.path]), XLA_FLAGS="")
    return subprocess.run([sys.executable, "-m", "dsv41_jax.cli", *argv], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)


@pytest.mark.slow  # ~30-80 s of XLA:TPU on 2 cores; the default suite compiles each kernel per device on a mesh
def test_tiny_pallas_decode_compiles_for_a_v6e_mesh_with_every_kernel_in_mosaic():
    """The kernels on a mesh: attention, indexer and FP8 GEMM per device (batch 4 over expert=4), the FP4
    expert kernel inside the expert-parallel MoE on each chip's experts (their word views)."""
    proc = _dsv41("compile", "--config", "tiny", "--topology", "v6e:2x2", "--mesh", "data=1,expert=4", "--impl",
                  "pallas", "--batch", "4", "--context", "64", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    r = json.loads(proc.stdout)
    assert r["ok"] and r["fits"] and r["device_kind"] == "TPU v6 lite"
    assert set(r["mosaic_kernels"]) == KERNELS, r["mosaic_kernels"]
    d = r["per_device_bytes"]
    # the compiler holds at least the plan's weights, Engram tables and caches (the tiny model's small arrays
    # pad to the TPU's (8, 128) tiles: 3.60 MB compiled where the plan counts 2.97 MB)
    assert d["argument"] >= r["plan_compiled_layers"]["arguments"] > 0
    assert r["flops"] > 0 and r["cost_model_seconds"] > 0


@pytest.mark.slow  # four small XLA:TPU compiles, ~2-4 min on 2 cores
def test_tiny_prefill_and_verify_programs_compile_with_their_kernels(tmp_path):
    """The engine's split-prefill programs (Graph A, Graph B, the replay) and DSpark's verify step, on a mesh."""
    from dsv41_jax.config import ModelConfig

    config = tmp_path / "config.json"  # the tiny model with DSpark's taps among its 7 layers
    config.write_text(json.dumps(ModelConfig.tiny(dspark_target_layer_ids=(4, 5, 6)).to_hf_dict()))
    reports = []
    for what in ("prefill", "verify"):
        proc = _dsv41("compile", "--config", str(config), "--topology",
                      "v6e:2x2", "--mesh", "data=1,expert=4", "--impl", "pallas", "--batch", "4", "--context", "64",
                      "--prefill-chunk", "16", "--what", what, "--json")
        assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
        out = json.loads(proc.stdout)
        reports += out["programs"] if "programs" in out else [out]
    assert [r["program"] for r in reports] == ["graph_a", "graph_b", "replay", "verify"]
    for r in reports:
        assert r["ok"] and r["fits"] and r["seconds"] > 0, r
        assert {"sparse_sink_attention_tpu", "grouped_fp4_gemm_tpu"} <= set(r["mosaic_kernels"]), r["mosaic_kernels"]
    assert reports[-1]["tokens"] == 6 and reports[-1]["drafts"] == 5  # the drafter's block, as dsv41 serve drafts


@pytest.mark.slow  # one XLA:TPU compile of a forward, backward and optimizer update, ~1-2 min on 2 cores
def test_tiny_qat_training_step_compiles_for_v5p():
    proc = _dsv41("compile", "--config", "tiny", "--topology", "v5p:2x2x1", "--mesh", "data=2,expert=2", "--what",
                  "train", "--batch", "4", "--context", "64", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    r = json.loads(proc.stdout)
    assert r["ok"] and r["fits"] and r["program"] == "train" and r["device_kind"] == "TPU v5", r
    assert r["preset"] == "training" and r["tokens"] == 256 and r["flops"] > 0



@pytest.mark.slow  # one XLA:TPU compile of the released width's QAT step (8 layers), ~8 min on 2 cores
def test_released_qat_training_step_compiles_and_fits_v5p():
    """The released width (one layer per kind, 384 experts over expert=16, 64 x 32 tokens) compiles for
    v5p:4x4x4 and fits a chip by the compiler's own peak plus code (`sharding.tpu_memory`): each layer
    rematerialised in the backward (`body.remat_step`), FSDP over data and expert (docs/PERFORMANCE.md,
    "The QAT training step"). The state is donated: its outputs alias its arguments."""
    proc = _dsv41("compile", "--topology", "v5p:4x4x4", "--mesh", "data=4,expert=16", "--what", "train",
                  "--batch", "64", "--context", "32", "--layers-per-kind", "1", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    r = json.loads(proc.stdout)
    assert r["ok"] and r["fits"] and r["chips"] == 64 and r["layers"] == 8 and r["tokens"] == 2048, r
    d = r["per_device_bytes"]
    assert d["alias"] > 0.9 * d["output"], d
    assert d["fit"] == d["compiler_peak"] + d["generated_code"] <= r["hbm_bytes"], d
    assert d["compiler_peak"] >= d["argument"], d  # the state is live through the step
    assert r["flops"] > 0 and {"all-gather", "reduce-scatter"} & set(r["collectives"]), r["collectives"]


def test_bad_input_exits_2_naming_it():
    proc = _dsv41("compile", "--config", "tiny", "--topology", "v6e:3x3", "--mesh", "data=1")
    assert proc.returncode == 2 and "v6e:3x3" in proc.stderr, proc.stderr[-2000:]
    proc = _dsv41("compile", "--config", "tiny", "--topology", "v6e:2x2", "--mesh", "data=8")
    assert proc.returncode == 2 and "has 8 devices but topology v6e:2x2 has 4 chips" in proc.stderr, proc.stderr[-2000:]
    proc = _dsv41("compile", "--config", "tiny", "--topology", "v6e:2x2", "--mesh", "data=1", "--what", "verify")
    assert proc.returncode == 2 and "needs a config with the DSpark drafter" in proc.stderr, proc.stderr[-2000:]


def test_collectives_are_counted_once_with_their_output_bytes():
    from sharding.tpu_step import collectives

    hlo = """  %ar = f32[8,128]{1,0} all-reduce(%a), replica_groups={}
  %ags = (bf16[2,64]{1,0}, bf16[8,64]{1,0}) all-gather-start(%x)
  %agd = bf16[8,64]{1,0} all-gather-done(%ags)
  %cps = (f32[4]{0}, f32[4]{0}, u32[], u32[]) collective-permute-start(%y)
  %cpd = f32[4]{0} collective-permute-done(%cps)
  %a2a = (s32[2,3]{1,0}, s32[2,3]{1,0}) all-to-all(%p, %q)"""
    assert collectives(hlo) == {"all-reduce": {"count": 1, "bytes": 8 * 128 * 4},
                                "all-gather": {"count": 1, "bytes": 8 * 64 * 2},
                                "collective-permute": {"count": 1, "bytes": 16},
                                "all-to-all": {"count": 1, "bytes": 2 * 6 * 4}}


def test_collectives_that_cross_hosts_are_found_from_their_device_groups():
    from sharding.tpu_step import collectives

    hlo = """  %ar = f32[8]{0} all-reduce(%a), replica_groups={{0,1},{2,3}}, to_apply=%add
  %ar2 = f32[8]{0} all-reduce(%a), replica_groups={{0,2},{1,3}}, to_apply=%add
  %ags = (bf16[2]{0}, bf16[4]{0}) all-gather-start(%x), replica_groups=[2,2]<=[4], dimensions={0}
  %agd = bf16[4]{0} all-gather-done(%ags)
  %ags2 = (bf16[2]{0}, bf16[4]{0}) all-gather-start(%x), replica_groups=[2,2]<=[2,2]T(1,0), dimensions={0}
  %agd2 = bf16[4]{0} all-gather-done(%ags2)
  %cp = f32[4]{0} collective-permute(%y), source_target_pairs={{0,1},{1,0}}
  %a2a = s32[4]{0} all-to-all(%p), replica_groups={}, dimensions={0}"""
    got = collectives(hlo, hosts=[0, 0, 1, 1])  # devices 0, 1 on host 0; 2, 3 on host 1
    assert {k: v["cross_host"] for k, v in got.items()} == {
        "all-reduce": 1, "all-gather": 1, "collective-permute": 0, "all-to-all": 1}
    assert got["all-reduce"]["count"] == 2 and got["all-gather"]["count"] == 2


def test_fewer_layers_keep_every_layer_kind_of_the_released_stack():
    from dsv41_jax.config import ModelConfig
    from sharding.tpu_step import layer_kinds, subset_config

    full = ModelConfig.load("v41-flash")
    sub, kept = subset_config(full, 1)
    assert sum(len(v) for v in layer_kinds(full).values()) == full.n_layers == 40
    assert sorted(layer_kinds(sub)) == sorted(layer_kinds(full)) and set(kept.values()) == {1}
    assert sub.n_layers == len(kept) and sub.dim == full.dim and sub.n_routed_experts == full.n_routed_experts
