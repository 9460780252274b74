"""Exact mode at the released per-layer shapes (dim 5120, 64 heads x 512, q_lora 1280, o_groups
8 x 1024, index 32 x 128, window 128, mHC 4; `sweep.RELEASED_LAYER`), against the oracle.

The folders' weights are gigabytes, so none is in the repository:
- default suite: `wide_r1_short` (one Full ratio-1 layer, 8 experts top-6, a 72-token prompt, top-k 16:
  the top-k selects and the last rows' attention spans two 64-column blocks).
  tests/data/wide/wide_r1_short holds the oracle's tensors and the folder's config; the weights are
  regenerated here from the config's seed and must hash to the sha256 the oracle saw.
- slow: `wide_full_r1` (a 520-token prompt: the released top-k of 512 selects), `wide_roles`
  (one layer of each role, a 1040-token prompt with the candidate pool restricting, 4 decode
  steps), `vision_wide` (the released vision tower's per-layer shapes in 2 layers, two images of
  different patch grids in one prompt) and `dspark_wide` (the released drafter's shapes with 32 experts a
  stage on three released-width layers, a 526-token prompt, 6 drafted blocks), from $DSV41_WIDE_GOLDEN_DIR, made by
  `python -m dsv41_jax.golden.sweep DIR --only NAME` (docs/NUMERICS.md "At the released width");
  their files must match tests/data/wide/full_width.sha256.
"""
import hashlib
import json
import os
import pathlib
import shutil

import jax
import pytest

from dsv41_jax.golden import data as golden_data
from dsv41_jax.golden.check import CaseRunner, check_case, run_all
from dsv41_jax.golden.sweep import model_args, spec, write_weights

WIDE = pathlib.Path(__file__).resolve().parents[1] / "data" / "wide"


def _not_exact(entries):
    return [f"{e.name}: {e.detail} (max |d| {e.max_abs_err})" for e in entries
            if not e.passed or e.max_abs_err != 0.0]


def test_wide_short_bit_exact(tmp_path):
    """Default-suite share: full-width layer, free and forced, max |dlogit| exactly 0."""
    name = "wide_r1_short"
    folder = tmp_path / name
    shutil.copytree(WIDE / name, folder)
    raw = json.loads((folder / "config.json").read_text())
    sha, _ = write_weights(folder / "weights.safetensors", model_args(name), spec(name)[1])
    assert sha == raw["weights_sha256"], "the generator no longer writes the weights the oracle saw"
    (gc,) = golden_data.discover(tmp_path)
    (case,) = gc.cases
    with jax.enable_x64(True):
        entries = check_case(CaseRunner(gc), case)
    assert [e.name for e in entries] == [f"{name}/prefill_L72[free]", f"{name}/prefill_L72[forced]"]
    assert "top-k selects at layers 0 (up to 72 > 16 compressed positions)" in entries[0].mechanisms
    assert "MoE per-expert, 6 of 8 experts" in entries[0].mechanisms
    bad = _not_exact(entries)
    assert not bad, "\n".join(bad)


def _checksums() -> dict[str, str]:
    lines = (WIDE / "full_width.sha256").read_text().splitlines()
    return {path: sha for sha, path in (line.split() for line in lines if line.strip())}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["wide_full_r1", "wide_roles", "vision_wide", "dspark_wide"])
def test_wide_folder_bit_exact(name):
    root = pathlib.Path(os.environ.get("DSV41_WIDE_GOLDEN_DIR", "")) if os.environ.get("DSV41_WIDE_GOLDEN_DIR") else None
    if root is None or not (root / name / "cases.json").is_file():
        pytest.skip(f"set DSV41_WIDE_GOLDEN_DIR to a folder holding {name}/ (python -m dsv41_jax.golden.sweep DIR "
                    f"--only {name}, docs/NUMERICS.md \"At the released width\")")
    sums = {p: s for p, s in _checksums().items() if p.startswith(name + "/")}
    assert sums, f"no checksums for {name}"
    for path, want in sums.items():
        with open(root / path, "rb") as f:
            assert hashlib.file_digest(f, "sha256").hexdigest() == want, f"{path} is not the recorded folder"
    entries = run_all(root, only=[name], log=open(os.devnull, "w"))
    assert entries, f"no entries for {name}"
    bad = _not_exact(entries)
    assert not bad, "\n".join(bad)
