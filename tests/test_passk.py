from fractions import Fraction
from math import comb

import pytest

from tasks.passk import pass_at_k


def exact_pass_at_k(n: int, c: int, k: int) -> Fraction:
    return 1 - Fraction(comb(n - c, k), comb(n, k))


@pytest.mark.parametrize("n,c,k", [(n, c, k) for n in (1, 2, 5, 10, 16, 40) for c in range(0, n + 1, max(1, n // 5))
                                   for k in (1, 2, 5, 10) if k <= n])
def test_matches_exact_binomial_formula(n, c, k):
    assert pass_at_k(n, c, k) == pytest.approx(float(exact_pass_at_k(n, c, k)), abs=1e-12)


def test_edges_and_pass_at_1_is_the_sample_mean():
    assert pass_at_k(10, 0, 10) == 0.0
    assert pass_at_k(10, 10, 1) == 1.0
    assert pass_at_k(10, 1, 10) == 1.0  # every 10-subset of 10 holds the one correct sample
    assert pass_at_k(20, 7, 1) == pytest.approx(7 / 20)


def test_stable_for_large_n_where_binomials_overflow_floats():
    # C(5000, 2500) has ~1500 digits: a naive float ratio would be inf/inf.
    value = pass_at_k(5000, 3, 2500)
    assert value == pytest.approx(float(exact_pass_at_k(5000, 3, 2500)), rel=1e-9)
    assert 0.0 < pass_at_k(100_000, 1, 1) < 1e-4


def test_monotone_in_correct_count_and_k():
    values = [pass_at_k(16, c, 10) for c in range(17)]
    assert values == sorted(values)
    assert [pass_at_k(16, 3, k) for k in range(1, 17)] == sorted(pass_at_k(16, 3, k) for k in range(1, 17))


@pytest.mark.parametrize("n,c,k,error", [(5, 1, 6, ValueError), (5, 6, 1, ValueError), (5, -1, 1, ValueError),
                                         (5, 1, 0, ValueError), (5.0, 1, 1, TypeError)])
def test_rejects_bad_arguments(n, c, k, error):
    with pytest.raises(error):
        pass_at_k(n, c, k)
