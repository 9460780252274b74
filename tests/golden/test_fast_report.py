"""golden/fast_report.py's judgment of a fast-mode decision that differs from the oracle's: a near-tie
only when the exact margin at the selection boundary is within twice the row's score error."""
from __future__ import annotations

import itertools
import pathlib

import numpy as np
import pytest

from dsv41_jax.golden.fast_report import near_ties


def _brute_margin(row, k):
    """The smallest exact-score gap that separates the chosen k from any unchosen candidate."""
    finite = [float(x) for x in row if np.isfinite(x)]
    if len(finite) <= k:
        return np.inf
    best = None
    for chosen in itertools.combinations(range(len(finite)), k):
        gap = min(finite[i] for i in chosen) - max(finite[j] for j in range(len(finite)) if j not in chosen)
        best = gap if best is None else max(best, gap)
    return best


@pytest.mark.parametrize("seed", range(4))
def test_boundary_margin_equals_the_brute_force_one(seed):
    rng = np.random.default_rng(seed)
    exact = rng.normal(size=(6, 7))
    exact[0, :3] = -np.inf  # masked candidates compete with nothing
    exact[1, :5] = -np.inf  # fewer finite candidates than k: nothing to lose
    margin, _, _ = near_ties(exact, exact, 3)
    want = [_brute_margin(r, 3) for r in exact]
    np.testing.assert_allclose(margin, want)
    assert np.isinf(margin[1])


def test_a_swap_is_a_near_tie_only_within_twice_the_score_error():
    exact = np.array([[1.0, 0.9, 0.5, 0.499], [1.0, 0.9, 0.5, 0.3]])
    fast = exact + np.array([[0, 0, -0.001, 0.001], [0, 0, -0.001, 0.001]])
    margin, err, tie = near_ties(exact, fast, 3)
    np.testing.assert_allclose(margin, [0.001, 0.2])
    np.testing.assert_allclose(err, [0.001, 0.001])
    assert tie.tolist() == [True, False]  # a flip in the second row would be a defect, not numerics


def _stub_runners(agree: bool):
    """Fast and exact runners over the shipped main_fp8 cases whose `run` records what it was asked for (no model
    is loaded): the fast run's decisions all agree with the oracle's, or one row of one call differs."""
    from dsv41_jax.golden import data as golden_data
    from dsv41_jax.golden.check import CaseRunner

    (gc,) = golden_data.discover(pathlib.Path(__file__).resolve().parents[2] / "golden_subset")
    asked = []

    def runner(mode):
        r = CaseRunner.__new__(CaseRunner)
        r.gc, r.cfg, r.decisions = gc, gc.cfg, None

        def run(tokens, schedule, *, quirk=False, label="run", **_):
            asked.append((mode, label))
            calls = [{"topk_agree": {}, "experts_agree": {"0": [agree or i > 0] * c["n_tokens"]}}
                     for i, c in enumerate(schedule)]
            if r.decisions is not None:
                r.decisions.append({"calls": calls})
            n = sum(c["n_tokens"] for c in schedule)
            return np.zeros((n, gc.cfg.vocab_size), np.float32), {"traces": [None] * len(schedule)}

        r.run = run
        return r

    return gc, runner("fast"), runner("exact"), asked


@pytest.mark.parametrize("agree", [True, False])
def test_the_exact_run_runs_only_when_a_decision_differs(agree, monkeypatch):
    """The exact run only gives the margins of differing decisions: at the released width it is most of the
    report's time (wide_roles: a 1040-token exact prefill runs 13 min on 2 cores). A fast run with the oracle's
    decisions imposed runs then too, and its error is reported apart from the free run's."""
    from dsv41_jax.golden import fast_report

    seen = []
    monkeypatch.setattr(fast_report, "_differences", lambda runner, f, e, differing, vl=None: seen.append(differing) or [])
    gc, fast, exact, asked = _stub_runners(agree)
    case = [c for c in gc.cases if c["kind"] == "decode"][0]
    records = fast_report.case_report(fast, exact, case)
    assert [r["name"].split("[")[1] for r in records] == ["published]", "corrected]"]
    want = [("fast", "published fast"), ("fast", "corrected fast")]
    if not agree:
        want = [want[0], ("exact", "published exact"), ("fast", "published fast forced"),
                want[1], ("exact", "corrected exact"), ("fast", "corrected fast forced")]
        assert seen == [[(0, "experts", 0, list(range(case["schedule"][0]["n_tokens"])))]] * 2
    assert asked == want
    assert all(("forced" in r) == (not agree) for r in records)
    text = fast_report.format_report(records)
    assert ("With the oracle's decisions imposed" in text) == (not agree)


def test_the_fast_report_splits_into_the_check_s_parts():
    """--variant with --numerics fast: each free run in exactly one part (a prefill case's in the published one)."""
    from dsv41_jax.golden.fast_report import fast_report, free_runs

    gc, fast, _, _ = _stub_runners(True)
    for case in gc.cases:
        t = gc.case_tensors(case)
        labels = lambda v: [run[0] for run in free_runs(fast, case, t, v)]
        assert labels("published") + labels("corrected") == labels(None)
        assert labels(None) == (["free"] if case["kind"] == "prefill" else ["published", "corrected"])
    with pytest.raises(ValueError, match="variant must be one of .* got 'quirk'"):
        fast_report("golden_subset", variant="quirk")


