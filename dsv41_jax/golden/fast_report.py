"""The production (fast) numerics against a golden folder: how far its logits are from the oracle's,
and whether each of its decisions that differs from the oracle's is a near-tie.

Fast mode accumulates in float32 where the oracle rounds as its kernels do, so no entry is bit-exact
and a selection may flip where two candidates score almost the same. What this measures, per free
run (the stored decisions passed, not imposed): max / mean |dlogit| and argmax agreement; every
(call, layer, row) whose own top-k set or expert choice differs from the oracle's; and for each, the
exact run's margin at the selection boundary (the k-th minus the (k+1)-th score: index scores for
a top-k, biased gate scores for the experts) beside the row's largest |fast - exact| score
difference. Two candidates can swap order only if their exact margin is at most twice that
difference, so a differing decision with `margin <= 2 * err` is a near-tie the numerics explain;
any other is a defect, and the report fails. A DSpark case adds its drafter (`draft_record`): the
draft logits and ids against the oracle's, every stage's expert choice judged the same way.
"""
from __future__ import annotations

import copy
import sys

import jax
import numpy as np

from dsv41_jax.golden import data as golden_data, dspark as gd
from dsv41_jax.golden.check import PREFILL_KINDS, VARIANTS, CaseRunner, image_spans, in_part, reference_runs
from dsv41_jax.golden.mechanisms import exercised
from dsv41_jax.runtime import Runtime

# a DSpark case: its main-model runs, then its drafter; an image case: its tower in the same numerics first
REPORTED_KINDS = ("prefill", "decode", "dspark_decode", "vl_prefill")


def free_runs(runner: CaseRunner, case: dict, t: dict, variant: str | None = None) -> list[tuple]:
    """(label, quirk, tokens, forced calls, reference logits) for each free run of a text case whose
    decisions the folder stores (`check.reference_runs`: the ones golden-check runs too); `variant`
    (one of check.VARIANTS): only that part's runs, as golden-check's --variant splits them."""
    part = lambda label: "published" if case["kind"] in PREFILL_KINDS else label
    return [run[:5] for run in reference_runs(runner, case, t) if run[5] and in_part(variant, part(run[0]))]


def _boundary(scores: np.ndarray, k: int) -> np.ndarray:
    """Per row: the k-th highest finite score minus the (k+1)-th (inf where nothing competes)."""
    s = np.sort(np.where(np.isfinite(scores), scores, -np.inf), -1)[..., ::-1]
    if s.shape[-1] <= k:
        return np.full(s.shape[:-1], np.inf)
    with np.errstate(invalid="ignore"):  # -inf - -inf where nothing competes: masked by the where
        return np.where(np.isfinite(s[..., k]), s[..., k - 1] - s[..., k], np.inf)


def _decision_scores(runner: CaseRunner, trace: dict, kind: str, l: int, vl=None):
    """(scores [T, G], k) a layer's decision was taken on, from a collected trace; vl [T]: the call's
    image-span rows, which route with the gate's `bias_vl`."""
    if kind == "topk":
        return np.asarray(trace[f"layer{l}.index_score"], np.float64)[0], runner.cfg.topk_width[runner.cfg.roles[l].kv_source]
    gate = runner.model.layers[l].ffn.gate
    bias = np.asarray(gate.bias[...], np.float64)
    if vl is not None and gate.bias_vl is not None:
        bias = np.where(np.asarray(vl)[:, None], np.asarray(gate.bias_vl[...], np.float64), bias)
    return np.asarray(trace[f"layer{l}.gate_scores"], np.float64)[0] + bias, runner.cfg.n_activated_experts


