"""An estimate of per-device activation bytes for one serving step (not a profile).

How: we add up the large tensors that are live at once in the widest layer (a ratio-1 Full
layer with compressor, indexer, candidate pool and Engram) plus the output head, for the
per-device share of the work, on the path the step takes. Sizes come from the config and the mesh:

  stream    residual stream and the f32 temporaries of the mHC mixes: n x hc x dim x (2 + 3*4)
  cache     XLA path: the layer's caches dequantized for attention/indexing (compressed KV and
            index keys in f32 + bf16, the window ring); kernel path: one copy of their stored bytes
            (the kernels' 32-bit word view, made per call)
  indexer   XLA path: per-head scores [n, index_heads_local, G] in bf16 and f32, and their fp32
            sum; kernel path: the summed scores only (the heads are summed in VMEM)
  attention XLA path: gathered KV rows [n, window+topk, head_dim] f32 and logits [n, heads_local,
            slots] f32 x2; kernel path: queries in and outputs out, bf16
  moe       EP buffers (send, receive, return: worst-case capacity), the hidden activations of the
            rows computed, and the expert weights dequantized outside a kernel (`_moe_bytes`)
  engram    looked-up rows and the wkv projection, f32
  head      logits [n, vocab_local] f32; a prefill chunk also the head weight cast to f32 (a
            decode step's dot takes the bf16 weight: XLA:TPU fuses the cast, as compiled)

Two steps are estimated and the larger is reported: a decode step (one token for each of
the device's sequences) and a prefill chunk (`chunk` tokens of one sequence). impl "xla" is the
XLA reference path (what `dsv41 plan` reports), "pallas" the kernel path (`dsv41 compile --impl
pallas` shows it beside the compiler's figure). The prefill figure stays an upper bound (XLA fuses
much of it); the decode figure follows the compiled decode step (docs/PERFORMANCE.md, "TPU compiles
on this CPU machine").
"""
from __future__ import annotations

import math
from collections.abc import Mapping

from dsv41_jax.config import ModelConfig
from dsv41_jax.layers.moe import GROUPED_ROWS
from sharding.rules import get_rules, resolve


def _shards(logical: str, dim: int, rules, sizes: Mapping[str, int]) -> int:
    spec = resolve((logical,), (dim,), rules, sizes).spec
    if not spec or spec[0] is None:
        return 1
    axes = (spec[0],) if isinstance(spec[0], str) else spec[0]
    return math.prod(sizes[a] for a in axes)


