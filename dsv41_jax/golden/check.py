"""`dsv41 golden-check DIR`: run every case of a golden folder and compare with the oracle.

Entries (docs/REFERENCE.md §8 contract): `quant/<vector>`, `<config>/<case>[free]`, `[forced]`, decode cases
as `[published]`/`[corrected]` (+ `-forced`), `<config>/replay_layer<l>` single-layer replays, and
for DSpark configs `[draft]`, `[draft-forced]`, `[draft-corrected]`, `[draft-corrected-forced]`
(`golden/dspark.py`). A decode file without the corrected schedule's decisions (dspark_fp8) has
its `[corrected-forced]` entry impose only the stored prefill decisions.
Image cases (`vl_prefill`, `vl_decode`) add `<config>/<case>[vision]`: ViT output, aligner output
and merged embeddings, bit-exact; their logits and decisions are judged as the text cases'.

Pass criteria (justified in tests/README.md from golden/README.md's sensitivity table):
- number-format vectors: bit-exact;
- forced runs: every layer's own top-k and expert choice equal the stored ones, tie-aware,
  and the logits within the "FP32 accumulation / forced" row of the table;
- free runs of at most SHORT_ROWS positions and the corrected decode: within the "FP32
  accumulation / L13 free" row; longer free runs: argmax agreement at least the same row's;
  their max error is reported, not judged;
- single-layer replays: traced outputs within REPLAY_ULPS bf16 ulps.
"""
from __future__ import annotations

import resource
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.engram.hashing import hash_ids
from dsv41_jax.golden import data as golden_data, dspark as gd
from dsv41_jax.golden.entry import Entry, REPLAY_ULPS
from dsv41_jax.golden.mechanisms import exercised
from dsv41_jax.golden.vectors import check_vectors
from dsv41_jax.model.transformer import init_cache, make_step
from dsv41_jax.runtime import Runtime

# Thresholds: golden/README.md "Tolerances", row "FP32 GEMM accumulation" (the smallest numerical
# change it lists), per shared config; a config folder not in the table gets the tightest value of
# each column. Nothing here was fitted to our results; tests/README.md gives the reasoning.
SHORT_ROWS = 16  # "short" = the L13 column (<= 16 positions)
FP32_ACCUMULATION_ROW = {
    #              L13 free max, L97 free argmax, L97 forced: max, mean, argmax
    "main_fp8": dict(short_max=0.078, free_argmax=0.91, forced_max=0.34, forced_mean=0.033, forced_argmax=0.96),
    "engram_fp8": dict(short_max=0.30, free_argmax=0.98, forced_max=0.17, forced_mean=0.026, forced_argmax=0.96),
    "main_bf16": dict(short_max=0.036, free_argmax=0.96, forced_max=0.066, forced_mean=0.010, forced_argmax=0.99),
}
TIGHTEST = {k: (max if k.endswith("argmax") else min)(row[k] for row in FP32_ACCUMULATION_ROW.values())
            for k in FP32_ACCUMULATION_ROW["main_fp8"]}


# jax's compile-stage events: their durations, summed, split a call's wall time into compile and run
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
_compile_secs = [0.0]
_listening = [False]


def _on_duration(event, secs, **_):
    if event in _COMPILE_EVENTS:
        _compile_secs[0] += secs


def _compile_clock() -> float:
    """Seconds this process has spent tracing, lowering and compiling (jax cannot remove a listener,
    so it is registered once)."""
    if not _listening[0]:
        jax.monitoring.register_event_duration_secs_listener(_on_duration)
        _listening[0] = True
    return _compile_secs[0]