def near_ties(exact: np.ndarray, fast: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row of [T, G] scores a top-k was taken on: (the exact margin at the boundary, the largest
    |fast - exact| over finite scores, whether margin <= 2 x that error: a swap the numerics explain)."""
    margin = _boundary(exact, k)
    finite = np.isfinite(exact) & np.isfinite(fast)
    with np.errstate(invalid="ignore"):  # inf - inf at masked candidates: left out by the where
        err = np.max(np.where(finite, np.abs(fast - exact), 0.0), -1)
    return margin, err, margin <= 2 * err


def _differing(runner, n_calls) -> list[tuple]:
    """(call, kind, layer, rows) for each decision of the last run that differs from the oracle's."""
    out = []
    for i in range(n_calls):
        decided = runner.decisions[-1]["calls"][i]
        for kind in ("topk", "experts"):
            for l, rows in decided[f"{kind}_agree"].items():
                bad = [r for r, ok in enumerate(rows) if not ok]
                if bad:
                    out.append((i, kind, int(l), bad))
    return out


def _differences(runner, res_fast, res_exact, differing, vl_calls=None) -> list[dict]:
    """Every (call, layer, kind, row) whose fast decision differs from the oracle's, with its margin;
    vl_calls: per call, its image-span rows (an image case)."""
    out = []
    for i, kind, l, bad in differing:
        vl = None if vl_calls is None else vl_calls[i]
        exact, k = _decision_scores(runner, res_exact["traces"][i], kind, l, vl)
        fast, _ = _decision_scores(runner, res_fast["traces"][i], kind, l, vl)
        margin, err, tie = near_ties(exact, fast, k)
        out.extend({"call": i, "layer": l, "kind": kind, "row": r, "margin": float(margin[r]),
                    "score_err": float(err[r]), "near_tie": bool(tie[r])} for r in bad)
    return out


def case_report(fast: CaseRunner, exact: CaseRunner, case: dict, variant: str | None = None) -> list[dict]:
    """One record per free run of `case` (of `variant`'s part): logit error, argmax agreement and each
    differing decision. The exact run that gives the margins runs only when a decision differs, and
    so does a fast run with the oracle's decisions imposed (`forced`): its logit error is the
    numerics' own, where the free run's also holds what each flipped decision set off downstream."""
    t = fast.gc.case_tensors(case)
    records = []
    runs = free_runs(fast, case, t, variant)
    spans, tower = _image_spans(fast, case, t) if runs else (None, None)
    for label, quirk, tokens, forced, ref in runs:
        fast.decisions = []
        logits, res_fast = fast.run(tokens, case["schedule"], quirk=quirk, forced_calls=forced, impose=False,
                                    collect=True, spans=spans, label=f"{label} fast")
        differing = _differing(fast, len(case["schedule"]))
        diffs = []
        if differing:
            _, res_exact = exact.run(tokens, case["schedule"], quirk=quirk, forced_calls=forced, impose=False,
                                     collect=True, spans=_image_spans(exact, case, t)[0], label=f"{label} exact")
            diffs = _differences(fast, res_fast, res_exact, differing, _call_vl(spans, case["schedule"]))
        ref = ref.astype(np.float32)
        record = {"name": f"{fast.gc.name}/{case['name']}[{label}]", **_logit_error(logits, ref),
                  "rows": int(ref.shape[0]), "decisions_differ": diffs, "passed": all(x["near_tie"] for x in diffs)}
        if differing:  # the numerics' own error, apart from what the flipped decisions set off
            forced_logits, _ = fast.run(tokens, case["schedule"], quirk=quirk, forced_calls=forced, impose=True,
                                        collect=True, spans=spans, label=f"{label} fast forced")
            record["forced"] = _logit_error(forced_logits, ref)
        if tower is not None:
            record["vision"] = tower
        records.append(record)
        if case["kind"] == "dspark_decode" and _draft_suffix(label) is not None and \
                f"dspark.logits{_draft_suffix(label)}" in t:
            records.append(draft_record(fast, case, t, label, res_fast["taps"]))
    return records


def _call_vl(spans, schedule) -> list | None:
    """Per call of the schedule: which of its rows are image-span positions (token type >= 0)."""
    if spans is None:
        return None
    types = np.asarray(spans[1])
    return [np.array([p < types.shape[0] and types[p] >= 0 for p in range(c["start_pos"], c["start_pos"] + c["n_tokens"])])
            for c in schedule]


def _image_spans(runner: CaseRunner, case: dict, t: dict):
    """An image case's (span rows, token types) through the tower in the runner's numerics, and the
    tower's error against the oracle's aligner rows (max / mean |d| over every image); (None, None)
    for a text case."""
    if not case["kind"].startswith("vl_"):
        return None, None
    from dsv41_jax.vision.merge import make_image_encoder  # the image path loads only for image cases

    if getattr(runner, "_span_encoder", None) is None:
        runner._span_encoder = make_image_encoder(runner.graphdef, Runtime(mode=runner.mode))
    errs = []

    def seen(k, feats, emb, trace):
        errs.append(np.abs(np.asarray(emb, np.float32) - np.asarray(t[f"image{k}.vision_embeds"], np.float32)).ravel())

    spans = image_spans(runner.model, runner.params, runner._span_encoder, case, t, seen)
    d = np.concatenate(errs)
    return spans, {"max_abs_err": float(d.max()), "mean_abs_err": float(d.mean())}


def _logit_error(logits: np.ndarray, ref: np.ndarray, ref_ids: np.ndarray | None = None) -> dict:
    """max / mean |d| and argmax agreement, with ref's argmax or, where given, the ids the oracle chose."""
    d = np.abs(logits - ref)
    want = ref.argmax(-1) if ref_ids is None else ref_ids
    return {"max_abs_err": float(d.max()), "mean_abs_err": float(d.mean()),
            "argmax_agreement": float(np.mean(logits.argmax(-1) == want))}


def _draft_suffix(label: str) -> str | None:
    return {"published": "", "corrected": "_corrected"}.get(label)


def _drafters(runner: CaseRunner) -> tuple:
    """(fast, exact) drafters on the runner's loaded weights, built once."""
    if getattr(runner, "_drafter_pair", None) is None:
        runner._drafter_pair = tuple(gd.Drafter(runner.graphdef, runner.params, runner.cfg, mode=m)
                                     for m in ("fast", "exact"))
    return runner._drafter_pair


def draft_record(fast: CaseRunner, case: dict, t: dict, label: str, taps: np.ndarray) -> dict:
    """The drafter in fast numerics on the fast main run's taps, against the oracle's draft logits and ids.

    Anchored on the oracle's anchors (a flipped main-model argmax would draft another block), the stored
    draft ids passed but not imposed. The fast taps differ from the oracle's by a bf16 rounding here and
    there; the drafter's FP8 rings and its stage routers can turn that into a different expert, so each
    stage's expert choice is judged as a main-model decision: against the exact drafter on the oracle's
    own taps (equal to the oracle bit for bit: the [draft] entries), a differing choice is a near-tie when
    its exact margin is at most twice the row's largest |fast - exact| biased gate score difference. A
    drafted id that differs is a near-tie when the oracle's id is within twice the run's largest logit
    error of our top logit."""
    sfx = _draft_suffix(label)
    P = case["schedule"][0]["n_tokens"]
    ref_ids, ref = t[f"dspark.output_ids{sfx}"], t[f"dspark.logits{sfx}"].astype(np.float32)
    S, anchors = ref_ids.shape[0], t[f"dspark.input_ids{sfx}"]
    steps = gd.forced_steps(fast.cfg, t, f"dspark.output_ids{sfx}", with_experts=False, impose=False)
    fast_drafter, exact_drafter = _drafters(fast)
    ours = fast_drafter.run(taps[:P], taps[P:P + S], anchors, P, steps)
    exact = exact_drafter.run(t["prefill_main_hidden"], t[f"main_hidden{sfx}"][:S], anchors, P, steps)
    diffs = _stage_expert_differences(ours, exact, S)
    logits = ours["logits"][:S]
    d = np.abs(logits - ref)
    own, want = np.argmax(logits, -1), ref_ids[:, 1:]
    gap = np.max(logits, -1) - np.take_along_axis(logits, want[..., None], -1)[..., 0]
    diffs += [{"call": int(s), "layer": "drafter", "kind": "draft id", "row": int(j), "margin": float(gap[s, j]),
               "score_err": float(d.max()), "near_tie": bool(gap[s, j] <= 2 * d.max())}
              for s, j in zip(*np.nonzero(own != want))]
    name = "draft" if not sfx else "draft-corrected"
    record = {"name": f"{fast.gc.name}/{case['name']}[{name}]", **_logit_error(logits, ref, want),
              "rows": int(own.size), "decisions_differ": diffs, "passed": all(x["near_tie"] for x in diffs)}
    if diffs:  # the drafter's own numerics: the oracle's taps, its draft ids (and stage experts, where stored) imposed
        steps = gd.forced_steps(fast.cfg, t, f"dspark.output_ids{sfx}", with_experts=not sfx, impose=True)
        forced = fast_drafter.run(t["prefill_main_hidden"], t[f"main_hidden{sfx}"][:S], anchors, P, steps)["logits"][:S]
        record["forced"] = _logit_error(forced, ref, want)
    return record


def _stage_expert_differences(ours: dict, exact: dict, S: int) -> list[dict]:
    """Every (step, stage, block row) whose fast expert set differs from the exact drafter's, with its margin."""
    out = []
    k = ours["experts"].shape[-1]
    for s in range(S):
        for st in range(ours["experts"].shape[1]):
            margin, err, tie = near_ties(exact["stage_scores"][s, st].astype(np.float64),
                                         ours["stage_scores"][s, st].astype(np.float64), k)
            same = np.all(np.sort(ours["experts"][s, st], -1) == np.sort(exact["experts"][s, st], -1), -1)
            out.extend({"call": s, "layer": f"stage{st}", "kind": "experts", "row": int(j), "margin": float(margin[j]),
                        "score_err": float(err[j]), "near_tie": bool(tie[j])} for j in np.nonzero(~same)[0])
    return out


def fast_report(root, *, only=None, log=sys.stderr, variant: str | None = None) -> list[dict]:
    """Every text, DSpark and image case of a golden folder under fast numerics (an image case's tower
    runs in fast numerics too, and its rows feed the backbone's runs);
    `variant` (one of check.VARIANTS): one part of it, as golden-check's --variant. Progress goes to
    `log`, a line per call."""
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS} (or None for every run), got {variant!r}")
    records = []
    with jax.enable_x64(True):
        for gc in golden_data.discover(root):
            if only and gc.name not in only:
                continue
            print(f"[fast] {gc.name}: loading model", file=log, flush=True)
            exact = CaseRunner(gc)
            exact.log = log
            fast = copy.copy(exact)  # the same loaded weights, its own compiled steps
            fast.mode, fast._steps = "fast", {}
            for case in gc.cases:
                if case["kind"] not in REPORTED_KINDS:
                    continue
                print(f"[fast] {gc.name}/{case['name']}", file=log, flush=True)
                mechanisms = exercised(gc.cfg, case, "fast")
                records.extend({**r, "mechanisms": mechanisms} for r in case_report(fast, exact, case, variant))
    return records