def step_bytes(cfg: ModelConfig, sizes: Mapping[str, int], preset, *, seqs: int, tokens_per_seq: int,
               total_tokens: int, impl: str = "xla") -> dict[str, int]:
    """Live bytes of one step in which this device attends for `seqs` sequences x `tokens_per_seq`
    tokens, out of `total_tokens` in the whole step (the MoE spreads those over all devices)."""
    if impl not in ("xla", "pallas"):
        raise ValueError(f"impl must be 'xla' or 'pallas', got {impl!r}")
    rules = get_rules(preset)
    n = seqs * tokens_per_seq
    G = cfg.max_seq_len  # ratio-1 source: one entry per token
    W, D, Di = cfg.window_size, cfg.head_dim, cfg.index_head_dim
    heads = cfg.n_heads // _shards("heads", cfg.n_heads, rules, sizes)
    iheads = cfg.index_n_heads // _shards("index_heads", cfg.index_n_heads, rules, sizes)
    vocab = cfg.vocab_size // _shards("vocab", cfg.vocab_size, rules, sizes)
    slots = W + min(cfg.index_topk, G)
    decode = tokens_per_seq == 1
    out = {"stream": n * cfg.hc_mult * cfg.dim * (2 + 3 * 4),
           "head": n * vocab * 4 + (0 if decode else vocab * cfg.dim * 4)}
    if impl == "xla":
        out["cache"] = seqs * (G * D * 6 + G * Di * 6 + (W + tokens_per_seq) * D * 2)
        out["indexer"] = n * iheads * G * 6 + n * G * 4
        out["attention"] = n * slots * D * 4 + 2 * n * heads * slots * 4
    else:  # stored rows: FP4 compressed KV + E4M3 scale per 16, FP4 index keys + E8M0 per 32, E4M3 window + E8M0 per 32
        out["cache"] = seqs * (G * (D // 2 + D // 16) + G * (Di // 2 + Di // 32) + (W + tokens_per_seq) * (D + D // 32))
        out["indexer"] = n * G * 4
        out["attention"] = 2 * n * heads * D * 2
    out["moe"] = _moe_bytes(cfg, sizes, rules, n=n, total_tokens=total_tokens, impl=impl)
    if cfg.engram_layer_ids:
        cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        out["engram"] = n * (cols * cfg.engram_head_dim * 4 + cfg.dim * (cfg.hc_mult + 1) * 4)
    return out


def _moe_bytes(cfg: ModelConfig, sizes: Mapping[str, int], rules, *, n: int, total_tokens: int, impl: str) -> int:
    """The routed experts' live bytes. The step's token rows spread over every device, (row, expert)
    pairs go to the experts' owners, whose receive buffers are sized for the worst case, but each
    owner computes only as many rows as the mesh has pairs (`sharding.moe_ep`). Expert weights:
    - kernel path: the FP4 kernel dequantizes tiles in VMEM; XLA:TPU copies one local stack's word
      view into the kernel's layout (w2's, [experts, dim, inter/8] words, whose minor dimension
      is not a multiple of 128 lanes: the parameter is laid out otherwise);
    - XLA path, up to `GROUPED_ROWS` routed rows (`Experts.per_row`): each computed row gathers its
      expert; its w1 and w3 are dequantized together, in f32 blocks of 32 values that XLA:TPU pads
      to a 128-lane tile (16 bytes a value), beside one matrix's codes unpacked to int32 and f32
      (8 bytes a value): 40 bytes per value of one matrix, as the compiled decode step holds them;
    - XLA path, more rows (`Experts.grouped`): the active local experts dequantized once, bf16."""
    n_dev = math.prod(sizes.values())
    n_ep = sizes.get("expert", 1) if "expert" in rules.get("expert", ()) else 1
    e_local = cfg.n_routed_experts // max(1, n_ep)
    k = cfg.n_activated_experts
    if n_ep > 1:
        buf = n_ep * -(-total_tokens // n_dev) * min(k, e_local)
        rows = min(buf, total_tokens * k)
    else:
        buf = rows = n * k
    matrix = cfg.moe_inter_dim * cfg.dim  # values of one expert matrix
    if impl == "pallas":
        weights = e_local * cfg.dim * -(-cfg.moe_inter_dim // 8 // 128) * 128 * 4
    elif total_tokens * k <= GROUPED_ROWS:
        weights = rows * matrix * 40
    else:
        weights = min(e_local, rows) * 3 * matrix * 2
    return 3 * buf * cfg.dim * 2 + weights + rows * cfg.moe_inter_dim * 4 * 3  # buffers (bf16), weights, up/gate/hidden (f32)


def activation_estimate(cfg: ModelConfig, sizes: Mapping[str, int], preset, *, batch: int, chunk: int,
                        impl: str = "xla") -> dict:
    """{"decode": {...}, "prefill": {...}, "bytes": max of the two totals} for this device."""
    rules = get_rules(preset)
    seqs = -(-batch // _shards("batch", batch, rules, sizes))
    chunk = max(1, min(chunk, cfg.max_seq_len))
    decode = step_bytes(cfg, sizes, preset, seqs=seqs, tokens_per_seq=1, total_tokens=batch, impl=impl)
    prefill = step_bytes(cfg, sizes, preset, seqs=1, tokens_per_seq=chunk, total_tokens=chunk, impl=impl)
    return {"decode": decode, "prefill": prefill, "chunk": chunk,
            "bytes": max(sum(decode.values()), sum(prefill.values()))}