def _rss_gb() -> tuple[float, float]:
    """(current, peak) resident memory of this process in GB."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 1e9, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def tolerances(config_name: str) -> dict:
    return FP32_ACCUMULATION_ROW.get(config_name, TIGHTEST)


def _logit_stats(ours: np.ndarray, ref: np.ndarray):
    d = np.abs(ours.astype(np.float64) - ref.astype(np.float64))
    agree = float(np.mean(np.argmax(ours, -1) == np.argmax(ref, -1))) if ref.size else 1.0
    return float(d.max(initial=0.0)), float(d.mean()) if d.size else 0.0, agree


class CaseRunner:
    """Runs one config's cases with a loaded model (exact numerics; `mode="fast"` for the production
    numerics, which golden/fast_report.py measures against the oracle)."""

    def __init__(self, gc: golden_data.GoldenConfig, impl: str = "xla", interpret: bool = False, mode: str = "exact"):
        self.gc, self.cfg, self.mode = gc, gc.cfg, mode
        self.model = gc.load_model()
        self.graphdef, self.params = nnx.split(self.model)
        self.engram = gc.engram_hasher()
        self.impl, self.interpret = impl, interpret
        self._steps: dict = {}
        self.image_encoder = None  # the jitted image encoder, built on the first image case (check_vision)
        self.decisions: list | None = None  # when a list: one record per run (`--dump-decisions`)
        self.log = None  # when a file: one progress line per call of each run (compile and run seconds, memory)

    def _step(self, quirk: bool, collect: bool):
        key = (quirk, collect)
        if key not in self._steps:
            rt = Runtime(mode=self.mode, impl=self.impl, index_k_quirk=quirk, interpret=self.interpret)
            self._steps[key] = make_step(self.graphdef, rt, collect=collect)
        return self._steps[key]

    def _engram_ids(self, tokens: np.ndarray, start: int, all_tokens: np.ndarray):
        if self.engram is None:
            return None

        layout, token_map = self.engram
        hist = all_tokens[max(0, start - (layout.max_ngram_size - 1)):start][None] if start else None
        return jnp.asarray(hash_ids(layout, token_map, tokens[None], hist).astype(np.int32))

    def run(self, tokens: np.ndarray, schedule: list[dict], *, quirk=False, forced_calls=None, collect=False,
            replay=None, impose=True, spans=None, label="run"):
        """Feed the schedule's calls; returns (logits [N, V], per-call agreement flags).

        Stored decisions are always passed (and compared); `impose` decides whether they replace
        the model's own, so free and forced runs share one compilation. Calls are never padded:
        the oracle's elementwise kernels choose SLEEF or glibc by the call's token count
        (docs/NUMERICS.md, "torch's vector body and scalar tail"), so a padded call would
        compute its last rows differently.
        spans: optional (rows [L, dim], token_types [L]) of the prompt's image spans; each call
        gets its slice (calls past the prompt get none).
        label: names the run in the progress lines (`self.log`).
        """
        cache = init_cache(self.cfg, 1)
        step = self._step(quirk, collect)
        outs, traces, taps = [], [], []
        per_layer: dict[int, bool] = {}
        calls = []
        for i, call in enumerate(schedule):
            s, n = call["start_pos"], call["n_tokens"]
            T = n
            toks = np.concatenate([tokens[s:s + n], np.zeros(T - n, tokens.dtype)])
            forced = self._pad_forced(forced_calls[i], T) if forced_calls is not None else None
            if forced is not None:
                forced["impose"] = jnp.asarray(impose)
            eids = self._engram_ids(toks, s, tokens)
            call_spans = None
            if spans is not None and s < spans[1].shape[0]:
                rows, types = spans[0][s:s + n], spans[1][s:s + n]
                rows = np.concatenate([rows, np.zeros((T - rows.shape[0],) + rows.shape[1:], rows.dtype)])
                types = np.concatenate([types, np.full(T - types.shape[0], -1, types.dtype)])
                call_spans = (jnp.asarray(rows[None]), jnp.asarray(types[None], jnp.int32))
            t0, c0 = time.perf_counter(), _compile_clock()
            logits, cache, aux = step(self.params, jnp.asarray(toks[None], jnp.int32), cache, eids, forced,
                                      replay if i == 0 else None, call_spans)
            outs.append(np.asarray(logits[0, :n]))  # waits for the call
            if self.log is not None:
                compiled, (rss, peak) = _compile_clock() - c0, _rss_gb()
                print(f"[golden]   {label}: call {i + 1}/{len(schedule)} ({n} tokens) compile {compiled:.1f} s, run "
                      f"{time.perf_counter() - t0 - compiled:.1f} s; RSS {rss:.1f} GB (peak {peak:.1f})",
                      file=self.log, flush=True)
            if "main_hidden" in aux:  # DSpark taps of this call's rows
                taps.append(np.asarray(aux["main_hidden"][0, :n]))
            for kind in ("topk_agree", "experts_agree"):
                for l, v in aux[kind].items():
                    per_layer[l] = per_layer.get(l, True) and bool(np.all(np.asarray(v)[0, :n]))
            traces.append(jax.tree.map(np.asarray, aux["trace"]) if collect else None)
            if self.decisions is not None:
                calls.append(_call_decisions(aux, n, logits))
        if self.decisions is not None:
            self.decisions.append({"quirk": quirk, "impose": bool(impose) if forced_calls is not None else None,
                                   "replay": replay is not None, "calls": calls})
        return np.concatenate(outs, 0), {"agree": all(per_layer.values()), "per_layer": per_layer, "traces": traces,
                                         "taps": np.concatenate(taps, 0) if taps else None}

    def _pad_forced(self, forced, T):
        k = self.cfg.n_activated_experts
        out = {"topk": {}, "experts": {}}
        for l, v in forced["topk"].items():
            K = self.cfg.topk_width[self.cfg.roles[l].kv_source]
            v = np.asarray(v)[..., :K]
            v = np.pad(v, [(0, 0), (0, T - v.shape[1]), (0, K - v.shape[2])], constant_values=-1)
            out["topk"][l] = jnp.asarray(v, jnp.int32)
        for l, v in forced["experts"].items():
            v = np.asarray(v)
            pad = np.broadcast_to(np.arange(k), (v.shape[0], T - v.shape[1], k))
            out["experts"][l] = jnp.asarray(np.concatenate([v, pad], 1), jnp.int32)
        return out

    # ---------------------------------------------------------------------------- DSpark
    def draft_entries(self, t, base, variant, P, free_logits, free_taps, forced_taps, tol) -> list:
        """`[draft]` / `[draft-forced]` (published) or `[draft-corrected]` / `[draft-corrected-forced]`.

        The oracle stored main-model and stage decisions for the published schedule only, so the
        corrected forced entry imposes the stored corrected draft ids on the free corrected run's taps.
        """
        if not hasattr(self, "_drafter"):
            self._drafter = gd.Drafter(self.graphdef, self.params, self.cfg)
        sfx = "_corrected" if variant == "corrected" else ""
        name = "draft" if not sfx else "draft-corrected"
        S = t[f"dspark.output_ids{sfx}"].shape[0]
        anchors = np.argmax(free_logits[P:P + S], -1)
        # stored ids passed but not imposed: the free run shares the forced run's compilation
        free = gd.forced_steps(self.cfg, t, f"dspark.output_ids{sfx}", with_experts=False, impose=False)
        ours = self._drafter.run(free_taps[:P], free_taps[P:P + S], anchors, P, free)
        out = [gd.judge(f"{base}[{name}]", ours, t, sfx, tol, False, (free_taps[:P], free_taps[P:]))]
        taps = forced_taps if not sfx else free_taps
        steps = gd.forced_steps(self.cfg, t, f"dspark.output_ids{sfx}", with_experts=not sfx, impose=True)
        ours = self._drafter.run(taps[:P], taps[P:P + S], t[f"dspark.input_ids{sfx}"], P, steps)
        out.append(gd.judge(f"{base}[{name}-forced]", ours, t, sfx, tol, not sfx, (taps[:P], taps[P:])))
        return out

    # ---------------------------------------------------------------------------- decisions
    def forced_from(self, t: dict[str, np.ndarray], prefix: str, rows: slice):
        """Stored decisions for rows of one call: {"topk": {l: [1,n,k]}, "experts": {l: [1,n,k]}}."""
        topk, experts = {}, {}
        for r in self.cfg.roles:
            ci = t.get(f"{prefix}layer{r.layer}.compressed_idxs")
            if r.is_index_source and ci is not None:
                topk[r.layer] = ci[rows][None].astype(np.int32)
            elif r.is_index_source:  # nothing visible yet in this call: the oracle stores no list
                topk[r.layer] = np.full((1, rows.stop - rows.start, 1), -1, np.int32)
            ex = t.get(f"{prefix}layer{r.layer}.experts")
            if ex is not None:
                experts[r.layer] = ex[rows][None].astype(np.int32)
        return {"topk": topk, "experts": experts}


def _call_decisions(aux: dict, n: int, logits) -> dict:
    """One call's own decisions (top-k before any imposing, experts), agreement flags and a hash of its
    logits' bytes: two runs' dumps are equal exactly when the decisions and logits are bit-identical."""
    import hashlib

    rows = lambda d: {str(l): np.asarray(v)[0, :n].tolist() for l, v in sorted(d.items())}
    return {"topk_own": rows(aux.get("topk_own", aux["topk"])), "experts_own": rows(aux.get("experts_own", aux["experts"])),
            "topk_agree": rows(aux["topk_agree"]), "experts_agree": rows(aux["experts_agree"]),
            "logits_sha256": hashlib.sha256(np.ascontiguousarray(np.asarray(logits[0, :n])).tobytes()).hexdigest()}


def _judge_free(name, ours, ref, tol) -> Entry:
    mx, mean, agree = _logit_stats(ours, ref)
    if ref.shape[0] <= SHORT_ROWS:
        ok = mx <= tol["short_max"]
        why = f"short run: max |dlogit| {mx:.3g} <= {tol['short_max']}"
    else:
        ok = agree >= tol["free_argmax"]
        why = f"long free run: argmax {agree:.3f} >= {tol['free_argmax']} (max error reported, not judged)"
    return Entry(name, ok, mx, mean, agree, False, None, why)


def _judge_forced(name, ours, ref, sets_equal, tol, forced=True) -> Entry:
    mx, mean, agree = _logit_stats(ours, ref)
    if ref.shape[0] <= SHORT_ROWS:
        ok = sets_equal and mx <= tol["short_max"]
    else:
        ok = sets_equal and agree >= tol["forced_argmax"] and mean <= tol["forced_mean"] and mx <= tol["forced_max"]
    what = "decisions " + ("equal" if sets_equal else "DIFFER") if forced else "free, judged as forced"
    return Entry(name, ok, mx, mean, agree, forced, sets_equal if forced else None,
                 f"{what}; argmax {agree:.3f}, mean |d| {mean:.3g}, max |d| {mx:.3g}")


# A decode case's runs come in two index-key variants; `variant` runs one part of a check, so that a long
# case can be split across processes. Everything without a variant (prefill cases, replays, image towers,
# number-format vectors) belongs to the published part, so the two parts together are the whole check.
VARIANTS = ("published", "corrected")
PREFILL_KINDS = ("prefill", "vl_prefill")  # one run each, no variant


def in_part(variant: str | None, run_variant: str) -> bool:
    """Whether a run of `run_variant` belongs to the part `variant` of a check (None: the whole check)."""
    return variant is None or variant == run_variant


def check_case(runner: CaseRunner, case: dict, variant: str | None = None) -> list[Entry]:
    """The case's entries, each carrying the mechanisms the case exercised; `variant` (one of VARIANTS):
    only that part's entries."""
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS} (or None for every entry), got {variant!r}")
    entries = _case_entries(runner, case, variant)
    mechanisms = exercised(runner.cfg, case)
    for e in entries:
        e.mechanisms = mechanisms
    return entries


