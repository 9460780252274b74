"""golden/fast_report.py's judgment of a fast-mode decision that differs from the oracle's: a near-tie
only when the exact margin at the selection boundary is within twice the row's score error."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from dsv41_jax.golden.fast_report import near_ties


def _brute_margin(row, k):
    """The smallest exact-score gap that separates the chosen k from any unchosen candidate."""
    finite = [float(x) for x in row if np.isfinite(x)]
    if len(finite) <= k:
        return np.inf
    best = None
    for chosen in itertools.combinations(range(len(finite)), k):
        gap = min(finite[i] for i in chosen) - max(finite[j] for j in range(len(finite)) if j not in chosen)
        best = gap if best is None else max(best, gap)
    return best


@pytest.mark.parametrize("seed", range(4))
def test_boundary_margin_equals_the_brute_force_one(seed):
    rng = np.random.default_rng(seed)
    exact = rng.normal(size=(6, 7))
    exact[0, :3] = -np.inf  # masked candidates compete with nothing
    exact[1, :5] = -np.inf  # fewer finite candidates than k: nothing to lose
    margin, _, _ = near_ties(exact, exact, 3)
    want = [_brute_margin(r, 3) for r in exact]
    np.testing.assert_allclose(margin, want)
    assert np.isinf(margin[1])


def test_a_swap_is_a_near_tie_only_within_twice_the_score_error():
    exact = np.array([[1.0, 0.9, 0.5, 0.499], [1.0, 0.9, 0.5, 0.3]])
    fast = exact + np.array([[0, 0, -0.001, 0.001], [0, 0, -0.001, 0.001]])
    margin, err, tie = near_ties(exact, fast, 3)
    np.testing.assert_allclose(margin, [0.001, 0.2])
    np.testing.assert_allclose(err, [0.001, 0.001])
    assert tie.tolist() == [True, False]  # a flip in the second row would be a defect, not numerics
