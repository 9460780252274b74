"""The training forward: the served math over whole packed rows, with straight-through QAT.

`model.forward` runs on a cache whose entries are stored quantized (integer codes: no
gradient) and continues one sequence per row. Training needs neither the cache nor the
continuation, but needs gradients through every format of docs/REFERENCE.md §4 and several documents per
row, so this module runs the one layer body (`dsv41_jax.model.block`) on a `FakeQuantStore`, with:
  * window K=V, compressed KV and index keys fake-quantized in place (`quant.fake_*`, identity
    backward) instead of stored and re-read;
  * packed documents (docs/REFERENCE.md §7): positions restart at every document (`batch["positions"]`);
    a window slot, compressed group or candidate block is visible only inside the query's own
    document, and a compression group that straddles two documents (or padding) is invisible
    to everyone; with document starts aligned to the ratios (see `data.pack`), groups and
    candidate blocks are exactly the document-relative ones serving computes;
  * optional replay-aware windows: decoder layers see only window slots >= a per-row tail
    start s (for queries at or after s), as split prefill runs them (docs/REFERENCE.md §5);
  * the indexer's KL objective (docs/REFERENCE.md §7) on sampled query positions, from detached inputs
    (`TrainProbe`, a probe of the body, with the layers' gate scores).
On unpacked rows with T = max_seq_len the logits equal `model.forward`'s bit for bit (with the
training model built with exact_mhc=True; see qat_modules.LoopedHyperSite).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from dsv41_jax.model import block as body
from dsv41_jax.model import probe as body_probe
from dsv41_jax.numerics import kv_layout, quant
from dsv41_jax.runtime import Runtime

sg = jax.lax.stop_gradient


@dataclass(frozen=True)
class ForwardOptions:
    """Static switches of the training forward.

    act_quant: fake-quantize activations and cached K/V (model semantics; off only to
      compare with the unquantized function in tests).
    kl_positions: query positions per row for the indexer KL (0 = no KL).
    impl, interpret: the kernel choice (`Runtime`): "pallas" runs the attention kernel with gradients
      for q, the rows and the sink (`pallas_kernels.sparse_sink_attention_values`) and the indexer
      kernel for selection (no gradient: top-k); the indexer KL keeps the XLA scoring it trains
      through, and the GEMMs stay XLA (the QAT masters are dense, not packed: the FP8 and expert
      kernels read packed weights). Needs act_quant (the kernels read quantized rows).
    remat: each layer under `jax.checkpoint` (`body.remat_step`): the backward recomputes a layer from
      its input, so a step holds one layer's intermediates at a time, not every layer's. The loss is
      the same bit for bit; a few gradients differ in the last bits (XLA fuses the recomputed
      forward differently: a few elements one fp32 or bf16 rounding apart in the two-layer test model).
    """

    act_quant: bool = True
    kl_positions: int = 0
    impl: str = "xla"
    interpret: bool | None = None
    remat: bool = True


def _window_slots(T: int, W: int, seg_start, replay_start, truncate: bool):
    """Window indices [B, T, W] into the row's own keys (oldest first); -1 where hidden."""
    t = jnp.arange(T)[:, None]
    p = t - (W - 1) + jnp.arange(W)[None]  # [T, W]
    lo = seg_start[:, :, None]  # [B, T, 1] first position of the query's document
    if truncate:  # split prefill: decoder layers never saw tokens before the tail start s
        s = replay_start[:, None, None]
        lo = jnp.where(t[None] >= s, jnp.maximum(lo, s), lo)
    return jnp.where((p[None] >= 0) & (p[None] >= lo), p[None], -1).astype(jnp.int32)


