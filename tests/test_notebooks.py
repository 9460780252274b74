"""The notebooks in notebooks/: committed without outputs, and each runs top to bottom at the tiny size.

Execution uses nbclient with the `python3` kernel and DSV41_NB_TINY=1 (the notebooks' smallest
sizes). The kernel starts in notebooks/, so each notebook's first cell finds this checkout and skips
its pip install. The kernel gets the environment a fresh runtime would have: the 8 fake CPU devices
that the test session's conftest requests are removed from XLA_FLAGS (the sharding notebook asks
for its own). Each notebook has a wall-clock limit (DSV41_NB_TIMEOUT, default 900 s), which only
guards against a hang: the notebooks take one to two minutes each on a busy 2-core machine.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import time

import pytest

NOTEBOOKS_DIR = pathlib.Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOKS_DIR.glob("*.ipynb"))
TIMEOUT_S = float(os.environ.get("DSV41_NB_TIMEOUT", "900"))
REPO_URL_LINE = re.compile(r'^REPO_URL = "https://github\.com/[\w.-]+/[\w.-]+"$', re.M)


def _ids(paths):
    return [p.stem for p in paths]


def test_there_are_four_notebooks():
    assert [p.name for p in NOTEBOOKS] == ["01_quickstart.ipynb", "02_architecture_tour.ipynb",
                                           "03_qat_finetune.ipynb", "04_sharding_walkthrough.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_committed_without_outputs(path):
    """Outputs are never committed: every code cell has no outputs and no execution count."""
    nb = json.loads(path.read_text())
    dirty = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"
             and (c.get("outputs") or c.get("execution_count") is not None)]
    assert not dirty, (f"{path.name}: code cells {dirty} carry outputs; clear them before committing "
                       f"(e.g. jupyter nbconvert --clear-output --inplace {path.name})")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_first_cell_installs_with_pip_from_one_repo_url(path):
    nb = json.loads(path.read_text())
    first = next(c for c in nb["cells"] if c["cell_type"] == "code")
    src = "".join(first["source"])
    assert len(REPO_URL_LINE.findall(src)) == 1, "the first code cell must set REPO_URL once, at the top"
    assert src.index("REPO_URL =") < src.index("import "), "REPO_URL must be the first statement"
    assert '"pip", "install"' in src and "git+{REPO_URL}" in src and '"-e"' in src
    assert "DSV41_NB_TINY" in src


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_runs_at_tiny_size(path, monkeypatch):
    missing = []
    for mod in ("nbclient", "nbformat", "ipykernel", "matplotlib"):
        try:
            __import__(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        pytest.skip(f"notebook execution needs {', '.join(missing)}: pip install -e '.[dev]'")
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError

    monkeypatch.setenv("DSV41_NB_TINY", "1")
    monkeypatch.delenv("DSV41_NB_SIZE", raising=False)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")).strip()
    monkeypatch.setenv("XLA_FLAGS", flags)

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, kernel_name="python3", timeout=int(TIMEOUT_S),
                            resources={"metadata": {"path": str(NOTEBOOKS_DIR)}})
    deadline = time.monotonic() + TIMEOUT_S
    with client.setup_kernel():
        for index, cell in enumerate(nb.cells):
            left = deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"{path.name} did not finish within {TIMEOUT_S:.0f}s (stopped before cell {index}); "
                            "raise DSV41_NB_TIMEOUT on a slow machine")
            client.timeout = max(int(left), 1)
            try:
                client.execute_cell(cell, index)
            except CellTimeoutError:
                pytest.fail(f"{path.name}: cell {index} was still running when the notebook's {TIMEOUT_S:.0f}s ran out")
    images = sum(1 for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
                 if "image/png" in o.get("data", {}))
    expected_plots = {"01": 0, "02": 4, "03": 1, "04": 2}[path.name[:2]]
    assert images >= expected_plots, f"{path.name} produced {images} plots, expected {expected_plots}"
