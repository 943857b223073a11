"""Welford's (n, mean, M2) against numpy, where the naive sum-of-squares formula fails."""

import numpy as np
import pytest

import flashfold as ff
from flashfold.monoids import WELFORD


def data(n=10_000, seed=0):
    return 1e9 + np.random.default_rng(seed).normal(0.0, 1.0, size=n)


@pytest.mark.parametrize("ddof", [0, 1])
@pytest.mark.parametrize("schedule", ["sequential", "tree", "reversed", "shuffled"])
def test_welford_matches_numpy_on_large_mean_small_variance(ddof, schedule):
    x = data()
    mean, var = ff.finalize(WELFORD, ff.fold(WELFORD, x, schedule, blocks=[3000, 1, 0, 6999]),
                            correction=ddof)
    assert mean == pytest.approx(np.mean(x), rel=1e-15)
    assert var == pytest.approx(np.var(x, ddof=ddof), rel=1e-6)


def test_naive_sum_of_squares_fails_on_the_same_data():
    x = data()
    naive = np.mean(x * x) - np.mean(x) ** 2      # E[x^2] - mean^2: cancels ~1e18 to ~1
    ref = np.var(x)
    assert abs(naive - ref) / ref > 1.0           # the naive formula is off by > 100%
    _, var = ff.finalize(WELFORD, ff.fold(WELFORD, x, "tree"))
    assert abs(var - ref) / ref < 1e-6


def test_welford_edge_cases():
    mean, var = ff.finalize(WELFORD, ff.fold(WELFORD, np.array([5.0])), correction=0)
    assert (mean, var) == (5.0, 0.0)
    _, var1 = ff.finalize(WELFORD, ff.fold(WELFORD, np.array([5.0])), correction=1)
    with pytest.warns(RuntimeWarning, match="Degrees of freedom"):
        ref = np.var(np.array([5.0]), ddof=1)
    assert np.isnan(var1) and np.isnan(ref)        # n <= correction: undefined, as numpy
    with pytest.raises(TypeError, match="unknown parameters"):
        ff.finalize(WELFORD, ff.fold(WELFORD, np.ones(3)), ddof=1)
