"""The per-op cost terms both engines compose: compute, collectives, the DMA stream, launches.

Where the hardware file has fitted components (perfmodel.cost.components), the terms come from
them. TPU: the DMA engine runs at the fitted stream bandwidth with a fixed cost per descriptor
and the fitted first-byte latency; matmuls cost the MXU's weight push (flat for few rows) plus a
per-dot issue; a collective is its phases of remote copies; the host dispatch is paid once per
device call. GPU: each kernel pays the CUDA-graph launch and streams at the achieved
decode-kernel bandwidth; all-reduces cost the fitted library time by ranks and payload. Without
components the spec-sheet terms (perfmodel.cost.collectives, `efficiency`) are used.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from perfmodel.cost import components as cm
from perfmodel.cost.collectives import collective_time_s
from perfmodel.graph.ops import OpGraph
from perfmodel.spec.hardware import Hardware


RECURRENCES = ("kda_recurrence", "gdn_recurrence", "mamba2_scan")  # state updates on the vector unit
CAUSES = ("compute", "weight_streaming", "expert_fetch", "collective", "launch", "fill_drain")


@dataclass(frozen=True)
class Sizing:
    """The megakernel's on-chip budget per core: a weight ring of `banks` DMA tiles beside `slots`
    expert buffers. An expert larger than the room beside the ring streams through the buffers
    in `tiles_per_expert` copies (1: copied whole)."""
    onchip_bytes: float
    tile_bytes: float
    banks: int
    depth_bytes: float        # the ring asked for (at least the whole tiles it holds)
    expert_bytes: float       # one routed expert's bytes on this device (0: no routed experts)
    slots: int
    tiles_per_expert: int
    fit: int                  # whole-expert buffers that fit beside the ring

    @property
    def ring_bytes(self) -> float:
        return self.banks * self.tile_bytes

    @property
    def need_bytes(self) -> float:
        """The ring and the expert buffers as asked (whole experts)."""
        return self.depth_bytes + self.slots * self.expert_bytes


@dataclass
class Timeline:
    """Per-op start/end on the compute unit, the wait before each op by cause, and lanes."""
    start_s: np.ndarray
    end_s: np.ndarray
    wait_s: dict[str, np.ndarray]         # per op, by cause (sums with compute to the step)
    step_s: float
    dma_bytes: float
    events: list[tuple[str, str, int, float, float]] = field(default_factory=list)  # lane, name, layer, t0, t1
    sizing: Sizing | None = None  # megakernel: its on-chip budget (ring, expert buffers)


def op_weights(g: OpGraph, routed_bytes_per_value: float = 0.5) -> np.ndarray:
    """Weights each matmul op pushes: static ops flops / (2 rows) (the head's rows: the sampled
    ones); routed ops their bytes / the routed format's bytes per value. Zero for ops without
    weights (norms, attention core)."""
    rows = float(max(g.tokens, 1))
    if g.head_rows is not None:  # the lm_head computes only the sampled rows
        rows = np.where(np.array(g.phase) == "head", max(g.head_rows, 1), rows)
    static = np.where(g.static_bytes > 0, g.flops / (2.0 * rows), 0.0)
    return np.where(g.routed_bytes > 0, g.routed_bytes / routed_bytes_per_value, static)


def op_feeds(g: OpGraph, hw: Hardware) -> tuple[list[str], list[int]]:
    """Per op: the operand dtype the matrix unit is fed and the LHS rows per batch row
    (Format.feed on the chip's matrix dtypes; ops without weights: their own dtype, 1)."""
    native, memo = cm.matrix_dtypes(hw), {}  # by identity: the graph's ops share a few format objects
    feeds = []
    for f, dt in zip(g.fmt or [None] * len(g), g.dtype):
        if f is None:
            feeds.append((dt, 1))
            continue
        if id(f) not in memo:
            memo[id(f)] = f.feed(native, hw.name)
        feeds.append(memo[id(f)])
    return [d for d, _ in feeds], [r for _, r in feeds]


def whole_batch_experts(g: OpGraph, hw: Hardware, megakernel: bool) -> bool:
    """Each routed expert's dots run over every row of the step: a `megakernel` whose [megakernel]
    expert_rows is "batch", on a TPU with fitted components (elsewhere a matmul's rows do not enter
    its cost), at a step of at most the MXU's row tile (components.mxu_row_tile)."""
    return (megakernel and g.recipe.expert_rows == "batch" and cm.is_tpu_model(hw.components)
            and g.tokens <= cm.param(hw.components, "mxu_row_tile"))


def tpu_matmuls(g: OpGraph, hw: Hardware, weights: np.ndarray | None = None, megakernel: bool = False,
                feeds: tuple[list[str], list[int]] | None = None) -> dict[int, tuple[float, bool]]:
    """Per matmul op on a TPU with fitted components: (seconds, dequantised). The MXU weight push
    (components.matmul_time: flat for few rows, the rows times a block-diagonal feed's rows per batch
    row; a routed op issues two dots per distinct expert, a streamed one the kernel's dots where the
    graph counts them, OpGraph.dots). Its rows are those routed to an expert,
    or every row of the step where the kernel runs each expert's dots over the whole batch and keeps
    its rows' results by mask (whole_batch_experts). A block-diagonal feed (more than one LHS row per
    batch row) costs at most the same matrices dequantised to bf16 on the vector unit first
    (components.dequant_matmul_time): a kernel takes the cheaper (Inferact's NVFP4 path switches to
    it at batch 8, its measured crossover: musespark/fp4.py DEQUANT_MIN_BATCH). A format a kernel
    decodes on the vector unit first (Format.decode, from a kernel plan) adds that decode
    (components.vpu_decode_time) and, for a routed op, its passes over each expert
    (Format.decode_passes, components.decode_pass_time). `feeds`: op_feeds."""
    dtype, scale_rows = feeds or op_feeds(g, hw)
    decode = [f.decode if f is not None else "" for f in (g.fmt or [None] * len(g))]
    w = op_weights(g) if weights is None else weights
    experts = max(1.0, math.ceil(g.distinct_experts))
    dots = np.where(g.routed_bytes > 0, 2.0 * experts, 1.0 if g.dots is None else g.dots).tolist()
    passes = [experts * f.decode_passes if f is not None and r > 0 else 0.0
              for f, r in zip(g.fmt or [None] * len(g), g.routed_bytes.tolist())]
    memo: dict[tuple, tuple[float, bool]] = {}  # ops of the same shape in every layer: each shape once
    flops, w_ = g.flops.tolist(), w.tolist()
    batch, routed = whole_batch_experts(g, hw, megakernel), (g.routed_bytes > 0).tolist()
    out = {}
    for j in np.flatnonzero((w > 0) & (g.flops > 0)).tolist():
        rows = g.tokens if batch and routed[j] else flops[j] / (2 * w_[j])
        key = (w_[j], dtype[j], rows, scale_rows[j], dots[j], decode[j], passes[j])
        if key not in memo:
            fed = cm.matmul_time(hw.components, w_[j], dtype[j], rows * scale_rows[j], dots[j])
            if decode[j]:   # the kernel decodes the codes on the vector unit before the dot, in passes
                fed += (cm.vpu_decode_time(hw.components, w_[j], decode[j])
                        + cm.decode_pass_time(hw.components, passes[j], decode[j]))
            dequant = cm.dequant_matmul_time(hw.components, w_[j], rows, dots[j]) if scale_rows[j] > 1 else np.inf
            memo[key] = (min(fed, dequant), dequant < fed)
        out[j] = memo[key]
    return out


def op_compute_s(g: OpGraph, hw: Hardware, weights: np.ndarray | None = None,
                 megakernel: bool = False) -> np.ndarray:
    """Per-op compute: the roofline of the peak rate (of the dtype the matrix unit is fed, op_feeds)
    x `efficiency.flops`; on a TPU with fitted components, matmuls cost the MXU weight push instead
    (tpu_matmuls), and in the megakernel a recurrent core's FLOPs run on the vector unit where the
    hardware file has its rate (components.recurrence_time)."""
    feeds = op_feeds(g, hw)
    dtype = feeds[0]
    eff, table = hw.efficiency.flops, {dt: hw.flops_rate(dt) for dt in set(dtype) if dt}
    rates = np.array([table[dt] if dt else 1.0 for dt in dtype])
    t = np.where(g.is_collective, 0.0, g.flops / (rates * eff))
    if cm.is_tpu_model(hw.components):
        for j, (secs, _) in tpu_matmuls(g, hw, weights, megakernel, feeds).items():
            t[j] = secs
        if megakernel and cm.recurrence_on_vpu(hw.components):
            for j in np.flatnonzero(np.isin(g.name, RECURRENCES)):
                t[j] = cm.recurrence_time(hw.components, float(g.flops[j]))
    return t


def collective_terms(g: OpGraph, hw: Hardware, megakernel: bool = False
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per op: collective seconds (the fitted component -- TPU in-kernel collectives, GPU
    all-reduce library -- where the hardware file has one, else the spec-sheet model of
    perfmodel.cost.collectives); with TPU components also its entry cost and its phases, which the
    megakernel puts on its DMA engine: op j's are ph_bytes / ph_time[ph_off[j]:ph_off[j + 1]]
    (remote-copy bytes, seconds). Returns (seconds, entry, ph_off, ph_bytes, ph_time). Each
    distinct (kind, payload, group) is computed once. In the `megakernel`, a TPU all-reduce runs
    the algorithm of the model's own kernel where it fixes one (g.kernel_all_reduce)."""
    c, scale, cores = hw.components, hw.efficiency.collective_latency_scale, hw.cores_per_chip
    tpu, fixed = cm.is_tpu_model(c), g.kernel_all_reduce if megakernel else ""
    memo: dict[tuple, tuple[float, float, list]] = {}

    def terms(k: str, m: float, p: int) -> tuple[float, float, list]:
        if tpu:
            alg = fixed if k == "all_reduce" and fixed else None
            t, _, phases = cm.collective_time(c, k, m, p, cores, alg, scale)
            k_ = min(cores, p)
            return t, scale * cm.param(c, "collective_call_s"), [(ph.dma_bytes, cm.phase_time(c, ph, p // k_, k_, scale))
                                                      for ph in phases]
        if cm.is_gpu_model(c):
            return cm.gpu_all_reduce_time(c, m, p, scale), 0.0, []
        return collective_time_s(hw, k, m, p), 0.0, []

    n = len(g)
    secs, call, count, flat = np.zeros(n), np.zeros(n), np.zeros(n + 1, np.int64), []
    kinds, payloads, groups = g.coll_kind, g.coll_bytes.tolist(), g.coll_group.tolist()
    for j in np.flatnonzero(g.is_collective).tolist():
        key = (kinds[j], payloads[j], int(groups[j]))
        if key not in memo:
            memo[key] = terms(*key)
        secs[j], call[j], phases = memo[key]
        count[j + 1] = len(phases)
        flat += phases
    ph = np.array(flat, float).reshape(-1, 2)
    return secs, call, np.cumsum(count), ph[:, 0].copy(), ph[:, 1].copy()


def collective_s(g: OpGraph, hw: Hardware) -> np.ndarray:
    """Per-op collective seconds (collective_terms)."""
    return collective_terms(g, hw)[0]


def stream_terms(hw: Hardware, multikernel: bool = False) -> tuple[float, float, float]:
    """(bandwidth, first-byte latency, per-descriptor cost) of one core's HBM -> on-chip copies:
    the fitted DMA component on a TPU, the achieved decode-kernel bandwidth of a multi-kernel
    engine on a GPU (the rate of components.kernel_stream_time), else the spec sheet x
    `efficiency.hbm`."""
    c, peak = hw.components, hw.core_hbm_bandwidth_bytes_per_s
    if cm.is_tpu_model(c):
        return tuple(cm.param(c, k) for k in ("dma_bandwidth_bytes_per_s", "dma_latency_s", "dma_descriptor_s"))
    if cm.is_gpu_model(c) and multikernel:
        return 1.0 / cm.kernel_stream_time(c, 1.0, peak), hw.dma_latency_s, 0.0
    return peak * hw.efficiency.hbm, hw.dma_latency_s, 0.0


def launch_s(hw: Hardware) -> float:
    """Per-kernel cost of a multi-kernel engine: the CUDA-graph launch component on a GPU."""
    c = hw.components
    return (cm.kernel_launch_time(c) if cm.is_gpu_model(c) else hw.launch_overhead_s) + hw.efficiency.op_overhead_s


def call_s(hw: Hardware) -> float:
    """Per device call: host dispatch where the hardware file has it. A call runs
    `Deployment.steps_per_call` decode steps, so each step pays this over that many."""
    return cm.device_call_time(hw.components) if "host_dispatch_s" in hw.components else 0.0
