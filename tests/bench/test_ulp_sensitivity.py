"""bench/ulp_sensitivity.py: the one-ulp nudge moves exactly one element a row by one bf16 step, and on a
small config replaying layer 0's exact input unchanged changes nothing while the nudge does."""
from __future__ import annotations

import importlib.util
import pathlib

import ml_dtypes
import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _bench():
    spec = importlib.util.spec_from_file_location("ulp_sensitivity", ROOT / "bench" / "ulp_sensitivity.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_nudge_moves_one_element_a_row_by_one_bf16_step():
    rng = np.random.default_rng(1)
    h = rng.normal(size=(1, 7, 4, 16)).astype(ml_dtypes.bfloat16)
    got = _bench().nudge_one_per_row(h, seed=3)
    diff = (got != h).reshape(7, -1)
    assert diff.sum(-1).tolist() == [1] * 7
    a, b = h.reshape(7, -1)[diff].astype(np.float64), got.reshape(7, -1)[diff].astype(np.float64)
    assert np.all(b > a)
    # one step: nothing representable in bf16 lies strictly between
    assert np.all(np.nextafter(a.astype(ml_dtypes.bfloat16), np.array(np.inf, ml_dtypes.bfloat16)).astype(np.float64) == b)


def test_bad_arguments_say_what_and_how():
    bench = _bench()
    with pytest.raises(SystemExit, match="no config folder 'nope'"):
        bench.measure(ROOT / "tests" / "data" / "sweep", "nope", 8)
    with pytest.raises(SystemExit, match=r"--tokens must be in 1\.\.30"):
        bench.measure(ROOT / "tests" / "data" / "sweep", "ratio4_pool", 31)


@pytest.mark.slow
def test_a_replayed_input_changes_nothing_and_a_nudged_one_does():
    r = _bench().measure(ROOT / "tests" / "data" / "sweep", "ratio4_pool", 16, control=True)
    assert r["logits"]["exact, replayed"]["max_abs"] == 0.0
    assert r["logits"]["exact, nudged"]["max_abs"] > 0.0
    assert all(s["exact, nudged"] > 0 for s in r["sites"] if s["site"].startswith("layer4."))
