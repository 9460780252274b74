"""Observers of the layer body (`model.block.block_step`): what watches a layer without changing it.

The body calls a probe at fixed points; `NO_PROBE`'s methods return their input (or nothing),
so an unobserved call traces to exactly the operations of the layer and nothing else. A probe
is a static Python object of the trace (it may hold traced arrays, such as forced decisions).

- `RecordProbe` keeps each layer's top-k and expert choice (model.forward's aux, the engine's
  decision comparisons).
- `GoldenProbe` (the golden check): forces top-k and expert decisions and reports, tie-aware,
  whether the model's own agreed; records per-layer traces; substitutes a layer's input for
  single-layer replays.
- Training's probe (`dsv41_jax.train.forward`) collects the gate scores and the indexer KL.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


class Probe:
    """The do-nothing observer; subclasses override the hooks they need."""

    def enter(self, layer: int, h, pre):
        """A layer's input stream (after its Engram): returned unchanged."""
        return h, pre

    def tap(self, name: str, value) -> None:
        """A named intermediate; `value` may be a thunk, evaluated only by probes that record."""

    def topk(self, layer: int, scores, own):
        """An index source's own top-k over `scores`: returns the selection the body uses."""
        return own

    def used_topk(self, layer: int, sel) -> None:
        """The top-k a compressed layer attends with (its own or its index source's)."""

    def forced_experts(self, layer: int):
        """(expert ids to impose or None, impose flag) for the MoE gate of `layer`."""
        return None, True

    def routed(self, layer: int, info: dict, bias) -> None:
        """The MoE's routing `info` (scores, weights, experts) and the gate's selection bias."""

    def index_objective(self, layer: int, get) -> None:
        """Training's indexer KL: `get()` returns its inputs (see `dsv41_jax.train.forward`)."""


NO_PROBE = Probe()


class RecordProbe(Probe):
    """Keeps every layer's attended top-k and routed experts in `aux` ({"topk": {}, "experts": {}})."""

    def __init__(self):
        self.aux = {"topk": {}, "experts": {}}

    def used_topk(self, layer, sel):
        self.aux["topk"][layer] = sel

    def routed(self, layer, info, bias):
        self.aux["experts"][layer] = info["experts"]


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


class GoldenProbe(RecordProbe):
    """Forced decisions, traces and replays for the golden check (model.forward's `forced`,
    `collect` and `replay` arguments; see there)."""

    def __init__(self, forced: dict | None = None, collect: bool = False, replay: dict | None = None, n_active: int = 0):
        super().__init__()
        self.forced, self.collect, self.replay, self.n_active = forced, collect, replay, n_active
        self.aux.update({"topk_agree": {}, "experts_agree": {}, "trace": {}})
        self._impose = True if forced is None else forced.get("impose", True)

    def enter(self, layer, h, pre):
        if self.replay is not None and layer in self.replay:
            h, pre = self.replay[layer][0].astype(h.dtype), self.replay[layer][1].astype(jnp.float32)
        self.tap(f"layer{layer}.block_input", h)
        self.tap(f"layer{layer}.pre_mix_in", pre)
        return h, pre

    def tap(self, name, value):
        if self.collect:
            self.aux["trace"][name] = value() if callable(value) else value

    def topk(self, layer, scores, own):
        if self.forced is None or layer not in self.forced.get("topk", {}):
            return own
        ref = self.forced["topk"][layer]
        ref = jnp.pad(ref, [(0, 0), (0, 0), (0, own.shape[-1] - ref.shape[-1])], constant_values=-1)
        self.aux["topk_agree"][layer] = tie_aware_equal(scores, own, ref)
        return jnp.where(self._impose, ref.astype(jnp.int32), own)

    def forced_experts(self, layer):
        if self.forced is None:
            return None, True
        return self.forced.get("experts", {}).get(layer), self._impose

    def routed(self, layer, info, bias):
        super().routed(layer, info, bias)
        forced, _ = self.forced_experts(layer)
        if forced is not None:
            biased = info["scores"] + bias
            own = jax.lax.top_k(biased, self.n_active)[1]
            self.aux["experts_agree"][layer] = tie_aware_equal(biased, own, forced.astype(own.dtype))
        for k in ("scores", "weights"):
            self.tap(f"layer{layer}.gate_{k}", info[k])
        self.tap(f"layer{layer}.gate_indices", info["experts"])
