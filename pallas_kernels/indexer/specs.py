"""Benchmark shapes for the indexer (V4.1-Flash: 32 heads x 128 dims, docs/REFERENCE.md §1)."""
from __future__ import annotations

FLASH = {"heads": 32, "head_dim": 128}
BATCHES = (1, 8, 64)
# tokens of context; the decoder's KV source has ratio 1, so G = context entries are scored
CONTEXTS = (4096, 131072, 1048576)
QUICK = {"heads": 4, "head_dim": 64, "batches": (2,), "contexts": (256,)}


def cases(quick: bool = False):
    """(batch, keys G, heads, head_dim) per decode benchmark case (one query per sequence)."""
    src = QUICK if quick else {**FLASH, "batches": BATCHES, "contexts": CONTEXTS}
    return [(b, c, src["heads"], src["head_dim"]) for b in src["batches"] for c in src["contexts"]]
