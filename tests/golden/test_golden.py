"""Golden parity: the oracle's kernel vectors and cases (golden/README.md).

The default run checks the vectors, a short prefill (L13, free and forced) and single-layer replays of
one config; the whole folder, every case and variant, runs as `dsv41 golden-check` in the slow
test. Thresholds and their source: tests/README.md and dsv41_jax/golden/check.py.
"""
import json
import subprocess
import sys

import jax
import pytest

from dsv41_jax.golden import data as golden_data
from dsv41_jax.golden.check import CaseRunner, check_case, check_replays
from dsv41_jax.golden.vectors import check_vectors


def test_kernel_vectors_bit_exact(golden_root):
    qv = golden_data.load_quant_vectors(golden_root)
    if qv is None:
        pytest.skip("no quant vectors in the golden folder")
    with jax.enable_x64(True):
        results = check_vectors(*qv)
    assert len(results) == 7
    assert all(ok for _, ok, _ in results), [r for r in results if not r[1]]


@pytest.fixture(scope="module")
def fp8_runner(golden_root):
    configs = {gc.name: gc for gc in golden_data.discover(golden_root)}
    if "main_fp8" not in configs:
        pytest.skip("main_fp8 not in the golden folder")
    with jax.enable_x64(True):
        yield CaseRunner(configs["main_fp8"])


# With -m slow (75 s on the 2-core CI box for L13, its exact programs free and forced), as is every length in
# test_golden_check_cli_whole_folder. The default suite keeps a whole-model logits check against the
# oracle, free and forced at max |dlogit| 0, on another configuration (tests/golden/test_golden_sweep.py's
# rope64_theta/prefill_L40), and every layer of main_fp8 against its golden outputs (the replays below).
@pytest.mark.slow
@pytest.mark.parametrize("case_name", ["prefill_L5", "prefill_L13"])
def test_short_prefills_free_and_forced(fp8_runner, case_name):
    case = next((c for c in fp8_runner.gc.cases if c["name"] == case_name), None)
    if case is None:
        pytest.skip(f"{case_name} not in this golden folder")
    with jax.enable_x64(True):
        entries = check_case(fp8_runner, case)
    assert [e.passed for e in entries] == [True, True], [e.to_json() for e in entries]
    assert entries[1].topk_sets_equal is True


# slow (57 s on 2 cores: a program per replayed layer): `golden-check` runs the same replay entries
# (main_fp8's `[replay L*]` rows), and the default suite's budget is spent
@pytest.mark.slow
def test_single_layer_replays(fp8_runner):
    case = next(c for c in fp8_runner.gc.cases if c.get("has_intermediates"))
    with jax.enable_x64(True):
        entries = check_replays(fp8_runner, case)
    assert entries and all(e.passed for e in entries), [e.to_json() for e in entries if not e.passed]


@pytest.mark.slow
def test_golden_check_cli_whole_folder(golden_root):
    out = subprocess.run([sys.executable, "-m", "dsv41_jax.cli.main", "golden-check", str(golden_root), "--json"],
                         capture_output=True, text=True)
    cases = json.loads(out.stdout)["cases"]
    failed = [c for c in cases if not c["passed"]]
    assert out.returncode == 0 and not failed, failed
    for c in cases:
        assert set(c) >= {"name", "passed", "max_abs_err", "argmax_agreement", "forced_decisions", "topk_sets_equal"}


def test_golden_check_on_a_folder_without_cases_says_so(tmp_path):
    """An empty folder used to print an empty table; now: rc 2 and the reason (real CLI)."""
    out = subprocess.run([sys.executable, "-m", "dsv41_jax.cli.main", "golden-check", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and f"found no golden cases in {tmp_path}" in out.stderr, out.stderr
    (tmp_path / "quant_vectors.safetensors").write_bytes(b"")
    out = subprocess.run([sys.executable, "-m", "dsv41_jax.cli.main", "golden-check", str(tmp_path), "--only", "main_fp9"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "found no case set named ['main_fp9']" in out.stderr and "['quant']" in out.stderr
