"""Collective time over the real topology: sibling cores of one chip, then chips over the link.

time = latency + bytes term, where
  latency = scale * (base + steps(algorithm, chips) * link_latency [+ 2 intra-chip hops])
  bytes   = ring-optimal traffic per participant / bandwidth.
Small decode messages (kilobytes) make the latency term dominate; that is the point.
"""
from __future__ import annotations

import math

from perfmodel.spec.hardware import Hardware

def steps(algorithm: str, kind: str, chips: int) -> int:
    """Sequential link steps of a collective among `chips` participants."""
    if chips <= 1:
        return 0
    passes = 2 if kind == "all_reduce" else 1  # reduce-scatter + all-gather
    if algorithm == "ring":
        return passes * (chips - 1)
    if algorithm == "tree":
        return passes * math.ceil(math.log2(chips))
    return 2  # one_shot: write to every peer, then one barrier


def collective_time_s(hw: Hardware, kind: str, message_bytes: float, participants: int) -> float:
    """Time of one collective of `message_bytes` (the full per-device result) among `participants`."""
    if participants <= 1:
        return 0.0
    cores = min(participants, hw.cores_per_chip)
    chips = math.ceil(participants / cores)
    scale = hw.efficiency.collective_latency_scale
    latency = hw.collective_base_latency_s + steps(hw.collective_algorithm, kind, chips) * hw.link_latency_s
    traffic = (2 if kind == "all_reduce" else 1) * message_bytes
    t = scale * latency
    if chips > 1:
        t += traffic * (chips - 1) / chips / hw.link_bandwidth_bytes_per_s
    if cores > 1:  # combine across sibling cores first, over the on-chip path
        t += scale * 2 * hw.intra_chip_latency_s + traffic * (cores - 1) / cores / hw.intra_chip_bandwidth_bytes_per_s
    return t
