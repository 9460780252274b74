"""Observers of the layer body: forced decisions and their agreement (golden-check, DSpark stages),
and what the body shows them (the `...Seen` tuples; golden-check's names for them live here, not
in the body)."""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from dsv41_jax.numerics import kv_layout
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


# What the body shows a probe (`Probe.see`), site by site; `named(l)` gives golden-check's names
# (the golden folders' tensor names, docs/REFERENCE.md §8) for layer l.
class FinalSeen(NamedTuple):
    final: jax.Array  # the stream collapsed with the last pre-mix, before the final norm

    def named(self, l) -> dict:
        return {"final_hidden": self.final}


class InputSeen(NamedTuple):
    h: jax.Array  # the layer's input stream, after its Engram
    pre: jax.Array

    def named(self, l) -> dict:
        return {f"layer{l}.block_input": self.h, f"layer{l}.pre_mix_in": self.pre}


class EngramSeen(NamedTuple):
    gate: jax.Array

    def named(self, l) -> dict:
        return {f"engram.{l}.gate": self.gate}


class SourceSeen(NamedTuple):
    """A KV source's writes: the compressor's latents and group ids, and the store they went to
    (its entries and index keys are read back, dequantized, only when a probe names them)."""

    latent: jax.Array
    gids: jax.Array
    store: object  # the `model.store.Store` written
    has_index_keys: bool

    def named(self, l) -> dict:
        t = {f"layer{l}.compressor_latent": self.latent, f"layer{l}.compressor_gids": self.gids,
             f"layer{l}.compressed_kv_entries": self.store.compressed_rows(l)}
        if self.has_index_keys:
            t[f"layer{l}.index_k_entries"] = kv_layout.dequantize_index_keys(self.store.stored_index_keys(l))
        return t


class PoolSeen(NamedTuple):
    pool: jax.Array  # [B, T, G] the candidate pool mask
    block_scores: jax.Array

    def named(self, l) -> dict:
        return {f"layer{l}.candidates": self.pool, "candidate_block_scores": self.block_scores}


class ScoresSeen(NamedTuple):
    scores: jax.Array  # [B, T, G] the index scores a top-k was taken over

    def named(self, l) -> dict:
        return {f"layer{l}.index_score": self.scores}


class AttnSeen(NamedTuple):
    h: jax.Array  # the stream after the attention site
    x: jax.Array  # the attention's input
    out: jax.Array  # its output projection
    o: jax.Array  # the sparse attention's output
    pre: jax.Array  # the site's mHC mixes
    post: jax.Array
    comb: jax.Array

    def named(self, l) -> dict:
        return {f"layer{l}.after_attn": self.h, f"layer{l}.attn_input": self.x, f"layer{l}.attn_output": self.out,
                f"layer{l}.sparse_attn_out": self.o, f"layer{l}.hc_attn_pre": self.pre,
                f"layer{l}.hc_attn_post": self.post, f"layer{l}.hc_attn_comb": self.comb}


class FfnSeen(NamedTuple):
    x: jax.Array  # the FFN's input
    y: jax.Array  # its output
    pre: jax.Array  # the site's mHC mixes
    post: jax.Array
    comb: jax.Array
    info: dict  # the MoE's {"scores", "weights", "experts"}

    def named(self, l) -> dict:
        return {f"layer{l}.ffn_input": self.x, f"layer{l}.ffn_output": self.y, f"layer{l}.hc_ffn_pre": self.pre,
                f"layer{l}.hc_ffn_post": self.post, f"layer{l}.hc_ffn_comb": self.comb,
                f"layer{l}.gate_scores": self.info["scores"], f"layer{l}.gate_weights": self.info["weights"],
                f"layer{l}.gate_indices": self.info["experts"]}