def reference_runs(runner: CaseRunner, case: dict, t: dict) -> list[tuple]:
    """(label, quirk, tokens, forced calls, reference logits, decode decisions stored) for each run a
    case's tensors hold: a prefill case one ("free"); a decode case one per index-key variant it stores
    (published, corrected). A variant without stored decode decisions (dspark_fp8's corrected) gets
    empty forced calls after its prefill."""
    tokens = np.asarray(t.get("tokens", np.asarray(case["tokens"]))).astype(np.int64)
    sched = case["schedule"]
    P = sched[0]["n_tokens"]
    if case["kind"] in PREFILL_KINDS:
        return [("free", False, tokens, [runner.forced_from(t, "select.", slice(0, P))], t["logits"], True)]
    runs = []
    for label, quirk, key, prefix in (("published", True, "decode_logits", "select.decode."),
                                      ("corrected", False, "decode_logits_corrected", "select.decode_corrected.")):
        if key not in t:
            continue
        # a greedy case's corrected run consumes its own argmax stream (golden/README.md, dspark_fp8)
        run_tokens = tokens if label == "published" or "tokens_corrected" not in t else \
            np.asarray(t["tokens_corrected"]).astype(np.int64)
        stored = any(k.startswith(prefix) for k in t)
        forced = [runner.forced_from(t, "select.prefill.", slice(0, P))]
        forced += [runner.forced_from(t, prefix, slice(i - 1, i)) if stored else {"topk": {}, "experts": {}}
                   for i in range(1, len(sched))]
        runs.append((label, quirk, run_tokens, forced, np.concatenate([t["prefill_logits"], t[key]], 0), stored))
    return runs


