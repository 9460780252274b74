"""Runs of same-kind layers as one scan (`block.layer_runs`, `block.scan_run`): which layers form a
run, that the program stops growing with a run's length, and that the scan computes what the
unrolled layers compute, bit for bit (stream, cache, pending writes, records)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax.config import ModelConfig
from dsv41_jax.model import block as body
from dsv41_jax.model import stack
from dsv41_jax.model.cache import init_cache
from dsv41_jax.model.probe import GoldenProbe, TapProbe
from dsv41_jax.model.transformer import Transformer, forward, stack_layers
from dsv41_jax.runtime import Runtime


def _cfg(reuse: int = 2, **kw) -> ModelConfig:
    """SWA x2, Full r2, Reuse r2 x `reuse`, Full r1 (pool), Reindex r1, Reuse r1 x2: three runs."""
    n = 7 + reuse
    src1 = 3 + reuse
    return ModelConfig.tiny(n_layers=n, compress_ratios=(0, 0, 2) + (2,) * reuse + (1, 1, 1, 1),
                            kv_source_layers=(2, src1), index_source_layers=(2, src1, src1 + 1),
                            candidate_source_layer=src1, engram_layer_ids=(), hc_sinkhorn_iters=2, **kw)


def test_runs_of_the_released_stack():
    cfg = ModelConfig.v41_flash()
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=0))
    plan = body.Plan()
    runs = body.layer_runs(model, range(40), plan)
    assert [r for r in runs if len(r) > 1] == [tuple(range(a, a + n)) for a, n in
                                               ((3, 5), (9, 5), (15, 5), (21, 3), (25, 3), (29, 3), (33, 3), (37, 3))]
    assert sum(map(len, runs)) == 40 and [l for r in runs for l in r] == list(range(40))
    # a probe that acts on a layer by its number takes it out of its run; so does Runtime(scan_layers=False)
    assert body.layer_runs(model, range(36, 40), plan, TapProbe((38,))) == [(36,), (37,), (38,), (39,)]
    assert body.layer_runs(model, range(3, 8), plan, GoldenProbe(), {"experts": {5: None}}) == [(3, 4), (5,), (6, 7)]
    assert all(len(r) == 1 for r in body.layer_runs(model, range(40), plan, GoldenProbe(collect=True)))
    unrolled = body.Plan.resolve(Runtime(scan_layers=False))
    assert all(len(r) == 1 for r in body.layer_runs(model, range(40), unrolled))
    # the engine's stacks (`stack_layers`): these runs; with DSpark's taps (a speculating engine,
    # `forward` on this config) the tapped layers 37-39 stay per layer
    for taps, last in ((False, 37), (True, 33)):
        held = nnx.merge(*stack_layers(*nnx.split(model), plan, taps))
        stacks = {b.run for b in held.layers if isinstance(b, stack.LayerStack)}
        assert stacks == {r for r in runs if len(r) > 1 and r[0] <= last}, taps


def _eqns(jaxpr) -> int:
    return len(jaxpr.eqns)


def test_the_program_does_not_grow_with_a_runs_length():
    """The traced program of a forward with 2 or 6 Reuse layers in a run has the same number of
    top-level equations (one scan), where unrolled it grows by a layer's worth per layer."""
    def count(reuse, scan):
        cfg = _cfg(reuse)
        gd, params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=0)))
        plan = body.Plan.resolve(Runtime(scan_layers=scan))

        def run(params, tokens, cache):
            model = nnx.merge(gd, params)
            h, pre = body.embed(model, tokens)
            span = body.Span.at(cache["length"], tokens.shape[1])
            state, _ = body.run_layers(model, body.LayerState.first(h, pre, body.QuantStore(cfg, cache)), span, plan,
                                       range(cfg.n_layers))
            return state.h

        return _eqns(jax.make_jaxpr(run)(params, jnp.zeros((1, 3), jnp.int32), init_cache(cfg, 1)).jaxpr)

    # the stacked parameters and window rings add a few equations per layer, not a layer's body
    per_layer = count(3, False) - count(2, False)
    assert per_layer > 100 and count(6, True) - count(2, True) < per_layer // 4


def _layers_fn(cfg, gd, plan, T):
    @jax.jit
    def run(params, tokens, cache):
        model = nnx.merge(gd, params)
        h, pre = body.embed(model, tokens)
        start = cache["length"]
        span = body.Span.at(start, T)
        store = (body.QuantStore.pending_for(cfg, cache, start) if plan.writes == "pending"
                 else body.QuantStore(cfg, cache))
        state, rec = body.run_layers(model, body.LayerState.first(h, pre, store), span, plan, range(cfg.n_layers))
        return state.h, state.pre, state.store.cache, state.store.pending, rec, state.carry

    return run


def _same(a, b, what):
    la, lb = jax.tree.leaves_with_path(a), jax.tree.leaves_with_path(b)
    assert [p for p, _ in la] == [p for p, _ in lb], what
    for (path, x), (_, y) in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"{what} {jax.tree_util.keystr(path)}")


