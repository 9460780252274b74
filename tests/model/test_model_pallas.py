"""The model with impl="pallas" (interpreted kernels) against impl="xla": prefill and decode.

With impl="pallas" the forward runs three Pallas kernels: sparse sink attention (every layer),
the indexer scores (every index source) and the grouped MXFP4 expert GEMM (every MoE), all in
the Pallas interpreter on CPU (Runtime.interpret defaults to "on the CPU backend").

Fast-mode tolerance. The kernels compute the same rounding points as the xla path (bf16 caches
decoded exactly, P rounded to bf16 for P.V, the indexer's bf16 storage points, FP8 activations),
and differ only in f32 summation order: the TPU kernels sum the head dimension as 8 partial dots
(their 32-bit word view), the expert GEMM sums K in one dot instead of XLA's order. The golden
README measured what changing the accumulation of *every* GEMM from exact to f32 does to the
logits of a short prefill of this model family: max |dlogit| 0.078 ("FP32 GEMM accumulation",
main_fp8, L13 free). The kernels change a subset of those accumulations, so that bound applies
(`golden.check.FP32_ACCUMULATION_ROW`); top-k and expert decisions must be identical (a flipped
decision would move logits by O(0.1-1), far outside it). In practice the two paths agree bit for
bit on this config; the tolerance only keeps the test from depending on summation order.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dsv41_jax.golden.check import FP32_ACCUMULATION_ROW
from dsv41_jax.model.transformer import forward, init_cache, make_step
from dsv41_jax.runtime import Runtime

LOGIT_TOL = FP32_ACCUMULATION_ROW["main_fp8"]["short_max"]
# a prefill past the window (4) and the pool capacity, then two decode steps; the impl="xla" runs go
# through conftest's tiny_fast_step, whose prefill of 13 and decode step test_model.py compiled already
CHUNKS = (13, 1, 1)


@pytest.fixture(scope="module")
def tiny(tiny_every_role):
    return tiny_every_role  # conftest.py: every layer role, window/pool/top-k binding early


def _run(tiny, step, tokens, chunks=CHUNKS):
    cfg, graphdef, params = tiny
    cache, out, s = init_cache(cfg, tokens.shape[0]), [], 0
    for n in chunks:
        logits, cache, aux = step(params, jnp.asarray(tokens[:, s:s + n]), cache)
        out.append((np.asarray(logits), jax.tree.map(np.asarray, aux["topk"]), jax.tree.map(np.asarray, aux["experts"])))
        s += n
    return out


@pytest.fixture(scope="module")
def pallas_step(tiny):
    """One jitted step for the module: the slow decode runs reuse the default prefill's program."""
    return make_step(tiny[1], Runtime(mode="fast", impl="pallas"))


def _tokens(tiny):
    return np.random.default_rng(0).integers(0, tiny[0].vocab_size, size=(2, sum(CHUNKS)))


@pytest.fixture(scope="module")
def fast_prefills(tiny, tiny_fast_step, pallas_step):
    """The default suite's share: the prefill only (the interpreted kernels' decode programs cost
    another ~30 s of compilation on 2 cores; test_decode_pallas_matches_xla runs them with -m slow)."""
    tokens = _tokens(tiny)
    return _run(tiny, tiny_fast_step, tokens, CHUNKS[:1]), _run(tiny, pallas_step, tokens, CHUNKS[:1])


@pytest.fixture(scope="module")
def fast_runs(tiny, tiny_fast_step, pallas_step):
    tokens = _tokens(tiny)
    xla = _run(tiny, tiny_fast_step, tokens)  # fast, impl="xla"
    pallas = _run(tiny, pallas_step, tokens)
    return xla, pallas


def _compare(xla, pallas, tol):
    (lx, tx, ex), (lp, tp, ep) = xla, pallas
    assert tx.keys() == tp.keys() and ex.keys() == ep.keys()
    for layer in tx:
        np.testing.assert_array_equal(tp[layer], tx[layer], err_msg=f"top-k of layer {layer}")
    for layer in ex:
        np.testing.assert_array_equal(ep[layer], ex[layer], err_msg=f"experts of layer {layer}")
    err = float(np.max(np.abs(lp.astype(np.float64) - lx)))
    assert err <= tol, f"max |dlogit| {err:.3g} > {tol}"


def test_prefill_pallas_matches_xla(fast_prefills):
    xla, pallas = fast_prefills
    _compare(xla[0], pallas[0], LOGIT_TOL)


@pytest.mark.slow
def test_decode_pallas_matches_xla(fast_runs):
    xla, pallas = fast_runs
    for step in range(1, len(CHUNKS)):
        _compare(xla[step], pallas[step], LOGIT_TOL)


def _pallas_kernels_in(tiny, runtime):
    cfg, graphdef, params = tiny

    def f(params, tokens, cache):
        return forward(nnx.merge(graphdef, params), tokens, cache, runtime=runtime)[0]

    text = str(jax.make_jaxpr(f)(params, jnp.zeros((1, 3), jnp.int32), init_cache(cfg, 1)))
    return set(re.findall(r"name=(\w+_(?:tpu|gpu))\b", text))