def _case_entries(runner: CaseRunner, case: dict, part: str | None = None) -> list[Entry]:
    gc = runner.gc
    t = gc.case_tensors(case)
    sched = case["schedule"]
    base = f"{gc.name}/{case['name']}"
    tol = tolerances(gc.name)
    entries, spans = [], None
    prefill = case["kind"] in PREFILL_KINDS
    if case["kind"].startswith("vl_"):  # image cases: the tower's outputs first, then the text checks
        vision_entry, spans = check_vision(runner, case, t)
        if in_part(part, "published"):
            entries.append(vision_entry)
    for variant, quirk, tokens, forced, ref, _ in reference_runs(runner, case, t):
        if not in_part(part, "published" if prefill else variant):
            continue
        if prefill:
            ours, _ = runner.run(tokens, sched, forced_calls=forced, impose=False, spans=spans, label="free")
            entries.append(_judge_free(f"{base}[free]", ours, ref, tol))
            ours, res = runner.run(tokens, sched, forced_calls=forced, spans=spans, label="forced")
            entries.append(_judge_forced(f"{base}[forced]", ours, ref, res["agree"], tol))
            continue
        ours, free = runner.run(tokens, sched, quirk=quirk, forced_calls=forced, impose=False, spans=spans,
                                label=variant)
        if variant == "corrected":  # the oracle's corrected decode equals its prefill bit for bit: judge tightly
            entries.append(_judge_forced(f"{base}[{variant}]", ours, ref, True, tol, forced=False))
        else:
            entries.append(_judge_free(f"{base}[{variant}]", ours, ref, tol))
        free_logits = ours
        ours, res = runner.run(tokens, sched, quirk=quirk, forced_calls=forced, spans=spans, label=f"{variant}-forced")
        entries.append(_judge_forced(f"{base}[{variant}-forced]", ours, ref, res["agree"], tol))
        if runner.cfg.has_dspark and f"dspark.output_ids{'_corrected' if variant == 'corrected' else ''}" in t:
            entries.extend(runner.draft_entries(t, base, variant, sched[0]["n_tokens"], free_logits, free["taps"],
                                                res["taps"], tol))
    return entries


