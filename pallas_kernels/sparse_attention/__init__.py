"""Sparse sink attention over the FP8 window and the FP4 compressed cache (docs/REFERENCE.md §3 "Attention")."""
from pallas_kernels.sparse_attention.api import sparse_sink_attention, sparse_sink_attention_values

__all__ = ["sparse_sink_attention", "sparse_sink_attention_values"]
