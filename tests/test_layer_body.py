"""The layer body is written once (issue 20): each per-layer operation has one call site.

Counted statically (ast, nothing compiled): the functions that call the operation (a callee,
as written, matching its pattern), anywhere in the package. A kernel call and its XLA twin in
one function are one site: the plan picks between them there. Today the body still has several copies
(model.forward, serving run_layers/project_ced, train_forward, the DSpark stage), so the
target test is an expected failure; the ceiling test fails when a copy is added.
"""
import ast
import collections
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
OPS = {
    "queries": r"\.queries$",
    "window K/V": r"\.window_kv$",
    "compressor groups": r"compressor\.groups$",
    "index keys": r"indexer\.keys$",
    "index scores": r"indexer\.(scores|scores_pallas)$|(^|\.)scores_packed$",
    "candidate pool": r"(^|\.)candidate_pool$",
    "top-k": r"(^|\.)(select_topk|_pool_select|_lean_select|_select|topk_indices)$",
    "attention": r"(^|\.)(sparse_attention|attend_pallas)$",
    "mHC mixes": r"hc_(attn|ffn)\.mixes$",
    "MoE": r"(^|\.)ffn$",
}
# Not layer bodies: the cost model times each scoring variant on its own (serving/cost.py) and the
# golden number-format vectors exercise the attention op directly (golden/vectors.py).
NOT_A_BODY = {"dsv41_jax/serving/cost.py", "dsv41_jax/golden/vectors.py"}
# The counts at b125a13 (five copies; run_layers and project_ced counted as functions there). A change may lower them, never raise them.
CEILING = {"queries": 4, "window K/V": 5, "compressor groups": 3, "index keys": 3, "index scores": 5,
           "candidate pool": 3, "top-k": 3, "attention": 4, "mHC mixes": 4, "MoE": 4}


def call_sites(root=ROOT) -> dict[str, list[str]]:
    """op -> ["file:function", ...]: the functions calling it (module level counts as one)."""
    found = collections.defaultdict(list)
    for pkg in ("dsv41_jax", "sharding"):
        for p in sorted((root / pkg).rglob("*.py")):
            rel = p.relative_to(root).as_posix()
            if rel in NOT_A_BODY:
                continue
            tree = ast.parse(p.read_text(), rel)
            owner = {}  # innermost enclosing function of each node
            for fn in ast.walk(tree):
                if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    for node in ast.walk(fn):
                        owner[node] = fn.name  # inner functions overwrite: ast.walk is outer first
            for node in ast.walk(tree):
                if isinstance(node, ast.Call):
                    callee = ast.unparse(node.func)
                    for op, rx in OPS.items():
                        site = f"{rel}:{owner.get(node, '<module>')}"
                        if re.search(rx, callee) and site not in found[op]:
                            found[op].append(site)
    return found


def test_the_counter_sees_the_forward_body():
    sites = call_sites()
    for op in OPS:
        assert any(s.startswith(("dsv41_jax/model/transformer.py", "dsv41_jax/model/block.py")) for s in sites[op]), \
            (op, sites[op])


def test_no_new_copy_of_a_layer_operation():
    sites = call_sites()
    over = {op: sites[op] for op in OPS if len(sites[op]) > CEILING[op]}
    assert not over, f"a per-layer operation gained a call site; call the one body instead: {over}"


@pytest.mark.xfail(strict=True, reason="issue 20: the body still has copies (forward, run_layers, train_forward, DSpark)")
def test_each_layer_operation_has_one_call_site():
    sites = call_sites()
    many = {op: sites[op] for op in OPS if len(sites[op]) != 1}
    assert not many, many
