"""Expert-routing statistics: how many experts a decode step touches, and on the busiest rank.

Uniform routing is the baseline (docs/sources.md s.4): E[D] = E * (1 - (1 - k/E)^B). A skew > 0
makes expert i's selection weight proportional to (i + 1)^-skew (a Zipf law), a simple stand-in
for the measured imbalance of real routers; skew = 0 is uniform.

Rows of a batch may also route alike (a benchmark that repeats one prompt). With correlation
rho, the first row picks its top-k and every other row copies that choice with probability rho,
else picks independently. Expert i is then touched with
    p_i = q_i + (1 - q_i) * (1 - (1 - (1 - rho) q_i)^(T - 1)),
the independent rows being Binomial(T - 1, 1 - rho) (its generating function gives the power).
rho = 0 is the independent case 1 - (1 - q_i)^T; rho = 1 (`identical`) gives sum p_i = top_k
distinct experts at any batch.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from perfmodel.util.errors import require

def selection_probabilities(experts: int, top_k: int, skew: float = 0.0) -> np.ndarray:
    """P(expert i is among one token's top-k); sums to top_k, each <= 1."""
    require(skew >= 0, "routing_skew", skew, "must be >= 0")
    w = (np.arange(experts) + 1.0) ** -skew
    q = np.zeros(experts)
    free = np.ones(experts, bool)
    budget = float(top_k)
    while True:  # scale to the budget, capping at 1 and redistributing the excess
        q[free] = w[free] * budget / w[free].sum()
        over = free & (q > 1)
        if not over.any():
            return q
        q[over], free[over] = 1.0, False
        budget = top_k - q[~free].sum()


def touched_probabilities(experts: int, top_k: int, tokens: int, skew: float = 0.0,
                          correlation: float = 0.0) -> np.ndarray:
    """P(expert i is selected by at least one of `tokens` rows), rows correlated by `correlation`."""
    require(0 <= correlation <= 1, "routing_correlation", correlation, "must be in [0, 1]")
    q = selection_probabilities(experts, top_k, skew)
    if tokens < 1:
        return np.zeros(experts)
    return q + (1 - q) * (1 - (1 - (1 - correlation) * q) ** (tokens - 1))


def expected_distinct(experts: int, top_k: int, tokens: int, skew: float = 0.0,
                      correlation: float = 0.0) -> float:
    """Expected number of distinct experts selected by `tokens` rows."""
    return float(np.sum(touched_probabilities(experts, top_k, tokens, skew, correlation)))


@lru_cache(maxsize=4096)
def expected_busiest_group(experts: int, top_k: int, tokens: int, groups: int,
                           skew: float = 0.0, correlation: float = 0.0) -> tuple[float, float]:
    """(E[max over groups of distinct experts in a group], E[token-expert pairs on that group]).

    Experts are owned by `groups` expert-parallel groups in contiguous blocks (so a skew puts the
    popular experts together, the worst case). Expert i is touched with p_i (above); a
    group's count is Poisson-binomial, treating experts as independent (the small negative
    correlation of top-k without replacement is ignored: tests bound the error against a
    simulation), and E[max] = sum_x (1 - prod_g P(X_g <= x)). Smooth in skew, so it can be fitted.
    """
    require(experts % groups == 0, "ep", groups, f"must divide the number of experts ({experts})")
    touched = touched_probabilities(experts, top_k, tokens, skew, correlation).reshape(groups, experts // groups)
    if groups == 1:  # the busiest group is the only one: E[max] is its mean count (no distribution needed)
        return float(touched.sum()), float(tokens * top_k)
    pmf = np.zeros((groups, experts // groups + 1))
    pmf[:, 0] = 1.0
    for j in range(touched.shape[1]):
        p = touched[:, j:j + 1]
        pmf[:, 1:] = pmf[:, 1:] * (1 - p) + pmf[:, :-1] * p
        pmf[:, 0] *= 1 - p[:, 0]
    cdf_all = np.prod(np.cumsum(pmf, axis=1), axis=0)
    max_distinct = float(np.sum(1 - np.clip(cdf_all, 0, 1)))
    mean_distinct = float(touched.sum()) / groups
    pairs = tokens * top_k / groups * max_distinct / mean_distinct if mean_distinct else 0.0
    return max_distinct, pairs