def _where(layer) -> str:
    return f"layer {layer}" if isinstance(layer, int) else layer  # "stage1", "drafter"


def _summary(diffs: list[dict]) -> str:
    """The differing decisions, one clause per (layer or stage, kind): how many rows, the exact margins
    against twice the score errors, and whether every one is a near-tie."""
    groups: dict = {}
    for x in diffs:
        groups.setdefault((_where(x["layer"]), x["kind"]), []).append(x)
    out = []
    for (where, kind), xs in groups.items():
        m, e = [x["margin"] for x in xs], [2 * x["score_err"] for x in xs]
        bad = sum(not x["near_tie"] for x in xs)
        calls = sorted({x["call"] for x in xs})
        out.append(f"{where} {kind}: {len(xs)} row{'s' if len(xs) > 1 else ''} (call{'s' if len(calls) > 1 else ''} "
                   f"{','.join(map(str, calls))}), margin {min(m):.3g}-{max(m):.3g} vs 2 x err {min(e):.3g}-{max(e):.3g} "
                   f"({'near-ties' if not bad else f'{bad} NOT near-ties'})")
    return "; ".join(out)


def format_report(records: list[dict]) -> str:
    rows = [f"{'run':52s} {'ok':4s} {'max|d|':>9s} {'mean|d|':>9s} {'argmax':>7s}  decisions that differ"]
    shown = None
    for r in records:
        if r.get("mechanisms") and r["mechanisms"] != shown:  # once per case: what its runs below exercised
            rows.append(f"  exercised: {'; '.join(r['mechanisms'])}")
            shown = r["mechanisms"]
        diffs = r["decisions_differ"]
        what = "none" if not diffs else _summary(diffs)
        if "vision" in r:
            what += f". Image tower: aligner rows max|d| {r['vision']['max_abs_err']:.3g}, mean {r['vision']['mean_abs_err']:.3g}"
        if "forced" in r:
            f = r["forced"]
            what += (f". With the oracle's decisions imposed: max|d| {f['max_abs_err']:.3g}, mean {f['mean_abs_err']:.3g}, "
                     f"argmax {f['argmax_agreement']:.3f}")
        rows.append(f"{r['name']:52s} {'PASS' if r['passed'] else 'FAIL':4s} {r['max_abs_err']:9.3g} "
                    f"{r['mean_abs_err']:9.3g} {r['argmax_agreement']:7.3f}  {len(diffs)} ({r['rows']} logit rows): {what}")
    n_fail = sum(not r["passed"] for r in records)
    rows.append(f"{len(records) - n_fail} passed, {n_fail} failed (a run fails when a decision differs by more than a near-tie)")
    return "\n".join(rows)
