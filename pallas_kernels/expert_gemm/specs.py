"""Benchmark shapes for the expert GEMMs (V4.1-Flash, docs/REFERENCE.md §1 and §9)."""
from __future__ import annotations

FLASH = {"experts": 384, "top_k": 6, "dim": 5120, "inter": 2304}
BATCHES = (1, 8, 64)  # decode tokens; each routes to top_k experts
QUICK = {"experts": 8, "top_k": 2, "dim": 128, "inter": 64, "batches": (4,)}


def cases(quick: bool = False):
    """(tokens, experts, top_k, N, K) for the W1/W3 projection (N = inter, K = dim) per batch."""
    src = QUICK if quick else {**FLASH, "batches": BATCHES}
    return [(b, src["experts"], src["top_k"], src["inter"], src["dim"]) for b in src["batches"]]


def dense_cases(quick: bool = False):
    """(M, N, K) for the FP8 block GEMM: the attention's wq_b (1280 -> 64 x 512) per decode batch."""
    if quick:
        return [(4, 256, 128)]
    return [(b, 32768, 1280) for b in BATCHES]
