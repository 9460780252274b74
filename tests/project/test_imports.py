"""No import cycle between the package's modules (issue 20).

Every `import` statement counts, those inside functions included: a function-level import that
closes a cycle hides a dependency the module layout denies (today's example was
model/transformer.py <-> model/dspark.py). Static (ast), so nothing is imported or compiled.
"""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("dsv41_jax", "pallas_kernels", "sharding")


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its text. `from A import b` counts A.b
    when that is a module (importing a submodule runs its package's __init__ anyway, which is no
    dependency of the submodule on the package's other modules), else A."""
    mods = {}
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
            mods[name.removesuffix(".__init__")] = p
    graph = {m: set() for m in mods}
    for m, p in mods.items():
        here = m if p.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: climb from this module's package
                    parts = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            graph[m].update(t for t in targets if t in mods and t != m)
    return graph


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
