"""Unbiased pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code").

pass@k = 1 - C(n-c, k) / C(n, k): the chance that at least one of k samples drawn without
replacement from n samples (c of them correct) is correct. The binomials overflow for the
n used in practice, so the ratio is evaluated as a product of terms in (0, 1].
"""
from __future__ import annotations

import math


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from ``n`` samples of which ``c`` are correct."""
    if not (isinstance(n, int) and isinstance(c, int) and isinstance(k, int)):
        raise TypeError(f"pass_at_k needs ints, got n={n!r} c={c!r} k={k!r}")
    if k < 1:
        raise ValueError(f"pass_at_k: k must be >= 1, got k={k}")
    if n < k:
        raise ValueError(f"pass_at_k: need n >= k samples, got n={n} k={k}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got c={c} n={n}")
    if n - c < k:
        return 1.0  # every k-subset contains a correct sample
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i); summing logs keeps it stable.
    log_all_wrong = math.fsum(math.log1p(-k / i) for i in range(n - c + 1, n + 1))
    return 1.0 - math.exp(log_all_wrong)
