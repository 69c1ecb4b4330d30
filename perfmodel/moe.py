"""Expert-routing statistics: how many experts a decode step touches, and on the busiest rank.

Uniform routing is the baseline (FACTS.md s.4): E[D] = E * (1 - (1 - k/E)^B). A skew > 0
makes expert i's selection weight proportional to (i + 1)^-skew (a Zipf law), a simple stand-in
for the measured imbalance of real routers; skew = 0 is uniform.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from .errors import require

MC_SAMPLES = 256
MC_SEED = 0


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
    """(E[max over groups of distinct experts in a group], E[max token-expert pairs in a group]).

    Experts are owned by `groups` expert-parallel groups in contiguous blocks. Seeded Monte Carlo
    over MC_SAMPLES steps; each token draws top_k distinct experts (Gumbel top-k on log weights).
    """
    require(experts % groups == 0, "ep", groups, f"must divide the number of experts ({experts})")
    rng = np.random.default_rng(MC_SEED)
    logw = -skew * np.log(np.arange(experts) + 1.0)
    per_group = experts // groups
    max_distinct, max_pairs = [], []
    chunk = max(1, 4_000_000 // max(1, tokens * experts))
    for start in range(0, MC_SAMPLES, chunk):
        n = min(chunk, MC_SAMPLES - start)
        keys = logw.astype(np.float32) - np.log(-np.log(
            rng.random((n, tokens, experts), dtype=np.float32) + np.float32(1e-30)))
        chosen = np.argpartition(-keys, top_k - 1, axis=-1)[..., :top_k]
        flat = (np.arange(n)[:, None, None] * experts + chosen).ravel()
        grouped = np.bincount(flat, minlength=n * experts).reshape(n, groups, per_group)
        max_distinct.append((grouped > 0).sum(-1).max(-1))
        max_pairs.append(grouped.sum(-1).max(-1))
    return float(np.concatenate(max_distinct).mean()), float(np.concatenate(max_pairs).mean())