def check_vision(runner: CaseRunner, case: dict, t: dict) -> tuple[Entry, tuple]:
    """`<config>/<case>[vision]`: ViT output (and traced blocks), aligner output and the merged
    embeddings, each bit-exact (the oracle's vision numerics are reproducible: tests/README.md).
    Returns the entry and the prompt's span (rows, token_types) for the backbone checks."""
    # deferred: the image path loads only for a folder with image cases
    from dsv41_jax.vision.merge import make_image_encoder

    if runner.image_encoder is None:
        runner.image_encoder = make_image_encoder(runner.graphdef, Runtime(mode="exact"), collect=True)
    detail, ok, max_abs = [], True, 0.0

    def compare(label, ours, ref):
        nonlocal ok, max_abs
        ours, ref = np.asarray(ours).astype(np.float32), np.asarray(ref).astype(np.float32)
        bad = int(np.sum(ours != ref)) if ours.shape == ref.shape else -1
        ok &= bad == 0
        if bad >= 0:  # a shape mismatch fails the entry; it has no difference to report
            max_abs = max(max_abs, float(np.max(np.abs(ours - ref), initial=0.0)))
        detail.append(f"{label} {'==' if bad == 0 else f'{bad} differ' if bad > 0 else f'shape {ours.shape} != {ref.shape}'}")

    def seen(k, feats, emb, trace):
        for key, val in trace.items():
            if f"trace.image{k}.{key}" in t:
                compare(f"image{k}.{key}", val, t[f"trace.image{k}.{key}"])
        compare(f"image{k}.vit_output", feats, t[f"image{k}.vit_output"])
        compare(f"image{k}.vision_embeds", emb, t[f"image{k}.vision_embeds"])

    rows, types = image_spans(runner.model, runner.params, runner.image_encoder, case, t, seen)
    prompt = np.asarray(t["tokens"]).astype(np.int64)[:types.shape[0]]
    merged = np.where((types >= 0)[:, None], rows, np.asarray(runner.model.embed[...])[prompt])
    compare("merged_embeddings", merged, t["merged_embeddings"])
    return Entry(f"{runner.gc.name}/{case['name']}[vision]", ok, max_abs, detail="; ".join(detail)), (rows, types)


