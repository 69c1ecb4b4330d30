"""The multi-kernel engine: every op is its own kernel, run in order on one stream.

A kernel pays its launch, starts its weight loads when it starts (DMA latency + first tile =
pipeline fill) and computes the last tile after the loads end (drain); collectives are kernels
of their own; activations go through HBM. Nothing overlaps across a kernel boundary (one
CUDA-graph stream). Where the hardware file has XLA's own components (a TPU measured with
tpu_microbench.py), an op with weights is priced as XLA runs it there: a dot at XLA's measured rate
with its gap and no first-byte latency or fill (XLA copies a dot's weights into VMEM behind the ops
before it; `components.xla_dot_time`), a MoE layer's routed experts as XLA's loop over them, a trip
per expert (`components.xla_expert_time`), and an MLA layer's attention with the copies of its
latent cache XLA makes around the cache's update (`components.xla_cache_copy_time`).
"""
from __future__ import annotations

import numpy as np

from perfmodel.cost import components as cm
from perfmodel.engine.host import host_terms
from perfmodel.engine.terms import Timeline, call_s, collective_s, launch_s, op_compute_s, stream_terms
from perfmodel.graph.ops import OpGraph
from perfmodel.spec.hardware import Hardware
from perfmodel.util import limits


def fused_norms(g: OpGraph, hw: Hardware) -> np.ndarray:
    """Norm ops that follow an all-reduce on a GPU with a fitted all-reduce component: the
    measured kernel is all-reduce + RMSNorm fused (components.gpu_all_reduce_time)."""
    if not cm.is_gpu_model(hw.components) or len(g) < 2:
        return np.zeros(len(g), bool)
    after_ar = np.r_[False, g.is_collective[:-1] & (np.array(g.coll_kind[:-1]) == "all_reduce")]
    return after_ar & np.array([n.endswith("_norm") for n in g.name])


def simulate_multikernel(g: OpGraph, hw: Hardware, record: bool = False,
                         weights: np.ndarray | None = None, steps_per_call: int = 1) -> Timeline:
    limits.spend("layer_steps", int(g.layer[-1]) + 1 if len(g) else 0)
    bw, dma_lat, desc = stream_terms(hw, multikernel=True)
    comp, coll = op_compute_s(g, hw, weights), collective_s(g, hw)
    nbytes = g.bytes
    t_mem = nbytes / bw + np.where(nbytes > 0, desc * np.ceil(nbytes / hw.dma_tile_bytes), 0.0)
    host_launch = 0.0
    prefetched = np.zeros(len(g), bool)  # ops whose weights XLA copies in behind the ops before them
    if "xla_dot_fixed_s" in hw.components:   # XLA on a TPU, its dots and expert loop measured
        prefetched = (g.flops > 0) & (g.static_bytes + g.routed_bytes > 0) & ~g.is_collective
        experts = g.experts_read()
        for j in np.flatnonzero(prefetched):
            if g.routed_bytes[j] > 0:   # the routed experts: XLA's loop over them
                t_mem[j] = cm.xla_expert_time(hw.components, g.routed_bytes[j], g.tokens, experts[j])
            else:
                t_mem[j] = cm.xla_dot_time(hw.components, g.static_bytes[j])
            t_mem[j] += (nbytes[j] - g.static_bytes[j] - g.routed_bytes[j]) / bw
        for j in (j for j, name in enumerate(g.name) if name == "mla_attention" and g.kv_bytes[j] > 0):
            t_mem[j] += cm.xla_cache_copy_time(hw.components, g.cache_bytes.get(int(g.layer[j]), 0.0), hw.onchip_bytes)
    if cm.is_host_model(hw.components):  # XLA:CPU as the reference runs (hostbench components)
        t_mem, host_launch = host_terms(g, hw, t_mem, bw, weights)
    tile = np.minimum(nbytes, hw.dma_tile_bytes)
    first = tile / bw
    last = np.where(nbytes > 0, comp * tile / np.maximum(nbytes, 1.0), comp)
    core = np.where(prefetched, np.maximum(t_mem, comp), np.maximum(t_mem + last, first + comp))
    lat = np.where((nbytes > 0) & ~prefetched, dma_lat, 0.0)
    launch = np.where(prefetched & (g.routed_bytes == 0), 0.0, launch_s(hw))  # a dot's gap: in its time
    if len(g):
        launch[0] += call_s(hw) / steps_per_call
    launch = launch + host_launch
    coll_mask = g.is_collective
    dur = np.where(coll_mask, launch + coll, launch + lat + core)
    fused = fused_norms(g, hw)  # inside the all-reduce kernel before them: no kernel of their own
    launch, lat, core, comp, t_mem = (np.where(fused, 0.0, x) for x in (launch, lat, core, comp, t_mem))
    dur = np.where(fused, 0.0, dur)
    end = np.cumsum(dur)
    start = end - dur
    routed_share = np.where(nbytes > 0, g.routed_bytes / np.maximum(nbytes, 1.0), 0.0)
    stream = np.where(coll_mask, 0.0, np.maximum(0.0, t_mem - comp))
    busy = np.where(coll_mask, 0.0, comp)
    wait = {"launch": launch, "collective": np.where(coll_mask, coll, 0.0),
            "weight_streaming": stream * (1 - routed_share), "expert_fetch": stream * routed_share,
            "fill_drain": np.where(coll_mask, 0.0, lat + core - np.maximum(t_mem, comp))}
    tl = Timeline(start, end, wait | {"compute": busy}, float(end[-1]) if len(end) else 0.0,
                  float(nbytes.sum()))
    if record:
        for j in range(len(g)):
            lane = "link" if coll_mask[j] else "compute"
            tl.events.append((lane, g.name[j], int(g.layer[j]), start[j] + launch[j], end[j]))
            if nbytes[j] > 0 and not coll_mask[j]:
                tl.events.append(("dma", g.name[j], int(g.layer[j]), start[j] + launch[j] + lat[j],
                                  start[j] + launch[j] + lat[j] + t_mem[j]))
    return tl