def test_the_forward_runs_the_kernels_only_for_pallas(tiny):
    assert _pallas_kernels_in(tiny, Runtime(impl="pallas")) == {
        "sparse_sink_attention_tpu", "indexer_scores_tpu", "grouped_fp4_gemm_tpu"}
    assert _pallas_kernels_in(tiny, Runtime(impl="xla")) == set()
    # the dense FP8 linears' kernel: on by default where the kernels are compiled, or when asked
    fp8 = {"sparse_sink_attention_tpu", "indexer_scores_tpu", "grouped_fp4_gemm_tpu", "fp8_block_gemm_tpu"}
    assert _pallas_kernels_in(tiny, Runtime(impl="pallas", fp8_kernel=True)) == fp8
    # what "auto" and compiled kernels resolve to, read where the forward reads it (each trace costs ~7 s
    # on 2 cores; the forward branches on these resolved values only)
    assert Runtime(impl="auto").resolved_impl() == "xla"  # auto on CPU = xla
    assert Runtime(impl="pallas", interpret=False).resolved_fp8_kernel() is True
    assert Runtime(impl="pallas").resolved_fp8_kernel() is False  # interpreted: off unless asked


@pytest.mark.slow
def test_prefill_and_decode_with_the_fp8_kernel_match_xla(tiny, tiny_fast_step, fast_runs):
    """The dense FP8 linears through the FP8 block GEMM kernel too (interpreted; slow: 55 more
    interpreted kernels to compile): decisions equal, logits within the fast-mode tolerance."""
    tokens = np.random.default_rng(0).integers(0, tiny[0].vocab_size, size=(2, sum(CHUNKS)))
    xla, _ = fast_runs
    fp8 = _run(tiny, make_step(tiny[1], Runtime(mode="fast", impl="pallas", fp8_kernel=True)), tokens)
    for step in range(len(CHUNKS)):
        _compare(xla[step], fp8[step], LOGIT_TOL)


def test_runtime_kernel_mode():
    assert Runtime(impl="xla").kernel_mode() is None
    assert Runtime(impl="pallas").kernel_mode() == "fast"
    assert Runtime(impl="pallas", mode="exact").kernel_mode() == "exact"  # interpreted on CPU: float64 ok
    assert Runtime(impl="pallas", mode="exact", interpret=False).kernel_mode() is None  # compiled: no float64
    with pytest.raises(ValueError, match="interpret"):
        Runtime(interpret="yes")


@pytest.mark.slow
def test_exact_mode_pallas_is_bit_identical_to_xla(tiny):
    """Exact mode: the interpreted kernels accumulate in float64 at the oracle's rounding points."""
    tokens = np.random.default_rng(1).integers(0, tiny[0].vocab_size, size=(2, sum(CHUNKS)))
    with jax.enable_x64(True):
        xla = _run(tiny, make_step(tiny[1], Runtime(mode="exact", impl="xla")), tokens)
        pallas = _run(tiny, make_step(tiny[1], Runtime(mode="exact", impl="pallas")), tokens)
    for x, p in zip(xla, pallas):
        _compare(x, p, 0.0)


SHORT_CASES = ["prefill_L1", "prefill_L2", "prefill_L3", "prefill_L5", "prefill_L8", "prefill_L13"]


@pytest.mark.slow
def test_golden_short_cases_with_pallas(golden_root):
    """`dsv41 golden-check --impl pallas` on main_fp8's short prefills (free and forced) and its
    single-layer replays: every entry passes, as it does with impl="xla"."""
    from dsv41_jax.golden import data as golden_data
    from dsv41_jax.golden.check import CaseRunner, check_case, check_replays

    configs = {gc.name: gc for gc in golden_data.discover(golden_root)}
    if "main_fp8" not in configs:
        pytest.skip("main_fp8 not in the golden folder")
    with jax.enable_x64(True):
        runner = CaseRunner(configs["main_fp8"], impl="pallas", interpret=True)
        entries = []
        for case in runner.gc.cases:
            if case["name"] in SHORT_CASES:
                entries += check_case(runner, case)
            if case.get("has_intermediates"):
                entries += check_replays(runner, case)
    assert len(entries) >= 2 * len(SHORT_CASES)
    assert all(e.passed for e in entries), [e.to_json() for e in entries if not e.passed]


def _kernels_of(fn, *args) -> set[str]:
    return set(re.findall(r"name=(\w+_(?:tpu|gpu))\b", str(jax.make_jaxpr(fn)(*args))))


@pytest.mark.slow
def test_every_serving_driver_runs_the_kernels_for_pallas(tiny):
    """Exact prefill, the replay and the engine's decode step (all on model/block.py) trace the same
    three kernels as model.forward when impl="pallas" (trace only, nothing compiled). Their exact-mode
    results equal impl="xla" bit for bit: tests/serving/test_serving.py, the engine's steps on the kernels."""
    from dsv41_jax.serving import split_prefill as sp

    cfg, graphdef, params = tiny
    rt = Runtime(impl="pallas")
    tokens, cache = jnp.zeros((1, 3), jnp.int32), init_cache(cfg, 1)
    model = lambda p: nnx.merge(graphdef, p)

    def decode(p, t, c):
        return sp.decode_step(model(p), t, c, sp.decode_plan(rt))[:2]

    drivers = {"exact_prefill": lambda p, t, c: sp.exact_prefill(model(p), t, c, runtime=rt),
               "replay": lambda p, t, c: sp.replay_window(model(p), t, c, runtime=rt), "decode": decode}
    want = {"sparse_sink_attention_tpu", "indexer_scores_tpu", "grouped_fp4_gemm_tpu"}
    found = {name: _kernels_of(f, params, tokens[:, :1] if name == "decode" else tokens, cache)
             for name, f in drivers.items()}
    assert found == {name: want for name in drivers}
