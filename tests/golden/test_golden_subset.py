"""The golden subset the repository ships (golden_subset/): a true part of the full set, and enough for
`dsv41 golden-check` from a fresh clone (the README's command)."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
SUBSET = REPO / "golden_subset"


def test_subset_files_are_the_full_sets_bytes(golden_root):
    for path in sorted(p for p in SUBSET.rglob("*") if p.is_file() and p.name not in ("README.md", "cases.json")):
        full = golden_root / path.relative_to(SUBSET)
        assert full.is_file() and full.read_bytes() == path.read_bytes(), path
    mine = json.loads((SUBSET / "main_fp8" / "cases.json").read_text())
    theirs = json.loads((golden_root / "main_fp8" / "cases.json").read_text())
    by_name = {c["name"]: c for c in theirs["cases"]}
    assert [c["name"] for c in mine["cases"]] == ["prefill_L1", "prefill_L5", "prefill_L13", "decode_P40_S20"]
    assert all(c == by_name[c["name"]] for c in mine["cases"])
    assert {k: v for k, v in mine.items() if k != "cases"} == {k: v for k, v in theirs.items() if k != "cases"}
    for c in mine["cases"]:
        assert (SUBSET / "main_fp8" / c["file"]).is_file()


def test_golden_check_defaults_to_the_shipped_subset(monkeypatch):
    """No folder named and no DSV41_GOLDEN_DIR: the shipped subset is what golden-check reads (running it
    compiles the model: the slow test below)."""
    from dsv41_jax.cli.main import _default_golden_dir
    from dsv41_jax.golden import data as golden_data

    monkeypatch.delenv("DSV41_GOLDEN_DIR", raising=False)
    assert _default_golden_dir() == SUBSET
    assert [gc.name for gc in golden_data.discover(SUBSET)] == ["main_fp8"]
    monkeypatch.setenv("DSV41_GOLDEN_DIR", "/elsewhere")
    assert str(_default_golden_dir()) == "/elsewhere"


@pytest.mark.slow
def test_whole_subset_passes():
    """The README's fresh-clone command: every entry of the subset passes (no folder named)."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "DSV41_GOLDEN_DIR"}
    r = subprocess.run([sys.executable, "-m", "dsv41_jax.cli.main", "golden-check"],
                       capture_output=True, text=True, env={**env, "PYTHONPATH": str(REPO)}, cwd="/", timeout=3600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "main_fp8/decode_P40_S20" in r.stdout and " 0 failed" in r.stdout
