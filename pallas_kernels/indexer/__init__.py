"""The indexer: FP4 scores, the candidate pool and the top-k (docs/REFERENCE.md §3 "Indexer")."""
from pallas_kernels.indexer.api import candidate_pool, indexer_scores, topk_indices

__all__ = ["indexer_scores", "candidate_pool", "topk_indices"]
