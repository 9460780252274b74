"""Configurations the shared golden set does not cover, generated with the oracle (DeepSeek's
reference + the oracle's CPU kernels; `python -m dsv41_jax.golden.sweep`, each folder's
MADE_BY.txt): exact mode reproduces them bit for bit, free and forced, prefill and decode
(published and corrected index keys). Slow: a whole folder takes 112-172 s; the default suite checks
the folders' presence and size.

tests/data/sweep/<name>/ is in the golden format, so this is `dsv41 golden-check` on it: every
entry must pass with max |dlogit| exactly 0.
"""
import pathlib

import pytest

from dsv41_jax.golden.check import run_all
from dsv41_jax.golden.sweep import CONFIGS

SWEEP = pathlib.Path(__file__).parent / "data" / "sweep"


def _check(name):
    entries = run_all(SWEEP, only=[name], log=open("/dev/null", "w"))
    assert entries, f"no entries for {name}"
    bad = [f"{e.name}: {e.detail} (max |d| {e.max_abs_err})" for e in entries
           if not e.passed or (e.max_abs_err is not None and e.max_abs_err != 0.0)]
    assert not bad, "\n".join(bad)


def test_sweep_folders_match_the_generator():
    for name in CONFIGS:
        assert (SWEEP / name / "cases.json").is_file() and (SWEEP / name / "MADE_BY.txt").is_file(), name
        size = sum(p.stat().st_size for p in (SWEEP / name).iterdir())
        assert size < 500_000, f"{name}: {size} bytes"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_sweep_config_bit_exact(name):
    _check(name)