def _legal_groups(positions, seg_start, m: int):
    """[B, T, G] visibility of compressed group g to query t, document-aware.

    Group g (tokens gm..gm+m-1) is pure iff its last token's document started at or before gm;
    it is visible to t iff complete by t (g < (t+1)//m, docs/REFERENCE.md §3) and in t's document.
    """
    B, T = positions.shape
    G = T // m
    last = positions[:, m - 1::m][:, :G]  # doc-relative position of each group's last token
    pure = last >= m - 1
    g = jnp.arange(G)
    t = jnp.arange(T)
    complete = g[None, :] < ((t + 1) // m)[:, None]  # [T, G]
    same_doc = g[None, None, :] * m >= seg_start[:, :, None]
    return complete[None] & same_doc & pure[:, None, :]


def _gather_rows(a, pos):
    """a [B, T, ...] at positions pos [B, P] -> [B, P, ...]."""
    return jnp.take_along_axis(a, pos.reshape(pos.shape + (1,) * (a.ndim - 2)), axis=1)


def _attention_target(q_s, win, win_idx_s, comp, allowed_s, sink, scale):
    """Head-summed main-attention mass on the compressed entries, renormalised (docs/REFERENCE.md §7).

    q_s [B,P,H,D] (detached queries at the sampled positions), win [B,T,D] window keys,
    win_idx_s [B,P,W], comp [B,G,D] compressed entries, allowed_s [B,P,G] the legal (and
    pool-restricted) set. The softmax runs over window slots, all allowed entries and the sink.
    """
    f32 = jnp.float32
    qf = q_s.astype(f32)
    s_c = jnp.einsum("bphd,bgd->bphg", qf, comp.astype(f32)) * f32(scale)
    s_c = jnp.where(allowed_s[:, :, None, :], s_c, -jnp.inf)
    rows = jax.vmap(lambda w, i: w[jnp.maximum(i, 0)])(win, win_idx_s)  # [B,P,W,D]
    s_w = jnp.einsum("bphd,bpwd->bphw", qf, rows.astype(f32)) * f32(scale)
    s_w = jnp.where((win_idx_s >= 0)[:, :, None, :], s_w, -jnp.inf)
    m = jnp.maximum(jnp.max(s_c, -1), jnp.max(s_w, -1))
    m = jnp.maximum(m, sink[None, None, :])
    e_c = jnp.exp(s_c - m[..., None])
    z = jnp.sum(e_c, -1) + jnp.sum(jnp.exp(s_w - m[..., None]), -1) + jnp.exp(sink[None, None, :] - m)
    mass = jnp.sum(e_c / z[..., None], axis=2)  # [B,P,G]
    total = jnp.sum(mass, -1, keepdims=True)
    return jnp.where(total > 0, mass / jnp.where(total > 0, total, 1.0), 0.0)


def _kl(target, student_scores, allowed):
    """sum_g p log(p/q) with q = softmax(I) over the allowed set; (sum, count) over rows with a set."""
    has = jnp.any(allowed, -1)
    logits = jnp.where(allowed & has[..., None], student_scores, -jnp.inf)
    logits = jnp.where(has[..., None], logits, 0.0)
    logq = jax.nn.log_softmax(logits, axis=-1)
    logq = jnp.where(allowed, logq, 0.0)
    plogp = jnp.where(target > 0, target * jnp.log(jnp.where(target > 0, target, 1.0)), 0.0)
    kl = jnp.sum(plogp - target * logq, -1)
    return jnp.sum(jnp.where(has, kl, 0.0)), jnp.sum(has).astype(jnp.float32)


@jax.tree_util.register_pytree_node_class
class FakeQuantStore:
    """The training cache as the layer body (`dsv41_jax.model.block`) sees it: every row a whole
    (packed) sequence from position 0, nothing stored across calls, values fake-quantized in place
    (straight-through). It answers the body's `model.store.Store` as `QuantStore` does; the answers differ in:
      * window: the row's own keys at fake-FP8 values, visible inside the query's document only
        (and, with `replay_start`, decoder layers see only slots >= the tail start);
      * groups: one zero compressor state per row, groups at their document-relative positions, only
        the T // m complete groups; legal = complete, pure and in the query's document;
      * index keys: computed from the detached latent (only the KL trains the key projection) and
        scored from detached inputs; the top-k keeps legal groups only.
    """

    def __init__(self, cfg, positions, replay_start=None, act_quant: bool = True):
        self.cfg, self.positions, self.replay_start, self.act_quant = cfg, positions, replay_start, act_quant
        self.seg_start = jnp.arange(positions.shape[1])[None] - positions  # where each token's document starts
        self.comp, self.comp_raw, self.ikeys, self.ikeys_raw, self.legal = {}, {}, {}, {}, {}

    # a pytree, so a layer under `jax.checkpoint` takes and returns it (`body.remat_step`)
    _ARRAYS = ("positions", "replay_start", "seg_start", "comp", "comp_raw", "ikeys", "ikeys_raw", "legal")

    def tree_flatten(self):
        return tuple(getattr(self, k) for k in self._ARRAYS), (self.cfg, self.act_quant)

    @classmethod
    def tree_unflatten(cls, aux, children):
        out = cls.__new__(cls)
        out.cfg, out.act_quant = aux
        out.__dict__.update(zip(cls._ARRAYS, children))
        return out

    def copy(self) -> "FakeQuantStore":
        out = FakeQuantStore.__new__(FakeQuantStore)
        out.__dict__.update(self.__dict__)
        out.comp, out.comp_raw, out.ikeys, out.ikeys_raw, out.legal = (
            dict(self.comp), dict(self.comp_raw), dict(self.ikeys), dict(self.ikeys_raw), dict(self.legal))
        return out

    def _q(self, fn, a, block):
        return fn(a, block) if self.act_quant else a

    def window(self, l, raw, span):
        T = raw.shape[1]
        truncate = self.replay_start is not None and self.cfg.roles[l].half == "decoder"
        idx = _window_slots(T, self.cfg.window_size, self.seg_start, self.replay_start, truncate)
        # the kernel's rows: before quantization (it quantizes them as fake_fp8_act does, bit for bit)
        return self._q(quant.fake_fp8_act, raw, 32), idx, (raw, idx) if self.act_quant else None

    def visible(self, span, m: int):
        B, T = span.positions.shape
        return (jnp.arange(T)[None] + 1) // m * jnp.ones((B, 1), jnp.int32)

    def compressor_state(self, src: int):
        m, B = self.cfg.compress_ratios[src], self.positions.shape[0]
        if m == 1:
            return None
        return {"kv": jnp.zeros((B, m, self.cfg.head_dim), jnp.float32),
                "score": jnp.full((B, m, self.cfg.head_dim), -jnp.inf, jnp.float32)}

    def groups(self, src: int, m: int, lat, gids, span):
        G = self.positions.shape[1] // m
        return lat[:, :G], self.positions[:, ::m][:, :G], None  # a group takes its first token's position

    def key_source(self, lat):
        return sg(lat)

    def write_source(self, src: int, state, gids, entries, index_keys, rows=None) -> None:
        m = self.cfg.compress_ratios[src]
        self.comp[src] = self._q(quant.fake_fp4_kv, entries, 16)
        self.comp_raw[src] = entries
        self.legal[src] = _legal_groups(self.positions, self.seg_start, m)
        if index_keys is not None:
            self.ikeys[src] = self._q(quant.fake_fp4_mx, index_keys, 32).astype(jnp.bfloat16)
            self.ikeys_raw[src] = index_keys

    def topk_width(self, src: int) -> int:
        return min(self.cfg.index_topk, self.positions.shape[1] // self.cfg.compress_ratios[src])

    # nothing is kept per layer (the window is the row's own keys), so a scanned run carries no part
    def stacked(self, layers):
        return ()

    def at_layer(self, l: int, parts, i) -> "FakeQuantStore":
        return self.copy()

    def written(self, l: int):
        return (), ()

    def unstacked(self, layers, parts, outputs) -> "FakeQuantStore":
        return self.copy()

    def index_inputs(self, x, qr):
        return sg(x), sg(qr)

    def index_key_container(self, role, plan):
        """The indexer kernel's keys: the MXFP4 container of the raw keys (its values are the fake-
        quantized keys bit for bit), no gradient; None without act_quant (the XLA scoring then)."""
        if not self.act_quant:
            return None
        if plan.runtime.index_k_quirk:
            raise ValueError("training scores the intended index keys (Runtime.index_k_quirk=False)")
        return self.stored_index_keys(role.kv_source)

    def stored_index_keys(self, src: int):
        """The source's keys packed as MXFP4 (values: the fake-quantized keys), no gradient."""
        return kv_layout.quantize_index_keys(sg(self.ikeys_raw[src]))

    def index_keys(self, role, plan):
        if plan.runtime.index_k_quirk:
            raise ValueError("training scores the intended index keys (Runtime.index_k_quirk=False)")
        return sg(self.ikeys[role.kv_source])

    def mask_scores(self, src: int, scores):
        return jnp.where(self.legal[src], sg(scores), -jnp.inf)

    def pool_visible(self, src: int, visible):
        legal = self.legal[src]
        return jnp.max(jnp.where(legal, jnp.arange(legal.shape[-1]), -1), -1) + 1  # past the newest legal group

    def restrict(self, src: int, sel):
        ok = jnp.take_along_axis(self.legal[src], jnp.maximum(sel, 0), axis=-1)
        return jnp.where((sel >= 0) & ok, sel, -1).astype(jnp.int32)

    def compressed(self, src: int):
        """What the attention kernel reads: the rows before quantization (`window`'s third value)."""
        return self.comp_raw[src]

    def compressed_rows(self, src: int):
        return self.comp[src]


class TrainProbe(body_probe.Probe):
    """Training's observer of the layer body: with `kl`, the indexer KL at the sampled query positions
    inputs["kl_pos"] [B, P] (docs/REFERENCE.md §7). The balance loss's gate scores are the body's own
    record (`ffn_site`'s "gate_scores")."""

    def __init__(self, kl: bool = False):
        self.kl = bool(kl)

    def scored(self, l, ctx, inputs) -> dict:
        if not self.kl:
            return {}
        c = ctx()
        store, src, attn = c["store"], c["src"], c["attn"]
        allowed = store.legal[src] if c["pool"] is None else store.legal[src] & c["pool"]
        pick = lambda a: _gather_rows(a, inputs["kl_pos"])
        allowed_s = pick(allowed)
        target = sg(_attention_target(sg(pick(c["q"])), sg(c["win"]), pick(c["win_idx"]), sg(store.comp[src]),
                                      allowed_s, sg(attn.attn_sink[...]), store.cfg.head_dim ** -0.5))
        return {"indexer_kl": _kl(target, c["score"](pick, store.ikeys[src]), allowed_s)}


def train_forward(model, batch: dict, opts: ForwardOptions = ForwardOptions(), *, replay_start=None, kl_pos=None,
                  taps: bool = False, layout=None):
    """Logits [B, T, V] fp32 and aux for the losses: the layer body on a `FakeQuantStore`.

    batch: tokens [B,T] int32, positions [B,T] int32 (document-relative, restarting at 0 at
      every document; padding counts as one-token documents), engram_ids [B,T,n,cols] int32
      when the model has Engram.
    replay_start: [B] int32 tail starts for replay-aware decoder windows (None: exact prefill).
    kl_pos: [B, P] int32 sampled query positions for the indexer KL (needs opts.kl_positions).
    taps: also return DSpark's taps (aux["main_hidden"] [B, T, n * d], `probe.TapProbe`), what the drafter
      trains on (`dsv41_jax.train.dspark`).
    layout: applied to each layer's module where it runs (`train.mesh.layer_layout`: on a mesh, its
      weights gathered over the FSDP axes); None: as they are.
    aux: experts {l: [B,T,k]}, gate_scores {l: [B,T,E]}, indexer_kl {l: (sum, count)}.
    """
    cfg = model.cfg
    tokens, positions = batch["tokens"], batch["positions"]
    B, T = tokens.shape
    for s in cfg.kv_source_layers:
        if T % cfg.compress_ratios[s]:
            raise ValueError(f"sequence length {T} must be a multiple of layer {s}'s compress ratio {cfg.compress_ratios[s]}")
    if any(block.engram is not None for block in model.layers) and batch.get("engram_ids") is None:
        raise ValueError("the model has Engram layers: the batch needs engram_ids (see dsv41_jax.train.data)")
    plan = body.Plan.resolve(Runtime(mode="fast", impl=opts.impl, interpret=opts.interpret))
    store = FakeQuantStore(cfg, positions, replay_start, opts.act_quant)
    span = body.Span(positions=positions, start=jnp.zeros((B,), jnp.int32), engram_ids=batch.get("engram_ids"))
    probe = TrainProbe(kl=bool(opts.kl_positions) and kl_pos is not None)
    if taps:
        probe = body_probe.Probes(probe, body_probe.TapProbe(cfg.dspark_target_layer_ids))
    h, pre = body.embed(model, tokens)
    state, rec = body.run_layers(model, body.LayerState.first(h, pre, store), span, plan, range(cfg.n_layers), probe,
                                 {"kl_pos": kl_pos}, remat=opts.remat, layout=layout)
    logits = body.head(model, state.h, state.pre, plan.runtime.mode)[0]
    aux = {k: rec.get(k, {}) for k in ("experts", "gate_scores", "indexer_kl")}
    if taps:
        aux["main_hidden"] = body_probe.TapProbe.hidden(rec)
    return logits, aux
