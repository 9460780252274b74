"""The import structure: no cycle between modules, packages depend downward, no private name
crosses a module boundary.

Every `import` statement counts, those inside functions included: a function-level import that
closes a cycle or reaches up a layer hides a dependency the layout denies (an earlier example was
model/transformer.py <-> model/dspark.py). Static (ast), so nothing is imported or compiled.
"""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("dsv41_jax", "pallas_kernels", "sharding")

# The package layering: a module imports its own package and packages of a LOWER rank only (same
# rank is sideways, also refused). Read bottom-up it is numerics <- layers <- model <- serving/train
# <- cli, with these placements:
RANK = {
    # Leaves, importing no other package. The config is the shared static description of the model
    # (shapes, layer roles) and the runtime the static switches of how it computes: every layer
    # reads them, so they sit at the bottom beside numerics. Text and Engram hashing are host-only.
    "dsv41_jax.numerics": 0, "dsv41_jax.config": 0, "dsv41_jax.runtime": 0,
    "dsv41_jax.text": 0, "dsv41_jax.engram": 0,
    "pallas_kernels": 1,  # the kernels, behind the layers' impl= switch (and numerics only: KERNEL_DEPS)
    "dsv41_jax.layers": 2,
    "dsv41_jax.vision": 3,  # the image tower, a part the model holds, and the host image pipeline
    "dsv41_jax.model": 4,
    "dsv41_jax.checkpoint": 5,  # reads and writes the model's weights
    # sharding sits beside serving as a top-level package, one rank below it: serving and train hand
    # their arrays to its layouts (the engine's mesh strategies, the training mesh) and it imports
    # neither of them.
    "sharding": 6,
    "dsv41_jax.serving": 7, "dsv41_jax.train": 7, "dsv41_jax.golden": 7,  # the drivers of the model
    "dsv41_jax.cli": 8,
    "dsv41_jax": 8,  # the package's own __init__ (imports nothing)
}
KERNEL_DEPS = {"pallas_kernels", "dsv41_jax.numerics"}  # kernels compute on the number formats only
# Edges the ranks refuse but the design wants, each with its reason: (importer package, imported).
ALLOWED: dict[tuple[str, str], str] = {}