def test_a_stage_expert_flip_is_judged_on_the_exact_drafter_s_margin():
    """The drafter's stage routers: a differing expert set is reported with its exact margin, a near-tie only
    within twice the row's largest biased score difference; equal sets (in any order) are not reported."""
    from dsv41_jax.golden.fast_report import _stage_expert_differences

    exact_scores = np.array([[[[1.0, 0.9, 0.5, 0.499], [1.0, 0.9, 0.5, 0.3]]]])  # [step, stage, row, E]
    fast_scores = exact_scores + np.array([0, 0, -0.001, 0.001])
    exact = {"stage_scores": exact_scores, "experts": np.array([[[[0, 1, 2], [0, 1, 2]]]])}
    ours = {"stage_scores": fast_scores, "experts": np.array([[[[0, 1, 3], [0, 1, 3]]]])}
    diffs = _stage_expert_differences(ours, exact, 1)
    assert [(d["call"], d["layer"], d["row"], d["near_tie"]) for d in diffs] == [(0, "stage0", 0, True),
                                                                                (0, "stage0", 1, False)]
    np.testing.assert_allclose([d["margin"] for d in diffs], [0.001, 0.2])
    from dsv41_jax.golden.fast_report import _summary

    assert _summary(diffs) == "stage0 experts: 2 rows (call 0), margin 0.001-0.2 vs 2 x err 0.002-0.002 (1 NOT near-ties)"
    ours["experts"] = np.array([[[[2, 0, 1], [1, 2, 0]]]])
    assert _stage_expert_differences(ours, exact, 1) == []


@pytest.mark.slow
def test_the_fast_drafter_s_error_is_a_stage_expert_near_tie():
    """dspark_small in fast numerics (the real model): the draft record is there, every differing decision is a
    near-tie, and the drafter's own numerics add almost nothing: the fast drafter on the oracle's taps with the
    stored ids and stage experts imposed is within 1e-3 of the oracle's draft logits."""
    import jax

    from dsv41_jax.golden import data as golden_data, dspark as gd
    from dsv41_jax.golden.fast_report import fast_report

    root = pathlib.Path(__file__).resolve().parents[1] / "data" / "sweep"
    records = fast_report(root, only=["dspark_small"], variant="published")
    assert [r["name"].split("[")[1] for r in records] == ["published]", "draft]"]
    assert all(r["passed"] for r in records)
    for x in records[1]["decisions_differ"]:
        assert x["kind"] in ("experts", "draft id") and x["near_tie"]
    (gc,) = [g for g in golden_data.discover(root) if g.name == "dspark_small"]
    (case,) = gc.cases
    t = gc.case_tensors(case)
    from flax import nnx

    graphdef, params = nnx.split(gc.load_model())
    steps = gd.forced_steps(gc.cfg, t, "dspark.output_ids", with_experts=True, impose=True)
    with jax.enable_x64(True):
        out = gd.Drafter(graphdef, params, gc.cfg, mode="fast").run(
            t["prefill_main_hidden"], t["main_hidden"], t["dspark.input_ids"], case["schedule"][0]["n_tokens"], steps)
    assert out["agree"]
    assert float(np.abs(out["logits"] - t["dspark.logits"]).max()) < 1e-3
    k = out["experts"].shape[-1]
    own = np.argsort(-out["stage_scores"], -1)[..., :k]  # imposed = own here (agree), so the scores chose them
    np.testing.assert_array_equal(np.sort(own, -1), np.sort(out["experts"], -1))


def test_image_span_rows_are_judged_on_the_bias_they_route_with():
    """An image-span row selects its experts with the gate's `bias_vl`, so its margin is taken on that bias."""
    from types import SimpleNamespace as NS

    from dsv41_jax.golden.fast_report import _call_vl, _decision_scores

    bias, bias_vl = np.array([0.0, 0.0, 1.0]), np.array([1.0, 0.0, 0.0])

    class P:  # an nnx.Param stand-in: p[...] is its value
        def __init__(self, v):
            self.v = v

        def __getitem__(self, _):
            return self.v

    gate = NS(bias=P(bias), bias_vl=P(bias_vl))
    runner = NS(model=NS(layers=[NS(ffn=NS(gate=gate))]), cfg=NS(n_activated_experts=1))
    scores = np.array([[[0.5, 0.6, 0.0], [0.5, 0.6, 0.0]]])  # [1, T=2, E]
    spans = (None, np.array([-1, 3]))  # row 0 text, row 1 an image's
    (vl,) = _call_vl(spans, [{"start_pos": 0, "n_tokens": 2}])
    assert vl.tolist() == [False, True]
    got, k = _decision_scores(runner, {"layer0.gate_scores": scores}, "experts", 0, vl)
    np.testing.assert_allclose(got, [[0.5, 0.6, 1.0], [1.5, 0.6, 0.0]])
    got, _ = _decision_scores(runner, {"layer0.gate_scores": scores}, "experts", 0)
    np.testing.assert_allclose(got, [[0.5, 0.6, 1.0], [0.5, 0.6, 1.0]])
