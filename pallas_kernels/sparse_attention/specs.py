"""Benchmark shapes for sparse sink attention (V4.1-Flash: docs/REFERENCE.md §1)."""
from __future__ import annotations

FLASH = {"heads": 64, "head_dim": 512, "window": 128, "topk": 512}
BATCHES = (1, 8, 64)
# context length in tokens: it sizes the compressed cache the index lists point into
# (ratio 1 at the decoder's KV source, the largest cache: one entry per token)
CONTEXTS = (4096, 131072, 1048576)
QUICK = {"heads": 4, "head_dim": 64, "window": 16, "topk": 32, "batches": (2,), "contexts": (256,)}


def cases(quick: bool = False):
    """(batch, context, heads, head_dim, window, topk) per benchmark case."""
    if quick:
        q = QUICK
        return [(b, c, q["heads"], q["head_dim"], q["window"], q["topk"]) for b in q["batches"] for c in q["contexts"]]
    f = FLASH
    return [(b, c, f["heads"], f["head_dim"], f["window"], f["topk"]) for b in BATCHES for c in CONTEXTS]
