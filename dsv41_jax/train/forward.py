"""The training forward: the served math over whole packed rows, with straight-through QAT.

`model.forward` runs on a cache whose entries are stored quantized (integer codes: no
gradient) and continues one sequence per row. Training needs neither the cache nor the
continuation, but needs gradients through every format of docs/REFERENCE.md §4 and several documents per
row, so this module runs the same layer loop with:
  * window K=V, compressed KV and index keys fake-quantized in place (`quant.fake_*`, identity
    backward) instead of stored and re-read;
  * packed documents (docs/REFERENCE.md §7): positions restart at every document (`batch["positions"]`);
    a window slot, compressed group or candidate block is visible only inside the query's own
    document, and a compression group that straddles two documents (or padding) is invisible
    to everyone; with document starts aligned to the ratios (see `data.pack`), groups and
    candidate blocks are exactly the document-relative ones serving computes;
  * optional replay-aware windows: decoder layers see only window slots >= a per-row tail
    start s (for queries at or after s), as split prefill runs them (docs/REFERENCE.md §5);
  * the indexer's KL objective (docs/REFERENCE.md §7) on sampled query positions, from detached inputs.
On unpacked rows with T = max_seq_len the logits equal `model.forward`'s bit for bit (with the
training model built with exact_mhc=True; see qat_modules.LoopedHyperSite).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

from dsv41_jax.numerics import quant
from dsv41_jax.layers.indexer import candidate_pool
from dsv41_jax.layers.mhc_site import collapse, expand
from dsv41_jax.layers.basic import matmul
from dsv41_jax.layers.rope import apply_rope, cos_sin, layer_rope
from pallas_kernels.sparse_attention.dense_reference import sparse_attention

sg = jax.lax.stop_gradient


@dataclass(frozen=True)
class ForwardOptions:
    """Static switches of the training forward.

    act_quant: fake-quantize activations and cached K/V (model semantics; off only to
      compare with the unquantized function in tests).
    kl_positions: query positions per row for the indexer KL (0 = no KL).
    """

    act_quant: bool = True
    kl_positions: int = 0


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


def _select(scores, legal, k: int):
    """Top-k legal positions, ascending, -1 padded (ties to the lower index, like select_topk)."""
    _, idx = jax.lax.top_k(scores, k)
    idx = jnp.sort(idx, axis=-1)
    ok = jnp.take_along_axis(legal, idx, axis=-1)
    return jnp.where(ok, idx, -1).astype(jnp.int32)


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


def train_forward(model, batch: dict, opts: ForwardOptions = ForwardOptions(), *, replay_start=None, kl_pos=None):
    """Logits [B, T, V] fp32 and aux for the losses.

    batch: tokens [B,T] int32, positions [B,T] int32 (document-relative, restarting at 0 at
      every document; padding counts as one-token documents), engram_ids [B,T,n,cols] int32
      when the model has Engram.
    replay_start: [B] int32 tail starts for replay-aware decoder windows (None: exact prefill).
    kl_pos: [B, P] int32 sampled query positions for the indexer KL (needs opts.kl_positions).
    aux: experts {l: [B,T,k]}, gate_scores {l: [B,T,E]}, indexer_kl {l: (sum, count)}.
    """
    cfg = model.cfg
    mode = "fast"
    tokens, positions = batch["tokens"], batch["positions"]
    B, T = tokens.shape
    W = cfg.window_size
    for s in cfg.kv_source_layers:
        if T % cfg.compress_ratios[s]:
            raise ValueError(f"sequence length {T} must be a multiple of layer {s}'s compress ratio {cfg.compress_ratios[s]}")
    seg_start = jnp.arange(T)[None] - positions  # absolute index where each token's document starts
    engram_ids = batch.get("engram_ids")
    q8 = (lambda a: quant.fake_fp8_act(a, 32)) if opts.act_quant else (lambda a: a)
    q4kv = (lambda a: quant.fake_fp4_kv(a, 16)) if opts.act_quant else (lambda a: a)
    q4mx = (lambda a: quant.fake_fp4_mx(a, 32)) if opts.act_quant else (lambda a: a)
    aux = {"experts": {}, "gate_scores": {}, "indexer_kl": {}}
    truncate_any = replay_start is not None

    h = model.embed[...][tokens]
    h = jnp.broadcast_to(h[:, :, None, :], (B, T, cfg.hc_mult, cfg.dim))
    pre = jnp.zeros((B, T, cfg.hc_mult), jnp.float32).at[..., 0].set(1.0)
    comp_of, ikeys_of, legal_of, topk_of = {}, {}, {}, {}
    pool = None

    for block in model.layers:
        l, role = block.layer, block.role
        if block.engram is not None:
            if engram_ids is None:
                raise ValueError(f"layer {l} has Engram: the batch needs engram_ids (see dsv41_jax.train.data)")
            h, _ = block.engram(h, engram_ids[:, :, cfg.engram_layer_ids.index(l)], mode)
        a_pre, a_post, a_comb = block.hc_attn.mixes(h, mode)
        x = block.attn_norm(collapse(h, pre))
        attn = block.attn
        freqs = layer_rope(cfg, role.ratio)
        cos, sin = cos_sin(positions, freqs)
        qr, q = attn.queries(x, cos, sin, mode)
        win = q8(attn.window_kv(x, cos, sin, mode))
        win_idx = _window_slots(T, W, seg_start, replay_start, truncate_any and role.half == "decoder")
        keys, idx = win, win_idx

        if role.ratio:
            m, src = role.ratio, role.kv_source
            if role.is_kv_source:
                state = None
                if m > 1:
                    state = {"kv": jnp.zeros((B, m, cfg.head_dim), jnp.float32),
                             "score": jnp.full((B, m, cfg.head_dim), -jnp.inf, jnp.float32)}
                lat, _, _ = attn.compressor.groups(x, jnp.zeros((B,), jnp.int32), state, mode)
                G = T // m
                lat = lat[:, :G]
                gpos = positions[:, ::m][:, :G]  # a group takes its first token's position
                gcos, gsin = cos_sin(gpos, freqs)
                comp_of[src] = q4kv(apply_rope(lat, gcos, gsin, cfg.rope_head_dim))
                legal_of[src] = _legal_groups(positions, seg_start, m)
                if attn.indexer is not None:
                    # keys from the detached latent: only the KL trains the key projection
                    ikeys_of[src] = q4mx(attn.indexer.keys(sg(lat), gcos, gsin, mode)).astype(jnp.bfloat16)
            legal = legal_of[src]
            if role.is_index_source:
                visible = (jnp.arange(T)[None] + 1) // m * jnp.ones((B, 1), jnp.int32)
                scores = attn.indexer.scores(sg(x), sg(qr), sg(ikeys_of[src]), cos, sin, visible, mode)
                scores = jnp.where(legal, sg(scores), -jnp.inf)
                allowed = legal
                if role.is_candidate_source:
                    newest = jnp.max(jnp.where(legal, jnp.arange(legal.shape[-1]), -1), -1)
                    pool, _ = candidate_pool(scores, newest + 1, cfg.candidate_topk_blocks, cfg.candidate_block_size)
                elif role.uses_candidates:
                    scores = jnp.where(pool, scores, -jnp.inf)
                    allowed = legal & pool
                k = min(cfg.index_topk, scores.shape[-1])
                topk_of[l] = _select(scores, legal, k)
                if opts.kl_positions and kl_pos is not None:
                    aux["indexer_kl"][l] = _indexer_kl(attn, x, qr, q, win, win_idx, comp_of[src], ikeys_of[src],
                                                       allowed, cos, sin, visible, kl_pos, cfg, mode)
            sel = topk_of[role.index_source]
            keys = jnp.concatenate([win, comp_of[src].astype(win.dtype)], 1)
            idx = jnp.concatenate([win_idx, jnp.where(sel >= 0, sel + T, -1)], -1)

        o = sparse_attention(q, keys.astype(q.dtype), attn.attn_sink[...], idx, cfg.head_dim ** -0.5, mode=mode)
        h = expand(attn.output(o, cos, sin, mode), h, a_post, a_comb)

        f_pre, f_post, f_comb = block.hc_ffn.mixes(h, mode)
        x = block.ffn_norm(collapse(h, a_pre))
        y, info = block.ffn(x, mode, impl="xla")
        aux["experts"][l] = info["experts"]
        aux["gate_scores"][l] = info["scores"]
        h = expand(y, h, f_post, f_comb)
        pre = f_pre

    x = model.norm(collapse(h, pre))
    logits = matmul(x.astype(jnp.float32), model.head[...].astype(jnp.float32), "btd,vd->btv", jnp.float32, mode)
    return logits, aux


def _indexer_kl(attn, x, qr, q, win, win_idx, comp, ikeys, allowed, cos, sin, visible, kl_pos, cfg, mode):
    """KL(main-attention mass || softmax(index scores)) at the sampled positions (docs/REFERENCE.md §7)."""
    pick = lambda a: _gather_rows(a, kl_pos)
    allowed_s = pick(allowed)
    target = sg(_attention_target(sg(pick(q)), sg(win), pick(win_idx), sg(comp), allowed_s,
                                  sg(attn.attn_sink[...]), cfg.head_dim ** -0.5))
    student = attn.indexer.scores(sg(pick(x)), sg(pick(qr)), ikeys, pick(cos), pick(sin), pick(visible), mode)
    return _kl(target, student, allowed_s)
