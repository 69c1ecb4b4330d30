"""Collective latency + bandwidth terms over sibling cores and chips, by hand."""
import pytest

from perfmodel.cost.collectives import collective_time_s, steps
from perfmodel.spec.hardware import load_hardware


def test_steps_per_algorithm():
    assert steps("ring", "all_reduce", 16) == 30
    assert steps("tree", "all_reduce", 16) == 8
    assert steps("tree", "all_gather", 16) == 4
    assert steps("one_shot", "all_reduce", 16) == 2
    assert steps("ring", "all_reduce", 1) == 0


def test_tpu_all_reduce_over_16_chips_by_hand():
    hw = load_hardware("tpu-v7").with_efficiency(collective_latency_scale=1.0)
    m = 14336.0  # one token's hidden state in bf16
    chips = (hw.collective_base_latency_s + 8 * hw.link_latency_s + 2 * m * 15 / 16 / hw.link_bandwidth_bytes_per_s)
    cores = 2 * hw.intra_chip_latency_s + 2 * m * 0.5 / hw.intra_chip_bandwidth_bytes_per_s
    assert collective_time_s(hw, "all_reduce", m, 32) == pytest.approx(chips + cores)


def test_single_participant_is_free_and_latency_scales():
    hw = load_hardware("gb200")
    assert collective_time_s(hw, "all_reduce", 1e6, 1) == 0
    slow = hw.with_efficiency(collective_latency_scale=2.0)
    fast = hw.with_efficiency(collective_latency_scale=1.0)
    base = fast.collective_base_latency_s + 2 * fast.link_latency_s
    assert collective_time_s(slow, "all_reduce", 0.0, 16) - collective_time_s(fast, "all_reduce", 0.0, 16) \
        == pytest.approx(base)
