"""Expert-routing statistics against hand-computed values and a brute-force simulation."""
import numpy as np
import pytest

from perfmodel.graph.moe import expected_busiest_group, expected_distinct, selection_probabilities
from perfmodel.util.errors import SpecError


def test_occupancy_formula_hand_values():
    assert expected_distinct(896, 16, 1) == pytest.approx(16)
    assert expected_distinct(896, 16, 8) == pytest.approx(896 * (1 - (1 - 16 / 896) ** 8))
    assert expected_distinct(896, 16, 8) == pytest.approx(120.28, abs=0.01)  # docs/sources.md: "about 120"
    assert expected_distinct(4, 2, 100) == pytest.approx(4)


def test_skewed_selection_probabilities():
    q = selection_probabilities(16, 4, skew=2.0)
    assert q.sum() == pytest.approx(4) and q.max() <= 1 and np.all(np.diff(q) <= 1e-12)
    assert q[0] == 1.0  # capped, excess redistributed
    assert selection_probabilities(16, 4).tolist() == [0.25] * 16


def simulate(experts, top_k, tokens, groups, skew, samples=4000, seed=1):
    rng = np.random.default_rng(seed)
    logw = -skew * np.log(np.arange(experts) + 1.0)
    keys = logw + rng.gumbel(size=(samples, tokens, experts))
    chosen = np.argsort(-keys, axis=-1)[..., :top_k]
    counts = np.zeros((samples, experts))
    for s in range(samples):
        np.add.at(counts[s], chosen[s].ravel(), 1)
    g = counts.reshape(samples, groups, -1)
    return (g > 0).sum(-1).max(-1).mean(), (g > 0).sum(-1).mean()


@pytest.mark.parametrize("tokens,groups,skew", [(1, 8, 0.0), (8, 8, 0.0), (4, 16, 0.0), (8, 8, 0.7)])
def test_busiest_group_matches_simulation(tokens, groups, skew):
    est, _ = expected_busiest_group(128, 8, tokens, groups, skew)
    sim_max, sim_mean = simulate(128, 8, tokens, groups, skew)
    assert est == pytest.approx(sim_max, rel=0.05)
    assert est >= sim_mean  # the busiest rank, not the mean


@pytest.mark.parametrize("tokens,skew", [(1, 0.0), (8, 0.0), (64, 0.7)])
def test_one_group_is_the_expected_distinct_count(tokens, skew):
    """Without expert parallelism the busiest group is the only one: its distinct experts are the
    expected distinct count and it holds every token-expert pair."""
    distinct, pairs = expected_busiest_group(256, 8, tokens, 1, skew)
    assert distinct == pytest.approx(expected_distinct(256, 8, tokens, skew), rel=1e-12)
    assert pairs == tokens * 8


def test_busiest_group_needs_divisible_experts():
    with pytest.raises(SpecError, match="ep"):
        expected_busiest_group(10, 2, 1, 3)
