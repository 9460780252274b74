"""The layer body is written once: each per-layer operation is called from model/block.py only.

Counted statically (ast, nothing compiled): the functions that call the operation (a callee,
as written, matching its pattern), anywhere in the package. A kernel call and its XLA twin in
one function are one site: the plan picks between them there. Index scores have one site,
`block.index_scores` (XLA, packed-FP4 or kernel scoring), which full-width selection, in-pool Reindex
scoring and the probes' scoring at sampled positions (training's indexer KL) all call. mHC mixes are
two operations with their own parameters (the attention site's and the FFN site's), one site each.

model.forward, serving's layer ranges, the QAT training forward and the DSpark stage (and its ring
commit) run on `model/block.py`; the ceiling test fails when a copy is added.
"""
import ast
import collections
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
OPS = {
    "queries": r"\.queries$",
    "window K/V": r"\.window_kv$",
    "compressor groups": r"compressor\.groups$",
    "index keys": r"indexer\.keys$",
    "index scores": r"indexer\.(scores|scores_pallas)$|(^|\.)scores_packed$",
    "candidate pool": r"(^|\.)candidate_pool$",
    "top-k": r"(^|\.)(select_topk|_pool_select|_lean_select|_select|topk_indices)$",
    "attention": r"(^|\.)(sparse_attention|attend_pallas)$",
    "mHC attention mixes": r"hc_attn\.mixes$",
    "mHC FFN mixes": r"hc_ffn\.mixes$",
    "MoE": r"(^|\.)ffn(\.route|\.apply)?$",  # route and apply, with the probe's decision between them
}
# Not layer bodies: the cost model times each scoring variant on its own (serving/cost.py) and the
# golden number-format vectors exercise the attention op directly (golden/vectors.py).
NOT_A_BODY = {"dsv41_jax/serving/cost.py", "dsv41_jax/golden/vectors.py"}
# One site each, every driver on model/block.py (at b125a13, before the body: 4, 5, 3, 3, 5, 3, 3, 4,
# 4 for both mHC sites together, 4).
CEILING = {op: 1 for op in OPS}


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


def test_each_layer_operation_is_called_only_by_the_body():
    sites = call_sites()
    outside = {op: [s for s in sites[op] if not s.startswith("dsv41_jax/model/block.py:")] for op in OPS}
    assert not any(outside.values()), outside


def _eqns(jaxpr) -> int:
    """Equations of a jaxpr, those of nested jaxprs (pjit, custom_vjp, ...) included."""
    n = 0
    for e in jaxpr.eqns:
        n += 1
        for p in e.params.values():
            for sub in (p if isinstance(p, (list, tuple)) else [p]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    n += _eqns(inner)
    return n


def test_probes_with_nothing_to_do_trace_to_nothing():
    """The identity probe, and the golden and tap probes when nothing is forced, replayed,
    collected or tapped, add no equation to the body's program (trace only, nothing compiled)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dsv41_jax.config import ModelConfig
    from dsv41_jax.model import block as body
    from dsv41_jax.model.cache import init_cache
    from dsv41_jax.model.probe import NO_PROBE, GoldenProbe, Probe, Probes, TapProbe
    from dsv41_jax.model.transformer import Transformer

    cfg = ModelConfig.tiny(engram_layer_ids=(), n_layers=4, compress_ratios=(0, 2, 2, 1), kv_source_layers=(1, 3),
                           index_source_layers=(1, 3), candidate_source_layer=3, hc_sinkhorn_iters=2)
    gd, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=0)))  # abstract: traced, never run

    def count(probe, probe_inputs=None):
        def run(params, tokens, cache):
            model = nnx.merge(gd, params)
            h, pre = body.embed(model, tokens)
            span = body.Span.at(cache["length"], tokens.shape[1])
            (h, pre, store, _), rec = body.run_layers(model, body.LayerState.first(h, pre, body.QuantStore(cfg, cache)),
                                                      span, body.Plan(), range(cfg.n_layers), probe, probe_inputs)
            return h, pre, store.cache, {k: v for k, v in rec.items() if k not in ("topk_own", "experts_own")}

        return _eqns(jax.make_jaxpr(run)(params, jnp.zeros((1, 3), jnp.int32), init_cache(cfg, 1)).jaxpr)

    class Nothing(Probe):
        pass

    base = count(NO_PROBE)
    assert count(Nothing()) == base
    assert count(GoldenProbe(collect=False)) == base
    assert count(Probes(GoldenProbe(), TapProbe(()))) == base
    assert count(GoldenProbe(collect=True)) > base  # the count sees a probe that records


def test_the_body_asks_a_store_only_what_the_store_protocol_states():
    """Both stores implement every member of `Store`, and the body, run on a store that answers only
    those (any other read fails), traces to the program it traces on the store itself: prefill with
    every probe hook recording, and the engine's decode plan (in-pool and packed index scoring)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dsv41_jax.config import ModelConfig
    from dsv41_jax.model import block as body
    from dsv41_jax.model.cache import init_cache
    from dsv41_jax.model.probe import GoldenProbe
    from dsv41_jax.model.store import QuantStore, Store
    from dsv41_jax.model.transformer import Transformer
    from dsv41_jax.runtime import Runtime
    from dsv41_jax.train.forward import FakeQuantStore

    members = {n for n in vars(Store) if not n.startswith("_")} | set(Store.__annotations__)
    for impl in (QuantStore, FakeQuantStore):
        missing = {n for n in members - {"cfg"} if not callable(getattr(impl, n, None))}
        assert not missing, f"{impl.__name__} does not answer {sorted(missing)}"

    class OnlyTheProtocol:
        def __init__(self, store):
            self.inner = store

        def __getattr__(self, name):
            assert name in members, f"the body read store.{name}, which the Store protocol does not state"
            if name == "copy":
                return lambda: OnlyTheProtocol(self.inner.copy())
            return getattr(self.inner, name)

    # the tiny config's layer 5 reindexes within layer 4's candidate pool (in-pool scoring at decode)
    cfg = ModelConfig.tiny(engram_layer_ids=(), hc_sinkhorn_iters=2)
    gd, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=0)))

    def count(wrap, plan, T):
        def run(params, tokens, cache):
            model = nnx.merge(gd, params)
            h, pre = body.embed(model, tokens)
            span = body.Span.at(cache["length"], tokens.shape[1])
            state, rec = body.run_layers(model, body.LayerState.first(h, pre, wrap(QuantStore(cfg, cache))), span,
                                         plan, range(cfg.n_layers), GoldenProbe(collect=True))
            store = state.store.inner if isinstance(state.store, OnlyTheProtocol) else state.store
            return state.h, store.cache, rec

        return _eqns(jax.make_jaxpr(run)(params, jnp.zeros((1, T), jnp.int32), init_cache(cfg, 1)).jaxpr)

    decode = body.Plan.resolve(Runtime(), pool_scoring=True, packed_scoring=True)
    for plan, T in ((body.Plan(), 3), (decode, 1)):
        assert count(OnlyTheProtocol, plan, T) == count(lambda s: s, plan, T)
