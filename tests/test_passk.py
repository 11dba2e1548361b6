"""Unbiased pass@k (ALGORITHMS.md section 6) against exact integer binomials.

Reference: ``1 - C(n-c, k) / C(n, k)`` with ``math.comb`` and exact integer division
(correctly rounded), and a log-gamma form for a second opinion at large ``n``.
"""
import math

import numpy as np
import pytest

from openrlhf_div.eval import pass_at_k


def exact(n, c, k):
    """1 - C(n-c, k)/C(n, k) as a correctly rounded float (integer arithmetic)."""
    total = math.comb(n, k)
    return (total - math.comb(n - c, k)) / total  # math.comb is 0 when k > n - c


def via_lgamma(n, c, k):
    if n - c < k:
        return 1.0
    log_ratio = (math.lgamma(n - c + 1) - math.lgamma(n - c - k + 1)
                 - math.lgamma(n + 1) + math.lgamma(n - k + 1))
    return -math.expm1(log_ratio)


def test_all_small_cases_exactly():
    for n in range(1, 31):
        for c in range(0, n + 1):
            for k in range(1, n + 1):
                got = pass_at_k(n, c, k)
                assert isinstance(got, float)
                assert got == pytest.approx(exact(n, c, k), rel=1e-12, abs=1e-15), (n, c, k)


@pytest.mark.parametrize("n,c,k", [
    (1000, 1, 1), (1000, 1, 10), (1000, 3, 100), (1000, 999, 1), (1000, 500, 500),
    (4096, 7, 256), (10_000, 1, 1), (10_000, 2, 5000), (10_000, 9_990, 11),
    (100_000, 1, 1), (100_000, 1, 2), (100_000, 5, 100), (100_000, 100, 1000),
    (100_000, 50_000, 3), (100_000, 99_999, 1), (100_000, 10, 99_990), (100_000, 1, 100_000),
    (100_000, 0, 50_000), (100_000, 100_000, 1), (100_000, 3, 1_000),
])
def test_large_n_against_exact_binomials(n, c, k):
    got = pass_at_k(n, c, k)
    want = exact(n, c, k)
    assert got == pytest.approx(want, rel=1e-9, abs=1e-300), (n, c, k, got, want)
    # second opinion only: lgamma(1e5) ~ 1e6 leaves ~1e-10 absolute error in the log-ratio,
    # i.e. ~1e-5 relative error when pass@k is ~1e-5, hence the loose tolerance
    assert got == pytest.approx(via_lgamma(n, c, k), rel=1e-4, abs=1e-300)


def test_tiny_probabilities_keep_relative_precision():
    # one correct among 1e5, k = 1: exactly 1e-5; k = 2: 2e-5 (not rounded to 0 by 1 - (1 - x))
    assert pass_at_k(100_000, 1, 1) == pytest.approx(1e-5, rel=1e-12)
    assert pass_at_k(100_000, 1, 2) == pytest.approx(2e-5, rel=1e-12)
    assert pass_at_k(100_000, 0, 7) == 0.0


def test_random_cases():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 3000))
        c = int(rng.integers(0, n + 1))
        k = int(rng.integers(1, n + 1))
        assert pass_at_k(n, c, k) == pytest.approx(exact(n, c, k), rel=1e-10, abs=1e-300)


def test_arrays_broadcast():
    n = np.array([10, 20, 100])
    c = np.array([[0], [1], [5]])
    k = 3
    got = pass_at_k(n, c, k)
    assert isinstance(got, np.ndarray) and got.shape == (3, 3) and got.dtype == np.float64
    for i in range(3):
        for j in range(3):
            assert got[i, j] == pytest.approx(exact(int(n[j]), int(c[i, 0]), k), rel=1e-12, abs=1e-15)
    ks = pass_at_k(16, 4, np.arange(1, 17))
    assert ks.shape == (16,)
    assert ks.tolist() == pytest.approx([exact(16, 4, kk) for kk in range(1, 17)], rel=1e-12)
    assert np.all(np.diff(ks) >= 0)  # pass@k rises with k
    assert pass_at_k([8, 8], [2, 8], [1, 1]).tolist() == pytest.approx([0.25, 1.0])


@pytest.mark.parametrize("n,c,k", [
    (10, 11, 1),    # c > n
    (10, -1, 1),    # c < 0
    (10, 2, 0),     # k < 1
    (10, 2, 11),    # k > n
    (0, 0, 1),      # no samples
    (np.array([4, 4]), np.array([1, 5]), 2),  # one bad entry in an array
    (10, 2.5, 1),   # a fractional count
    (10.5, 2, 1),
    (10, 2, 1.5),
])
def test_bad_inputs_raise(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


def test_integral_floats_are_accepted():
    assert pass_at_k(8.0, 2.0, 1.0) == pytest.approx(0.25)
    assert pass_at_k(np.array([8.0]), 2, 1).tolist() == pytest.approx([0.25])
