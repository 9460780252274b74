"""Observers of the layer body: forced decisions and their agreement (golden-check, DSpark stages)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from dsv41_jax.numerics.exact_ops import sum_in_order


def tap(h: jax.Array) -> jax.Array:
    """DSpark's tap: the mean over the hc copies of a stream [..., hc, d] (fp32 sum in order, one
    division), in the stream's dtype."""
    hc = h.shape[-2]
    s = sum_in_order(h.astype(jnp.float32), axis=-2)[..., 0, :]
    return (s / jnp.float32(hc)).astype(h.dtype)


def tie_aware_equal(scores: jax.Array, own: jax.Array, ref: jax.Array) -> jax.Array:
    """Per row: do two index sets agree, up to exact ties at the selection boundary?

    own/ref: [..., K] with -1 padding. The sets may differ only in elements whose score equals
    the lowest selected score of `own` (a tie the oracle broke differently).
    """
    def member(a, b):
        return jnp.any((a[..., :, None] == b[..., None, :]) & (b[..., None, :] >= 0), axis=-1) & (a >= 0)

    own_only = (own >= 0) & ~member(own, ref)
    ref_only = (ref >= 0) & ~member(ref, own)
    s_own = jnp.take_along_axis(scores, jnp.maximum(own, 0), -1)
    s_ref = jnp.take_along_axis(scores, jnp.maximum(ref, 0), -1)
    bound = jnp.min(jnp.where(own >= 0, s_own, jnp.inf), -1, keepdims=True)
    same_count = jnp.sum(own >= 0, -1) == jnp.sum(ref >= 0, -1)
    ok_own = jnp.all(~own_only | (s_own == bound), -1)
    ok_ref = jnp.all(~ref_only | (s_ref == bound), -1)
    return same_count & ok_own & ok_ref


class Probe:
    """A static observer of the layer body (hashable; part of the jit key). Traced inputs come in
    through `pin`; each hook returns per-layer records. This base observes nothing: its hooks are
    identities that return no records, so the body traces to the same program as without it.

    Hooks, in body order:
    - enter(l, h, pre, pin) -> (h, pre, records): the layer's input, after its Engram;
    - decide(kind, l, own, scores, pin) -> (chosen, records): a decision the body takes, with the
      scores it was taken on: "topk" (an index source's top-k) and "experts" (the MoE's routed
      experts, with the biased gate scores); the body runs what the probe returns;
    - scored(l, ctx, pin) -> records: after an index source selected; `ctx()` gives the store, the
      attention's query and window rows, the pool and a scoring function (training's indexer KL);
    - see(l, thunk) -> records: `thunk()` builds named intermediates; only recording probes call it.
    """

    def enter(self, l, h, pre, pin):
        return h, pre, {}

    def decide(self, kind, l, own, scores, pin):
        return own, {}

    def scored(self, l, ctx, pin) -> dict:
        return {}

    def see(self, l, thunk) -> dict:
        return {}

    def __eq__(self, other):
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self):
        return hash((type(self), tuple(sorted(vars(self).items()))))


NO_PROBE = Probe()


class GoldenProbe(Probe):
    """golden-check's observer. pin = {"topk": {l: [B,T,K]}, "experts": {l: [B,T,k]}, "impose": bool,
    "replay": {l: (h, pre)}} (any part may be missing). Stored decisions (pin[kind][l]) are compared
    with the model's own (tie-aware, records `{kind}_own`, `{kind}_agree`) and imposed where the traced
    `impose` holds, so free and forced runs share one compilation; `replay` substitutes a layer's
    input; `collect` records the traces."""

    def __init__(self, collect: bool = False):
        self.collect = bool(collect)

    def enter(self, l, h, pre, pin):
        replay = (pin or {}).get("replay") or {}
        if l in replay:
            h, pre = replay[l][0].astype(h.dtype), replay[l][1].astype(jnp.float32)
        return h, pre, self.see(l, lambda: {f"layer{l}.block_input": h, f"layer{l}.pre_mix_in": pre})

    def decide(self, kind, l, own, scores, pin):
        rec = {f"{kind}_own": own}
        forced = ((pin or {}).get(kind) or {}).get(l)
        if forced is None:
            return own, rec
        # stored top-k rows may be narrower than the model's (-1 padding); stored experts are not
        ref = jnp.pad(forced.astype(own.dtype), [(0, 0)] * (own.ndim - 1) + [(0, own.shape[-1] - forced.shape[-1])],
                      constant_values=-1)
        rec[f"{kind}_agree"] = tie_aware_equal(scores, own, ref)
        return jnp.where(pin.get("impose", True), ref, own), rec

    def see(self, l, thunk) -> dict:
        return {"trace": thunk()} if self.collect else {}


class TapProbe(Probe):
    """DSpark's taps: the stream entering each target layer (after its Engram), as `tap`."""

    def __init__(self, layers=()):
        self.layers = frozenset(layers)

    def enter(self, l, h, pre, pin):
        return h, pre, ({"tap": tap(h)} if l in self.layers else {})

    @staticmethod
    def hidden(records: dict):
        """The taps of `run_layers` records concatenated in layer order ("main_hidden" [B, T, n * d]),
        or None when none were taken."""
        taps = records.get("tap")
        return None if not taps else jnp.concatenate([taps[l] for l in sorted(taps)], -1)


class Probes(Probe):
    """Probes composed in order: each hook chains (enter, decide: each sees the previous one's
    choice) and their records merge."""

    def __init__(self, *probes: Probe):
        self.probes = tuple(probes)

    def enter(self, l, h, pre, pin):
        rec = {}
        for p in self.probes:
            h, pre, r = p.enter(l, h, pre, pin)
            rec = merge_records(rec, r)
        return h, pre, rec

    def decide(self, kind, l, own, scores, pin):
        rec = {}
        for p in self.probes:
            own, r = p.decide(kind, l, own, scores, pin)
            rec = merge_records(rec, r)
        return own, rec

    def scored(self, l, ctx, pin) -> dict:
        rec = {}
        for p in self.probes:
            rec = merge_records(rec, p.scored(l, ctx, pin))
        return rec

    def see(self, l, thunk) -> dict:
        rec = {}
        for p in self.probes:
            rec = merge_records(rec, p.see(l, thunk))
        return rec


def merge_records(*recs: dict) -> dict:
    """Per-layer records: later keys win, except "trace" dicts, which are merged."""
    out: dict = {}
    for r in recs:
        for k, v in r.items():
            out[k] = {**out[k], **v} if k == "trace" and k in out else v
    return out
