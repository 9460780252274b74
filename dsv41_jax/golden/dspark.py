"""DSpark entries of `dsv41 golden-check`: `<config>/<case>[draft]`, `[draft-forced]`,
`[draft-corrected]`, `[draft-corrected-forced]` (golden/README.md "dspark_fp8").

The drafter runs on the main model's own taps from the same schedule as the backbone entries
(one main call per step, then one drafter call at the same start position, as the oracle did).
What is compared: the taps (`main_hidden`), `main_x`, every stage's ring, the drafted ids, the
draft logits and the confidence logits. Forced entries impose the stored main-model decisions,
the stored DSpark expert choices and the stored draft ids (the Markov chain then conditions on
them); free entries impose nothing, so the anchor is our own argmax.

Criteria (tests/README.md "DSpark entries"): drafted ids equal the stored ones except where the
stored id is within `TIE` of our top logit (the oracle's own smallest draft margin is 0.0022, so
a near-tie may fall either way); logits and confidence within the config's short-run logit
tolerance; taps, main_x and rings within REPLAY_ULPS bf16 ulps (they are bf16 values of
the same computation); forced entries also need every stage's expert choice to agree (tie-aware).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dsv41_jax.golden.entry import REPLAY_ULPS, Entry
from dsv41_jax.model import dspark
from dsv41_jax.runtime import compiler_options
from dsv41_jax.numerics import kv_layout

TIE = 1e-3  # a stored draft id this close to our top logit counts as a tie


def _ulps(got: np.ndarray, ref: np.ndarray) -> float:
    ref = ref.astype(np.float32)
    got = np.asarray(got, np.float32).reshape(ref.shape)
    ulp = np.maximum(np.abs(ref), 2.0 ** -126) * 2.0 ** -7
    return float(np.max(np.abs(got - ref) / ulp, initial=0.0))


class Drafter:
    """Jitted drafter calls on one loaded model (exact numerics; `mode="fast"` for the production numerics)."""

    def __init__(self, graphdef, params, cfg, mode: str = "exact"):
        self.graphdef, self.params, self.cfg = graphdef, params, cfg

        @functools.partial(jax.jit, compiler_options=compiler_options(mode))
        def seed(params, state, taps, n_valid):
            model = nnx.merge(graphdef, params)
            mx = dspark.main_x(model, taps, mode)
            start = jnp.zeros((taps.shape[0],), jnp.int32)
            return dspark.write_rings(model, state, mx, start, n_valid, mode), mx

        @functools.partial(jax.jit, compiler_options=compiler_options(mode))
        def step(params, state, taps, pos, anchor, forced):
            model = nnx.merge(graphdef, params)
            mx = dspark.main_x(model, taps, mode)
            state = dspark.write_rings(model, state, mx, pos, jnp.ones_like(pos), mode)
            ids, logits, conf, aux = dspark.draft(model, state, anchor, pos, mode=mode, forced=forced)
            return state, mx, ids, logits, conf, aux["experts_agree"], (aux["experts"], aux["biased_scores"])

        self.seed, self.step = seed, step

    def run(self, prefill_hidden: np.ndarray, step_hidden: np.ndarray, anchors: np.ndarray, P: int, forced_steps=None):
        """Seed with P prefill taps, then one draft per decode step. Returns a dict of numpy results
        (per step: main_x, rings, ids, logits, confidence, and every stage's experts [stages, bs, k] with
        the biased gate scores [stages, bs, E] they were chosen on)."""
        cfg = self.cfg
        state = dspark.init_state(cfg, 1)
        T = -(-P // 8) * 8  # padded rows are not written (n_valid)
        taps = np.zeros((1, T, prefill_hidden.shape[-1]), prefill_hidden.dtype)
        taps[0, :P] = prefill_hidden
        state, mx = self.seed(self.params, state, jnp.asarray(taps), jnp.asarray([P], jnp.int32))
        out = {"prefill_main_x": np.asarray(mx[0, :P]), "rings_after_prefill": _rings(state),
               "main_x": [], "rings": [], "ids": [], "logits": [], "confidence": [], "experts": [],
               "stage_scores": [], "agree": True}
        for s in range(step_hidden.shape[0]):
            forced = None if forced_steps is None else forced_steps[s]
            state, mx, ids, logits, conf, agree, (experts, scores) = self.step(
                self.params, state, jnp.asarray(step_hidden[s][None, None]), jnp.asarray([P + s], jnp.int32),
                jnp.asarray([anchors[s]], jnp.int32), forced)
            out["main_x"].append(np.asarray(mx[0, 0]))
            out["rings"].append(_rings(state))
            out["ids"].append(np.asarray(ids[0]))
            out["logits"].append(np.asarray(logits[0]))
            out["confidence"].append(np.asarray(conf[0]))
            out["experts"].append(np.stack([np.asarray(experts[k][0]) for k in sorted(experts)]))
            out["stage_scores"].append(np.stack([np.asarray(scores[k][0]) for k in sorted(scores)]))
            out["agree"] = out["agree"] and all(bool(np.all(np.asarray(v))) for v in agree.values())
        for k in ("main_x", "rings", "ids", "logits", "confidence", "experts", "stage_scores"):
            out[k] = np.stack(out[k])
        return out


def _rings(state) -> np.ndarray:
    return np.stack([np.asarray(kv_layout.dequantize_window(r)[0]) for r in state["rings"]])


def forced_steps(cfg, t: dict, ids_key: str, with_experts: bool, impose: bool):
    """Per step: stored draft ids (and stored stage experts) for `dspark.draft(forced=...)`."""
    ids = t[ids_key]
    steps = []
    for s in range(ids.shape[0]):
        f = {"ids": jnp.asarray(ids[s][None], jnp.int32), "experts": {}, "impose": jnp.asarray(impose)}
        if with_experts:
            for k in range(cfg.n_mtp_layers):
                e = t.get(f"select.dspark.stage{k}.experts")
                if e is not None:
                    f["experts"][k] = jnp.asarray(e[s][None], jnp.int32)
        steps.append(f)
    return steps


def judge(name: str, ours: dict, t: dict, suffix: str, tol: dict, forced: bool, taps: tuple | None):
    """One entry: ids, logits, confidence (+ main_x, rings, taps where the oracle stored them)."""
    ref_ids = t[f"dspark.output_ids{suffix}"]
    ref_logits = t[f"dspark.logits{suffix}"]
    ref_conf = t[f"dspark.confidence{suffix}"]
    S = ref_ids.shape[0]
    lg = ours["logits"][:S]
    own_next = np.argmax(lg, -1)
    mismatch = own_next != ref_ids[:, 1:]
    gap = np.max(lg, -1) - np.take_along_axis(lg, ref_ids[:, 1:, None], -1)[..., 0]
    ids_ok = bool(np.all(~mismatch | (gap <= TIE))) and bool(np.all(ours["ids"][:S, 0] == ref_ids[:, 0])) if not forced else \
        bool(np.all(~mismatch | (gap <= TIE)))
    d_logit = float(np.max(np.abs(lg.astype(np.float64) - ref_logits), initial=0.0))
    d_conf = float(np.max(np.abs(ours["confidence"][:S].astype(np.float64) - ref_conf), initial=0.0))
    ok = ids_ok and d_logit <= tol["short_max"] and d_conf <= tol["short_max"]
    detail = [f"ids {'equal' if not mismatch.any() else f'{int(mismatch.sum())} differ (max gap {float(gap.max()):.2g})'}",
              f"logits max|d| {d_logit:.3g}", f"confidence max|d| {d_conf:.3g}"]
    ulps = {}
    if not suffix:
        ulps["main_x"] = max(_ulps(ours["main_x"][:S], t["dspark.main_x"]),
                             _ulps(ours["prefill_main_x"], t["dspark.prefill_main_x"]))
        ulps["rings"] = _ulps(ours["rings_after_prefill"], t["dspark.rings_after_prefill"])
        if "dspark.rings" in t:
            ulps["rings"] = max(ulps["rings"], _ulps(ours["rings"][:S], t["dspark.rings"]))
    if taps is not None:
        pre_h, dec_h = taps
        ulps["taps"] = max(_ulps(pre_h, t["prefill_main_hidden"]), _ulps(dec_h[:S], t[f"main_hidden{suffix}"]))
    ok = ok and all(u <= REPLAY_ULPS for u in ulps.values())
    detail += [f"{k} {u:.2g}ulp" for k, u in ulps.items()]
    if forced:
        ok = ok and ours["agree"]
        detail.insert(0, "stage experts " + ("equal" if ours["agree"] else "DIFFER"))
    argmax = float(np.mean(~mismatch))
    return Entry(name, ok, d_logit, float(np.mean(np.abs(lg.astype(np.float64) - ref_logits))), argmax, forced,
                 ours["agree"] if forced else None, "; ".join(detail))
