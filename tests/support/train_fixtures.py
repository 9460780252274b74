"""Shared small configs and data for the training tests (kept tiny: compile time dominates)."""
from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from dsv41_jax.config import ModelConfig
from dsv41_jax.train import data as D

TOKENIZER = D.ByteTokenizer()


def micro_config(seq_len: int = 32, **overrides) -> ModelConfig:
    """Four layers with the V4.1 roles: SWA, Full r2 (+Engram), Full r1 (pool source, decoder
    start), Reindex r1 inside the pool."""
    base = dict(
        vocab_size=TOKENIZER.vocab_size, dim=64, moe_inter_dim=32, n_layers=4, n_heads=2, n_routed_experts=4,
        n_activated_experts=2, q_lora_rank=32, head_dim=32, rope_head_dim=16, o_groups=1, o_lora_rank=16,
        window_size=8, compress_ratios=(0, 2, 1, 1), kv_source_layers=(1, 2), index_source_layers=(1, 2, 3),
        candidate_source_layer=2, candidate_topk_blocks=3, candidate_block_size=4, index_topk=8, index_n_heads=2,
        index_head_dim=32, engram_layer_ids=(1,), engram_vocab_size=300, engram_n_heads=2, engram_head_dim=32,
        engram_compressed_vocab_size=D.engram_token_map(TOKENIZER)[1], max_seq_len=seq_len, max_batch_size=8,
    )
    base.update(overrides)
    return ModelConfig.tiny(**base)


# a fixed corpus of Python-looking text (independent of the installed Python's sources)
_LINES = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "import os\nimport sys\n\nprint(os.getcwd(), sys.argv)\n",
    "while True:\n    line = input()\n    if not line:\n        break\n",
    "numbers = [1, 2, 3, 4]\ntotal = sum(numbers)\n",
]


def corpus(n_docs: int = 200, seed: int = 0) -> list[D.Document]:
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n_docs):
        k = int(rng.integers(1, 4))
        text = "".join(_LINES[int(j)] for j in rng.integers(0, len(_LINES), k))
        docs.append(D.text_document(TOKENIZER, text))
    return docs


@functools.lru_cache(maxsize=None)
def packed_data(seq_len: int = 32, batch_size: int = 8, engram: bool = True) -> D.PackedData:
    cfg = micro_config(seq_len)
    rows = D.pack(corpus(), seq_len, D.alignment(cfg), TOKENIZER.pad_id)
    return D.PackedData(rows, batch_size, 0, D.engram_setup(cfg, TOKENIZER) if engram else None)


def device_batch(batch: dict) -> dict:
    return {k: jnp.asarray(v) for k, v in batch.items()}


def max_abs_diff(a, b) -> float:
    return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))