def module_sources(root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    """module name -> file, for every module of PACKAGES."""
    mods = {}
    for pkg in PACKAGES:
        for p in (root / pkg).rglob("*.py"):
            name = ".".join(p.relative_to(root).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = p
    return mods


def _imported(node, here: str, mods) -> list[str]:
    """The package modules one import statement names. `from A import b` counts A.b when that is a
    module (importing a submodule runs its package's __init__ anyway, which is no dependency of the
    submodule on the package's other modules), else A."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:  # relative: climb from this module's package
        parts = here.split(".")[: len(here.split(".")) - node.level + 1]
        base = ".".join(parts + ([base] if base else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]


def import_graph(texts: dict[str, str] | None = None, packages: set[str] | None = None) -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its text (function bodies included).

    texts: module name -> source, default the tree's files; names ending in `.__init__` are packages."""
    if texts is None:
        texts = {(m + ".__init__" if p.name == "__init__.py" else m): p.read_text()
                 for m, p in module_sources().items()}
    mods = {m.removesuffix(".__init__") for m in texts}
    graph = {m: set() for m in mods}
    for name, text in texts.items():
        m = name.removesuffix(".__init__")
        here = m if name.endswith(".__init__") else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(text, name)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                graph[m].update(t for t in _imported(node, here, mods) if t in mods and t != m)
    return graph


def package_of(module: str) -> str:
    """The layering unit of a module: a subpackage or top module of dsv41_jax (config_checks is the
    config's), or a top-level package."""
    parts = module.split(".")
    if parts[0] != "dsv41_jax":
        return parts[0]
    if len(parts) == 1:
        return "dsv41_jax"
    return "dsv41_jax.config" if parts[1] == "config_checks" else f"dsv41_jax.{parts[1]}"


def is_test_module(module: str) -> bool:
    """Tests beside their kernels (pallas_kernels/*/test_*.py) compare against the model's layers:
    they are consumers of the packages, never imported by them, so the layering does not bind them."""
    return module.rpartition(".")[2].startswith("test_")


def layering_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a package module that goes up or sideways in RANK, or out of KERNEL_DEPS."""
    out = []
    for m in sorted(graph):
        if is_test_module(m):
            continue
        a = package_of(m)
        for t in sorted(graph[m]):
            b = package_of(t)
            if a == b or (a, b) in ALLOWED:
                continue
            if a == "pallas_kernels" and b not in KERNEL_DEPS:
                out.append(f"{m} -> {t}: kernels import numerics only")
            elif RANK[b] >= RANK[a]:
                out.append(f"{m} -> {t}: {a} (rank {RANK[a]}) may not import {b} (rank {RANK[b]})")
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_imports_inside_functions():
    graph = import_graph()
    # golden/check.py imports the image merge inside check_vision only
    assert "dsv41_jax.vision.merge" in graph["dsv41_jax.golden.check"]


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, f"import cycles (move the shared names to a module both can import): {found}"


def test_every_package_has_a_rank():
    assert {package_of(m) for m in import_graph()} <= set(RANK)


def test_packages_depend_downward():
    found = layering_violations(import_graph())
    assert not found, ("imports against the package layering (move the code down to where both can "
                       "import it, or add the edge to ALLOWED with its reason):\n" + "\n".join(found))


def _tree_with(**extra: str) -> dict[str, str]:
    texts = {(m + ".__init__" if p.name == "__init__.py" else m): p.read_text() for m, p in module_sources().items()}
    texts.update({k.replace("__", "."): v for k, v in extra.items()})
    return texts


def test_the_layering_check_reports_an_upward_import_inside_a_function():
    # a numerics module reaching the model from inside a function, and a kernel reading the config
    texts = _tree_with(dsv41_jax__numerics__probe_up="def f():\n    from dsv41_jax.model import transformer\n",
                       pallas_kernels__probe_cfg="from dsv41_jax.config import ModelConfig\n",
                       dsv41_jax__serving__probe_side="import dsv41_jax.train.loop\n")
    found = layering_violations(import_graph(texts))
    assert found == [
        "dsv41_jax.numerics.probe_up -> dsv41_jax.model.transformer: dsv41_jax.numerics (rank 0) may not import "
        "dsv41_jax.model (rank 4)",
        "dsv41_jax.serving.probe_side -> dsv41_jax.train.loop: dsv41_jax.serving (rank 7) may not import "
        "dsv41_jax.train (rank 7)",
        "pallas_kernels.probe_cfg -> dsv41_jax.config: kernels import numerics only",
    ]


def private_imports(texts: dict[str, str] | None = None) -> list[str]:
    """`from m import _x` and `m._x` (m an imported project module) anywhere in package code."""
    if texts is None:
        texts = {m: p.read_text() for m, p in module_sources().items()}
    out = []
    for name, text in sorted(texts.items()):
        tree = ast.parse(text, name)
        modules = set()  # local names bound to project modules by `import a.b as m` / `from a import b`
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES:
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        out.append(f"{name}: from {node.module} import {a.name}")
                    modules.add(a.asname or a.name)
            elif isinstance(node, ast.Import):
                modules.update(a.asname or a.name for a in node.names if a.name.split(".")[0] in PACKAGES)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id in modules):
                out.append(f"{name}: {node.value.id}.{node.attr}")
    return out


def test_no_private_name_crosses_a_module():
    found = private_imports()
    assert not found, "private names used across modules (make them public where they belong):\n" + "\n".join(found)


def test_the_private_name_check_reports_both_spellings():
    found = private_imports({"a": "from dsv41_jax.serving import generate as G\nG._tables()\n",
                             "b": "from sharding.rules import _path_tuple\n", "c": "import os\nos._exit(0)\n"})
    assert found == ["a: G._tables", "b: from sharding.rules import _path_tuple"]


def _explained(lines: list[str], lineno: int) -> bool:
    """An import line with a comment on it, or heading the group of imports it is in."""
    if "#" in lines[lineno - 1]:
        return True
    i = lineno - 2
    while i >= 0 and lines[i].strip().startswith(("from ", "import ")):
        i -= 1
    return i >= 0 and lines[i].strip().startswith("#")


def unexplained_deferred_imports(texts: dict[str, str] | None = None) -> dict[str, list[str]]:
    """package -> ["module:line", ...]: imports of project modules inside functions with no comment
    saying why (`_explained`), in package code (test modules aside)."""
    if texts is None:
        texts = {m: p.read_text() for m, p in module_sources().items()}
    out: dict[str, set[str]] = {}
    for name, text in sorted(texts.items()):
        if is_test_module(name):
            continue
        lines = text.splitlines()
        for fn in ast.walk(ast.parse(text, name)):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    if (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES
                            and not _explained(lines, node.lineno)):
                        out.setdefault(package_of(name), set()).add(f"{name}:{node.lineno}")
    return {k: sorted(v) for k, v in out.items()}


def test_imports_inside_functions_say_why():
    """An import inside a function breaks a cycle or defers a heavy optional import (the CLI loads
    nothing of the model before a command runs; a backend's kernel module loads for that backend),
    with a comment saying which, on the line or heading its group of imports."""
    found = unexplained_deferred_imports()
    assert not found, ("imports inside functions without a comment saying why (a cycle they break or a heavy "
                       f"optional import they defer); import at the top of the module instead: {found}")


def test_the_deferred_import_check_reads_comments():
    found = unexplained_deferred_imports({
        "dsv41_jax.numerics.a": "def f():\n    from dsv41_jax.numerics import quant\n",
        "dsv41_jax.numerics.b": "def f():\n    from dsv41_jax.numerics import quant  # deferred: why\n",
        "dsv41_jax.numerics.c": "def f():\n    # deferred: why\n    from x import y\n    from dsv41_jax.numerics import quant\n"})
    assert found == {"dsv41_jax.numerics": ["dsv41_jax.numerics.a:2"]}
