"""golden-check in parts (`--variant`): the published and corrected parts together are the whole check, each
entry in exactly one part, so a long case can be checked in two processes."""
from __future__ import annotations

import io
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from dsv41_jax.golden import data as golden_data
from dsv41_jax.golden.check import CaseRunner, check_case, run_all

REPO = pathlib.Path(__file__).resolve().parents[2]
SUBSET = REPO / "golden_subset"
SWEEP = REPO / "tests" / "data" / "sweep"


def _stub_runner():
    """A runner over the shipped main_fp8 cases whose `run` records which runs it was asked for and returns
    zero logits (no model is loaded or compiled: only the choice of runs and entries is under test)."""
    (gc,) = golden_data.discover(SUBSET)
    runner = CaseRunner.__new__(CaseRunner)
    runner.gc, runner.cfg, runner.asked = gc, gc.cfg, []

    def run(tokens, schedule, *, quirk=False, impose=True, label="run", **_):
        runner.asked.append((label, quirk, impose))
        n = sum(c["n_tokens"] for c in schedule)
        return np.zeros((n, gc.cfg.vocab_size), np.float32), {"agree": True, "per_layer": {}, "taps": None}

    runner.run = run
    return runner


def test_the_two_parts_are_the_whole_check():
    runner = _stub_runner()
    for case in runner.gc.cases:
        whole = [e.name for e in check_case(runner, case)]
        asked_whole, runner.asked = runner.asked, []
        parts = {v: [e.name for e in check_case(runner, case, v)] for v in ("published", "corrected")}
        assert parts["published"] + parts["corrected"] == whole
        assert sorted(runner.asked) == sorted(asked_whole)
        runner.asked = []
        if case["kind"] == "decode":
            base = f"main_fp8/{case['name']}"
            assert parts == {"published": [f"{base}[published]", f"{base}[published-forced]"],
                             "corrected": [f"{base}[corrected]", f"{base}[corrected-forced]"]}
            # the corrected part runs the corrected index keys (no quirk) only, free then forced
            check_case(runner, case, "corrected")
            assert runner.asked == [("corrected", False, False), ("corrected-forced", False, True)]
            runner.asked = []
        else:  # a prefill case has no variant: all of it in the published part
            assert parts["corrected"] == [] and parts["published"] == whole


def test_an_unknown_variant_is_named():
    runner = _stub_runner()
    with pytest.raises(ValueError, match="variant must be one of .*'published', 'corrected'.* got 'quirk'"):
        check_case(runner, runner.gc.cases[0], "quirk")
    with pytest.raises(ValueError, match="got 'quirk'"):
        run_all(SUBSET, variant="quirk", log=io.StringIO())


@pytest.mark.slow
def test_the_parts_give_the_whole_check_s_entries_bit_for_bit():
    """The real CLI on a small sweep folder (a prefill and a decode case): the two parts' entries, concatenated,
    equal the whole run's, values included (each run starts from an empty cache, so no run depends on another)."""
    def check(*extra):
        r = subprocess.run([sys.executable, "-m", "dsv41_jax.cli.main", "golden-check", str(SWEEP), "--only", "dims_wide",
                            "--json", *extra], capture_output=True, text=True, cwd=REPO, timeout=1800)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        return json.loads(r.stdout)["cases"], r.stderr

    whole, log = check()
    published, _ = check("--variant", "published")
    corrected, _ = check("--variant", "corrected")
    assert published + corrected == whole
    assert [c["name"] for c in corrected] == ["dims_wide/decode_P20_S4[corrected]", "dims_wide/decode_P20_S4[corrected-forced]"]
    # the progress lines: one per call of each run, with compile and run seconds
    assert "corrected-forced: call 5/5 (1 tokens) compile" in log and "free: call 1/1 (20 tokens) compile" in log