def image_spans(model, params, encoder, case: dict, t: dict, seen=None) -> tuple[np.ndarray, np.ndarray]:
    """An image case's span rows and token types (rows [L, dim], types [L]) from its stored patches,
    through `encoder` (`vision.merge.make_image_encoder`, exact or fast); seen(k, vit_output,
    vision_embeds, trace) gets each image's outputs (trace: {} unless the encoder collects)."""
    from dsv41_jax.vision.merge import ImageInput, span_rows  # deferred: the image path loads only for image cases

    types = np.asarray(t["token_types"]).astype(np.int64)
    images, embeds = [], []
    for k, im in enumerate(case["images"]):
        img = ImageInput(im["start"], t[f"image{k}.patches"], im["n_vit_h"], im["n_vit_w"])
        out = encoder(params, jnp.asarray(img.patches), img.n_vit_h, img.n_vit_w)
        if seen is not None:
            seen(k, out[0], out[1], out[2] if len(out) > 2 else {})
        images.append(img)
        embeds.append(np.asarray(out[1]))
    return span_rows(model, types, images, embeds), types


def check_replays(runner: CaseRunner, case: dict) -> list[Entry]:
    """Replay each traced layer from its traced input with decisions forced; compare its outputs."""
    gc, cfg = runner.gc, runner.cfg
    t = gc.case_tensors(case)
    tokens = np.asarray(t["tokens"]).astype(np.int64)
    n = case["schedule"][0]["n_tokens"]
    replay = {}
    for l in range(cfg.n_layers):
        bi, pm = t.get(f"trace.layer{l}.block_input"), t.get(f"trace.layer{l}.pre_mix_in")
        if bi is not None and pm is not None:
            replay[l] = (jnp.asarray(bi[None]), jnp.asarray(pm[None]))
    forced = [runner.forced_from(t, "select.", slice(0, n))]
    _, res = runner.run(tokens, case["schedule"][:1], forced_calls=forced, collect=True, replay=replay, label="replays")
    ours = res["traces"][0]
    entries = []
    for l in range(cfg.n_layers):
        names = [f"layer{l}.{k}" for k in ("attn_input", "attn_output", "ffn_input", "ffn_output", "sparse_attn_out")]
        names = [k for k in names if f"trace.{k}" in t]
        if not names or l not in replay:
            continue
        worst, max_abs, detail = 0.0, 0.0, []
        for k in names:
            ref = t[f"trace.{k}"].astype(np.float32)
            got = np.asarray(ours[k][0]).astype(np.float32).reshape(ref.shape)
            ulp = np.maximum(np.abs(ref), 1e-30) * 2.0 ** -7
            ulps = float(np.max(np.abs(got - ref) / ulp))
            worst, max_abs = max(worst, ulps), max(max_abs, float(np.max(np.abs(got - ref), initial=0.0)))
            detail.append(f"{k.split('.')[1]} {ulps:.2g}ulp")
        # only this layer's own decisions count: the layers between replay points run free
        own = res["per_layer"].get(l, True)
        ok = worst <= REPLAY_ULPS and own
        entries.append(Entry(f"{gc.name}/replay_layer{l}", ok, max_abs, None, None, True, own,
                             "; ".join(detail), exercised(cfg, case)))
    return entries


