"""Expert-routing statistics: how many experts a decode step touches, and on the busiest rank.

Uniform routing is the baseline (docs/sources.md s.4): E[D] = E * (1 - (1 - k/E)^B). A skew > 0
makes expert i's selection weight proportional to (i + 1)^-skew (a Zipf law), a simple stand-in
for the measured imbalance of real routers; skew = 0 is uniform.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from .errors import require

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


def expected_distinct(experts: int, top_k: int, tokens: int, skew: float = 0.0) -> float:
    """Expected number of distinct experts selected by `tokens` independent tokens."""
    q = selection_probabilities(experts, top_k, skew)
    return float(np.sum(1 - (1 - q) ** tokens))


@lru_cache(maxsize=4096)
def expected_busiest_group(experts: int, top_k: int, tokens: int, groups: int,
                           skew: float = 0.0) -> tuple[float, float]:
    """(E[max over groups of distinct experts in a group], E[token-expert pairs on that group]).

    Experts are owned by `groups` expert-parallel groups in contiguous blocks (so a skew puts the
    popular experts together, the worst case). Expert i is touched with p_i = 1 - (1 - q_i)^T; a
    group's count is Poisson-binomial, treating experts as independent (the small negative
    correlation of top-k without replacement is ignored: tests bound the error against a
    simulation), and E[max] = sum_x (1 - prod_g P(X_g <= x)). Smooth in skew, so it can be fitted.
    """
    require(experts % groups == 0, "ep", groups, f"must divide the number of experts ({experts})")
    q = selection_probabilities(experts, top_k, skew)
    touched = (1 - (1 - q) ** tokens).reshape(groups, experts // groups)
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
