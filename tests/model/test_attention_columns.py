"""The attention index list in the reference's column order (exact mode's online softmax runs over
64-column blocks, so which entries share a block is part of its result).

The reference (`get_window_topk_idxs`, `Attention.forward`): a prefill from position 0 lists, per
query i, min(T, W) window columns (max(0, i - W + 1) + j, -1 past i), then the compressed columns;
a decode step lists the W ring slots oldest first, then the compressed columns.
"""
import jax.numpy as jnp
import numpy as np

from dsv41_jax.model.cache import oracle_column_order, window_indices
from dsv41_jax.model.dspark import _block_indices


def _reference_prefill(T, W, comp):
    """Positions (not our slots) of the reference's list: window part, then `comp` [T, K] (-1 empty)."""
    end = np.arange(T)[:, None]
    win = np.maximum(end - W + 1, 0) + np.arange(min(T, W))
    win = np.where(win > end, -1, win)
    return np.concatenate([win, comp], -1)


def test_prefill_from_zero_takes_the_reference_columns():
    W, K = 8, 3
    for T in (1, 5, 8, 13):
        rng = np.random.default_rng(T)
        comp = np.where(rng.random((T, K)) < 0.7, rng.integers(0, 20, (T, K)), -1)
        comp = np.sort(np.where(comp < 0, 99, comp), -1)
        comp = np.where(comp == 99, -1, comp)  # valid ascending, -1 last (as select_topk lists them)
        ours = jnp.concatenate([window_indices(jnp.array([0]), T, W),
                                jnp.where(comp >= 0, comp + 1000, -1)[None].astype(jnp.int32)], -1)
        got = np.asarray(oracle_column_order(ours, jnp.array([0]), T, W))[0]
        # our window slots at start 0 are W + position; compressed ones 1000 + group
        as_pos = np.where(got >= 1000, got - 1000, np.where(got >= 0, got - W, -1))
        want = _reference_prefill(T, W, comp)
        width = want.shape[-1]
        assert np.array_equal(as_pos[:, :width], want), T
        assert np.all(as_pos[:, width:] == -1)  # the rest of our fixed width is empty


def test_other_calls_keep_their_columns():
    W = 8
    for start, T in ((5, 1), (30, 1), (12, 4)):
        idx = jnp.concatenate([window_indices(jnp.array([start]), T, W), jnp.full((1, T, 2), 7, jnp.int32)], -1)
        assert np.array_equal(np.asarray(oracle_column_order(idx, jnp.array([start]), T, W)), np.asarray(idx))


def test_dspark_block_follows_the_ring_as_the_reference_lists_it():
    """`get_dspark_topk_idxs`: arange(min(W, start + 1)), then W + arange(block)."""
    W, bs = 8, 3
    for newest in (0, 2, 6, 7, 30):
        want = np.concatenate([np.arange(min(W, newest + 1)), W + np.arange(bs)])
        got = np.asarray(_block_indices(jnp.array([newest]), W, bs))[0]
        assert got.shape == (bs, W + bs)
        for row in got:
            assert np.array_equal(row[:want.size], want) and np.all(row[want.size:] == -1), newest
