"""An estimate of per-device activation bytes for one serving step (not a profile).

How: we add up the large tensors that are live at once in the widest layer (a ratio-1 Full
layer with compressor, indexer, candidate pool and Engram) of the XLA reference path, plus the
output head, for the per-device share of the work. Sizes come from the config and the mesh:

  stream    residual stream and the f32 temporaries of the mHC mixes: n x hc x dim x (2 + 3*4)
  cache     the layer's caches dequantized for attention/indexing: compressed KV (f32 + bf16),
            index keys (f32 + bf16), window ring, per sequence
  indexer   per-head scores [n, index_heads_local, G] in bf16 and f32, and their fp32 sum
  attention gathered KV rows [n, window+topk, head_dim] f32 and logits [n, heads_local, slots] f32 x2
  moe       EP buffers (send, receive, return: worst-case capacity) + the local experts
            dequantized to bf16 for the grouped GEMM + hidden activations
  engram    looked-up rows and the wkv projection, f32
  head      logits [n, vocab_local] f32 and the head weight cast to f32

Two steps are estimated and the larger is reported: a decode step (one token for each of
the device's sequences) and a prefill chunk (`chunk` tokens of one sequence). Kernel paths
(Pallas) read quantized caches directly and need far less; this is an upper bound for XLA.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

from dsv41_jax.config import ModelConfig
from sharding.rules import get_rules, resolve


def _shards(logical: str, dim: int, rules, sizes: Mapping[str, int]) -> int:
    spec = resolve((logical,), (dim,), rules, sizes).spec
    if not spec or spec[0] is None:
        return 1
    axes = (spec[0],) if isinstance(spec[0], str) else spec[0]
    return math.prod(sizes[a] for a in axes)


def step_bytes(cfg: ModelConfig, sizes: Mapping[str, int], preset, *, seqs: int, tokens_per_seq: int,
               total_tokens: int) -> dict[str, int]:
    """Live bytes of one step in which this device attends for `seqs` sequences x `tokens_per_seq`
    tokens, out of `total_tokens` in the whole step (the MoE spreads those over all devices)."""
    rules = get_rules(preset)
    n_dev = math.prod(sizes.values())
    n = seqs * tokens_per_seq
    G = cfg.max_seq_len  # ratio-1 source: one entry per token
    W, D, Di = cfg.window_size, cfg.head_dim, cfg.index_head_dim
    heads = cfg.n_heads // _shards("heads", cfg.n_heads, rules, sizes)
    iheads = cfg.index_n_heads // _shards("index_heads", cfg.index_n_heads, rules, sizes)
    vocab = cfg.vocab_size // _shards("vocab", cfg.vocab_size, rules, sizes)
    slots = W + min(cfg.index_topk, G)
    out = {
        "stream": n * cfg.hc_mult * cfg.dim * (2 + 3 * 4),
        "cache": seqs * (G * D * 6 + G * Di * 6 + (W + tokens_per_seq) * D * 2),
        "indexer": n * iheads * G * 6 + n * G * 4,
        "attention": n * slots * D * 4 + 2 * n * heads * slots * 4,
        "head": n * vocab * 4 + vocab * cfg.dim * 4,
    }
    # MoE: the step's token rows spread over every device, pairs sent to the expert owners
    n_ep = sizes.get("expert", 1) if "expert" in rules.get("expert", ()) else 1
    e_local = cfg.n_routed_experts // max(1, n_ep)
    k = cfg.n_activated_experts
    if n_ep > 1:
        rows_here = -(-total_tokens // n_dev)
        buf = n_ep * rows_here * min(k, e_local)
    else:
        buf = n * k
    out["moe"] = (3 * buf * cfg.dim * 2  # send, receive, return buffers (bf16)
                  + e_local * 3 * cfg.moe_inter_dim * cfg.dim * 2  # local experts dequantized (bf16)
                  + buf * cfg.moe_inter_dim * 4 * 3)  # up, gate, hidden (f32)
    if cfg.engram_layer_ids:
        cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        out["engram"] = n * (cols * cfg.engram_head_dim * 4 + cfg.dim * (cfg.hc_mult + 1) * 4)
    return out


def activation_estimate(cfg: ModelConfig, sizes: Mapping[str, int], preset, *, batch: int, chunk: int) -> dict:
    """{"decode": {...}, "prefill": {...}, "bytes": max of the two totals} for this device."""
    rules = get_rules(preset)
    seqs = -(-batch // _shards("batch", batch, rules, sizes))
    chunk = max(1, min(chunk, cfg.max_seq_len))
    decode = step_bytes(cfg, sizes, preset, seqs=seqs, tokens_per_seq=1, total_tokens=batch)
    prefill = step_bytes(cfg, sizes, preset, seqs=1, tokens_per_seq=chunk, total_tokens=chunk)
    return {"decode": decode, "prefill": prefill, "chunk": chunk,
            "bytes": max(sum(decode.values()), sum(prefill.values()))}
