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

NOTEBOOKS_DIR = pathlib.Path(__file__).resolve().parents[2] / "notebooks"
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


# Running a notebook costs 40-60 s of the 2-core CI box (a kernel, imports, its compiles): the default
# suite runs the quickstart; the other three run with -m slow. Their library calls are checked in the
# default suite by test_notebook_library_calls_resolve (names, attributes, keyword arguments), and what
# those calls compute is tested directly: training and export (tests/train/test_train.py), the sharded step
# against one device (tests/sharding/test_sharding.py), plans (tests/test_plan*.py), model_info (tests/model/test_info.py).
DEFAULT_RUN = {"01_quickstart"}
RUNS = [pytest.param(p, id=p.stem, marks=() if p.stem in DEFAULT_RUN else pytest.mark.slow) for p in NOTEBOOKS]


def _code_cells(path):
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def _resolve(module: str, name: str):
    import importlib

    mod = importlib.import_module(module)
    if hasattr(mod, name):
        return getattr(mod, name)
    return importlib.import_module(f"{module}.{name}")  # a submodule not imported by its package


@pytest.mark.parametrize("path", NOTEBOOKS, ids=_ids(NOTEBOOKS))
def test_notebook_library_calls_resolve(path):
    """Every `from dsv41_jax|sharding... import x` in the notebook resolves; every `x.attr` on such a name
    exists; every call of such a name (or of its attribute) passes keywords its signature accepts. This
    catches a renamed or removed API without running the notebook (no kernel, nothing compiled)."""
    import ast
    import inspect

    bound, problems = {}, []
    trees = [ast.parse(src, filename=f"{path.name} cell") for src in _code_cells(path)]
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in ("dsv41_jax", "sharding"):
                for alias in node.names:
                    try:
                        bound[alias.asname or alias.name] = _resolve(node.module, alias.name)
                    except (ImportError, AttributeError) as e:
                        problems.append(f"from {node.module} import {alias.name}: {e}")
    assert bound or problems, f"{path.name}: no library imports found"

    def target(expr):
        if isinstance(expr, ast.Name) and expr.id in bound:
            return bound[expr.id], expr.id
        if isinstance(expr, ast.Attribute):
            owner = target(expr.value)
            if owner is not None:
                if not hasattr(owner[0], expr.attr):
                    problems.append(f"{owner[1]}.{expr.attr} does not exist")
                    return None
                return getattr(owner[0], expr.attr), f"{owner[1]}.{expr.attr}"
        return None

    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and not isinstance(getattr(node, "ctx", None), ast.Store):
                target(node)
            if isinstance(node, ast.Call) and (found := target(node.func)) is not None and callable(found[0]):
                try:
                    params = inspect.signature(found[0]).parameters.values()
                except (TypeError, ValueError):
                    continue
                if any(p.kind is p.VAR_KEYWORD for p in params):
                    continue
                names = {p.name for p in params if p.kind is not p.POSITIONAL_ONLY}
                problems += [f"{found[1]}(..., {k.arg}=...) is not a parameter" for k in node.keywords
                             if k.arg is not None and k.arg not in names]
    assert not problems, f"{path.name}: " + "; ".join(sorted(set(problems)))


@pytest.mark.parametrize("path", RUNS)
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