def run_all(root, *, impl="xla", interpret=False, only=None, log=sys.stderr, decisions: dict | None = None,
            variant: str | None = None) -> list[Entry]:
    """Every entry of a golden folder; `only` restricts to named config folders (and "quant"), `variant`
    (one of VARIANTS) to one part of the check (see VARIANTS). Progress goes to `log`, a line per call.
    decisions: when a dict, filled with {"<config>/<case>": [one record per run, see `_call_decisions`]}."""
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS} (or None for every entry), got {variant!r}")
    entries: list[Entry] = []
    with jax.enable_x64(True):
        qv = golden_data.load_quant_vectors(root) if (not only or "quant" in only) and in_part(variant, "published") else None
        if qv is not None:
            entries.extend(Entry(name, ok, detail=why) for name, ok, why in check_vectors(*qv))
        for gc in golden_data.discover(root):
            cases = [c for c in gc.cases if in_part(variant, "published") or c["kind"] not in PREFILL_KINDS]
            if (only and gc.name not in only) or not cases:
                continue
            print(f"[golden] {gc.name}: loading model", file=log, flush=True)
            runner = CaseRunner(gc, impl=impl, interpret=interpret)
            runner.log = log
            for case in cases:
                print(f"[golden] {gc.name}/{case['name']}", file=log, flush=True)
                if decisions is not None:
                    runner.decisions = decisions.setdefault(f"{gc.name}/{case['name']}", [])
                entries.extend(check_case(runner, case, variant))
                if case.get("has_intermediates") and case["kind"] == "prefill" and in_part(variant, "published"):
                    entries.extend(check_replays(runner, case))  # vl cases trace the tower only
    return entries


def format_table(entries: list[Entry]) -> str:
    rows = [f"{'entry':52s} {'ok':4s} {'max|d|':>9s} {'mean|d|':>9s} {'argmax':>7s} {'topk=':>6s}  detail"]
    f = lambda v, fmt: "-" if v is None else format(v, fmt)
    shown = None
    for e in entries:
        if e.mechanisms and e.mechanisms != shown:  # once per case: what its entries below proved
            rows.append(f"  exercised: {'; '.join(e.mechanisms)}")
            shown = e.mechanisms
        rows.append(f"{e.name:52s} {'PASS' if e.passed else 'FAIL':4s} {f(e.max_abs_err, '9.3g')} {f(e.mean_abs_err, '9.3g')} "
                    f"{f(e.argmax_agreement, '7.3f')} {f(e.topk_sets_equal, '>6')}  {e.detail}")
    n_fail = sum(not e.passed for e in entries)
    rows.append(f"{len(entries) - n_fail} passed, {n_fail} failed")
    return "\n".join(rows)