class Probe:
    """A static observer of the layer body (hashable; part of the jit key). Traced data it reads come
    in as `inputs` (the body's `probe_inputs`); each hook returns per-layer records. This base
    observes nothing: its hooks are identities that return no records, so the body traces to the
    same program as without it.

    Hooks, in body order:
    - enter(l, h, pre, inputs) -> (h, pre, records): the layer's input, after its Engram;
    - decide(kind, l, own, scores, inputs) -> (chosen, records): a decision the body takes, with the
      scores it was taken on: "topk" (an index source's top-k) and "experts" (the MoE's routed
      experts, with the biased gate scores); the body runs what the probe returns;
    - scored(l, ctx, inputs) -> records: after an index source selected; `ctx()` gives the store, the
      attention's query and window rows, the pool and a scoring function (training's indexer KL);
    - see(l, seen) -> records: a site's intermediates (one of the `...Seen` tuples above).

    follows(l, inputs): whether the hooks act on layer l by its number (record it, impose or replay
    something there); such a layer runs unrolled, never inside a scanned run (`block.layer_runs`),
    where the body sees the run's first layer number for every layer of the run.
    """

    def follows(self, l, inputs) -> bool:
        return False

    def enter(self, l, h, pre, inputs):
        return h, pre, {}

    def decide(self, kind, l, own, scores, inputs):
        return own, {}

    def scored(self, l, ctx, inputs) -> dict:
        return {}

    def see(self, l, seen) -> dict:
        return {}

    def __eq__(self, other):
        return type(self) is type(other) and vars(self) == vars(other)

    def __hash__(self):
        return hash((type(self), tuple(sorted(vars(self).items()))))


NO_PROBE = Probe()


class GoldenProbe(Probe):
    """golden-check's observer. inputs = {"topk": {l: [B,T,K]}, "experts": {l: [B,T,k]}, "impose": bool,
    "replay": {l: (h, pre)}} (any part may be missing). Stored decisions (inputs[kind][l]) are compared
    with the model's own (tie-aware, records `{kind}_own`, `{kind}_agree`) and imposed where the traced
    `impose` holds, so free and forced runs share one compilation; `replay` substitutes a layer's
    input; `collect` records the traces under the golden folders' names."""

    def __init__(self, collect: bool = False):
        self.collect = bool(collect)

    def follows(self, l, inputs) -> bool:
        inputs = inputs or {}
        return self.collect or any(l in (inputs.get(k) or {}) for k in ("topk", "experts", "replay"))

    def enter(self, l, h, pre, inputs):
        replay = (inputs or {}).get("replay") or {}
        if l in replay:
            h, pre = replay[l][0].astype(h.dtype), replay[l][1].astype(jnp.float32)
        return h, pre, self.see(l, InputSeen(h, pre))

    def decide(self, kind, l, own, scores, inputs):
        rec = {f"{kind}_own": own}
        forced = ((inputs or {}).get(kind) or {}).get(l)
        if forced is None:
            return own, rec
        # stored top-k rows may be narrower than the model's (-1 padding); stored experts are not
        ref = jnp.pad(forced.astype(own.dtype), [(0, 0)] * (own.ndim - 1) + [(0, own.shape[-1] - forced.shape[-1])],
                      constant_values=-1)
        rec[f"{kind}_agree"] = tie_aware_equal(scores, own, ref)
        return jnp.where(inputs.get("impose", True), ref, own), rec

    def see(self, l, seen) -> dict:
        return {"trace": seen.named(l)} if self.collect else {}


class TapProbe(Probe):
    """DSpark's taps: the stream entering each target layer (after its Engram), as `tap`."""

    def __init__(self, layers=()):
        self.layers = frozenset(layers)

    def follows(self, l, inputs) -> bool:
        return l in self.layers

    def enter(self, l, h, pre, inputs):
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

    def follows(self, l, inputs) -> bool:
        return any(p.follows(l, inputs) for p in self.probes)

    def enter(self, l, h, pre, inputs):
        rec = {}
        for p in self.probes:
            h, pre, r = p.enter(l, h, pre, inputs)
            rec = merge_records(rec, r)
        return h, pre, rec

    def decide(self, kind, l, own, scores, inputs):
        rec = {}
        for p in self.probes:
            own, r = p.decide(kind, l, own, scores, inputs)
            rec = merge_records(rec, r)
        return own, rec

    def scored(self, l, ctx, inputs) -> dict:
        rec = {}
        for p in self.probes:
            rec = merge_records(rec, p.scored(l, ctx, inputs))
        return rec

    def see(self, l, seen) -> dict:
        rec = {}
        for p in self.probes:
            rec = merge_records(rec, p.see(l, seen))
        return rec


def merge_records(*recs: dict) -> dict:
    """Per-layer records: later keys win, except "trace" dicts, which are merged."""
    out: dict = {}
    for r in recs:
        for k, v in r.items():
            out[k] = {**out[k], **v} if k == "trace" and k in out else v
    return out