def _compare(cfg, params_gd, mode, chunks, cache):
    """Each (writes, T, plan knobs) chunk run scanned and unrolled from the same cache: bitwise equal;
    the next chunk continues from the scanned run's cache when the chunk wrote it."""
    gd, params = params_gd
    rng = np.random.default_rng(0)
    for writes, T, extra in chunks:
        tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, T)), jnp.int32)
        outs = [_layers_fn(cfg, gd, body.Plan.resolve(Runtime(mode=mode, scan_layers=scan), writes=writes, **extra),
                           T)(params, tokens, cache)
                for scan in (True, False)]
        _same(outs[0], outs[1], f"{writes} T={T}")
        if writes == "all":
            cache = {**outs[0][2], "length": cache["length"] + T}


def test_scan_computes_what_the_unrolled_layers_compute():
    """A pending chunk (the speculative verify's: it writes the cache and keeps its writes) of 5
    tokens on rows at lengths 0 and 2, scanned and unrolled: bitwise equal."""
    cfg = _cfg(2)
    cache = {**init_cache(cfg, 2), "length": jnp.asarray([0, 2], jnp.int32)}
    _compare(cfg, nnx.split(Transformer(cfg, rngs=1)), "fast", [("pending", 5, {})], cache)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fast", "exact"])
def test_scan_computes_what_the_unrolled_layers_compute_prefill_decode_verify(mode):
    """Prefill of 13 tokens, then the engine's decode plan (in-pool, packed scoring) and a pending
    (speculative verify) chunk of 3 on the filled cache: scanned and unrolled, bitwise equal."""
    cfg = _cfg(2)
    with jax.enable_x64(mode == "exact"):
        cache = {**init_cache(cfg, 2), "length": jnp.asarray([0, 2], jnp.int32)}
        chunks = [("all", 13, {}), ("all", 1, {"pool_scoring": True, "packed_scoring": mode == "fast"}),
                  ("pending", 3, {})]
        _compare(cfg, nnx.split(Transformer(cfg, rngs=1)), mode, chunks, cache)


def _prims(closed) -> dict:
    """{primitive name: count} over a jaxpr and every jaxpr inside it (scan bodies, jit calls)."""
    counts: dict = {}

    def walk(jaxpr):
        for e in jaxpr.eqns:
            counts[e.primitive.name] = counts.get(e.primitive.name, 0) + 1
            for v in e.params.values():
                for sub in (v if isinstance(v, (list, tuple)) else [v]):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(closed.jaxpr)
    return counts


def _held(cfg, abstract=False):
    make = lambda: Transformer(cfg, rngs=1)  # noqa: E731
    gd, params = nnx.split(nnx.eval_shape(make) if abstract else make())
    plan = body.Plan.resolve(Runtime())
    return (gd, params), stack_layers(gd, params, plan), plan


def _fwd(g, collect=False):
    return lambda p, t, c: forward(nnx.merge(g, p), t, c, collect=collect)


def test_runs_held_stacked_are_sliced_not_stacked_per_call():
    """`stack_layers` (what the engine holds, made at load): each run of the scan one `LayerStack`
    (its parameters once, on a leading axis, at layers.{first}.stacked; each layer's slice is the
    layer's own), and the forward over it stacks no parameters in the program (the `stack`
    equations left are the window rings' and the records')."""
    cfg = _cfg(2)
    (gd, params), (sgd, sparams), plan = _held(cfg, abstract=True)
    held = nnx.merge(sgd, sparams)
    runs = [(0, 1), (3, 4), (7, 8)]
    assert [r for r in body.layer_runs(held, range(cfg.n_layers), plan) if len(r) > 1] == runs
    for run in runs:
        assert all(held.layers[l] is held.layers[run[0]] for l in run)
        assert isinstance(held.layers[run[0]], stack.LayerStack) and held.layers[run[0]].run == run
    flat = dict(nnx.to_flat_state(sparams))
    assert ("layers", 1, "attn", "wo_a", "weight") not in flat
    assert flat[("layers", 0, "stacked", "attn", "wo_a", "weight")].shape[0] == 2
    tokens, cache = jnp.zeros((2, 5), jnp.int32), init_cache(cfg, 2)
    per_layer = len(jax.tree.leaves(params["layers"][0]))
    stacks = [_prims(jax.make_jaxpr(_fwd(g))(p, tokens, cache)).get("stack", 0)
              for g, p in ((gd, params), (sgd, sparams))]
    assert stacks[0] - stacks[1] == per_layer * len(runs)
    # a plan that scans nothing holds nothing stacked
    assert stack_layers(gd, params, body.Plan.resolve(Runtime(scan_layers=False)))[1] is params


@pytest.mark.slow
def test_runs_held_stacked_compute_what_the_layers_compute():
    """A forward over the stacked runs equals the per-layer model's, bit for bit, scanned and with
    every layer taken out of its run (golden's collect: each layer reads its slice of the stack,
    which is the layer's own)."""
    cfg = _cfg(2)
    (gd, params), (sgd, sparams), _ = _held(cfg)
    for l in (3, 4):
        one = stack.layer(nnx.merge(sgd, sparams), l)
        assert (one.layer, one.role) == (l, cfg.roles[l])
        _same(nnx.state(one), params["layers"][l], f"layer {l}")
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 5)), jnp.int32)
    cache = init_cache(cfg, 2)
    for collect in (False, True):
        _same(jax.jit(_fwd(sgd, collect))(sparams, tokens, cache), jax.jit(_fwd(gd, collect))(params, tokens, cache),
              f"stacked, collect={collect}")
