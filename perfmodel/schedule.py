"""One decode step simulated as a timeline on the DMA engine, the compute unit and the link.

Engines (DESIGN.md "Engines"):
- multikernel: every op is its own kernel, run in order on one stream; a kernel pays its launch,
  starts its weight loads when it starts (DMA latency + first tile = pipeline fill) and computes
  the last tile after the loads end (drain); collectives are kernels of their own; activations
  go through HBM. Nothing overlaps across a kernel boundary (one CUDA-graph stream).
- megakernel: one program. Static weights stream through a ring of `banks` on-chip tiles in
  program order, a tile being issued when the tile `banks` earlier has been consumed, so loads
  run ahead through collectives, routing and layer boundaries. KV cache / state copies are issued
  at layer start. Routed experts are issued only after that layer's router, into `slots` expert
  buffers. Activations stay on chip.
The DMA engine serves outstanding copies first-in-first-out or shares its bandwidth equally
among all outstanding copies (round-robin), as the chip preset says (`dma_sharing`).

Where the hardware file has fitted components (perfmodel.components), the terms come from them:
TPU: the DMA engine runs at the fitted stream bandwidth with a fixed cost per descriptor and the
fitted first-byte latency; matmuls cost the MXU's weight push (flat for few rows) plus a per-dot
issue; a collective is its phases of remote copies, and on the megakernel each phase's bytes go
through the same DMA engine as the weight stream and the experts (they queue and share
bandwidth); the host dispatch is paid once per device call (one per step). GPU: each kernel
pays the CUDA-graph launch and streams at the achieved decode-kernel bandwidth; all-reduces
cost the fitted library time by ranks and payload. Without components the spec-sheet terms
(perfmodel.collectives, `efficiency`) are used.
"""
from __future__ import annotations

import bisect
import heapq
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from . import components as cm
from .collectives import collective_time_s
from .deployment import Deployment
from .dmaplan import Copy
from .errors import SpecError
from .hardware import Hardware
from .ops import OpGraph

CAUSES = ("compute", "weight_streaming", "expert_fetch", "collective", "launch", "fill_drain")


class DmaEngine:
    """HBM -> on-chip copies; a copy starts `latency` after issue and then needs bytes/bandwidth.

    FIFO: copies are served one after another in issue order. Shared: every started copy gets
    bandwidth / (number of started copies), tracked with a virtual clock V (bytes served to each
    active copy) so that each arrival or completion costs O(log n).
    """

    def __init__(self, bandwidth: float, latency: float, shared: bool, record: bool = False,
                 descriptor_s: float = 0.0):
        self.bw, self.lat, self.shared, self.record = bandwidth, latency, shared, record
        self.extra = descriptor_s * bandwidth  # a descriptor's fixed cost, as engine bytes
        self.t = 0.0        # engine clock
        self.v = 0.0        # shared mode: virtual service per active copy
        self.pending: deque[tuple[float, int, float]] = deque()  # (arrival, id, bytes)
        self.heap: list[tuple[float, int]] = []                   # (finish V, id)
        self.done: dict[int, float] = {}
        self.n = 0
        self.begin: dict[int, float] = {}          # when recording: start of service
        self.labels: list[tuple[str, int]] = []    # when recording: (name, layer) per copy
        self.busy_bytes = 0.0

    def issue(self, t: float, nbytes: float, label: tuple[str, int] | None = None,
              remote: bool = False) -> int:
        """A copy issued at `t`. A remote copy (VMEM to another core, a collective's) reads no
        HBM and pays its phase's round instead of the HBM first-byte latency."""
        cid = self.n
        self.n += 1
        if not remote:
            self.busy_bytes += nbytes
        start = t + (0.0 if remote else self.lat)
        if nbytes > 0:
            nbytes += self.extra
        if nbytes <= 0:
            self.done[cid] = t
        elif self.shared:
            self.pending.append((start, cid, nbytes))
        else:  # FIFO has a closed form: start when the engine frees
            start = max(self.t, start)
            self.t = start + nbytes / self.bw
            self.done[cid] = self.t
        if self.record:
            self.begin[cid] = start
            self.labels.append(label)
        return cid

    def lane_events(self) -> list[tuple[str, str, int, float, float]]:
        """Every copy as a DMA-lane event from its start of service (completing any in flight)."""
        return [("dma", name, layer, self.begin[i], self.completion(i))
                for i, (name, layer) in enumerate(self.labels)]

    def completion(self, cid: int) -> float:
        """Serve copies (with the arrivals known now) until copy `cid` is complete."""
        done = self.done
        if cid in done:
            return done[cid]
        heap, pending, bw, t, v = self.heap, self.pending, self.bw, self.t, self.v
        while cid not in done:
            n = len(heap)
            t_next = t + (heap[0][0] - v) * n / bw if n else math.inf
            if pending and pending[0][0] <= t_next:
                arrival, i, b = pending.popleft()
                if arrival > t:
                    if n:
                        v += (arrival - t) * bw / n
                    t = arrival
                heapq.heappush(heap, (v + b, i))
            else:
                v, i = heapq.heappop(heap)
                t = t_next
                done[i] = t
        self.t, self.v = t, v
        return done[cid]


@dataclass
class Timeline:
    """Per-op start/end on the compute unit, the wait before each op by cause, and lanes."""
    start_s: np.ndarray
    end_s: np.ndarray
    wait_s: dict[str, np.ndarray]         # per op, by cause (sums with compute to the step)
    step_s: float
    dma_bytes: float
    events: list[tuple[str, str, int, float, float]] = field(default_factory=list)  # lane, name, layer, t0, t1
    expert_tiles: int = 1  # megakernel: copies each routed expert streams through its buffer in


def op_weights(g: OpGraph, routed_bytes_per_value: float = 0.5) -> np.ndarray:
    """Weights each matmul op pushes: static ops flops / (2 rows); routed ops their bytes / the
    routed format's bytes per value. Zero for ops without weights (norms, attention core)."""
    static = np.where(g.static_bytes > 0, g.flops / (2.0 * max(g.tokens, 1)), 0.0)
    return np.where(g.routed_bytes > 0, g.routed_bytes / routed_bytes_per_value, static)


def op_compute_s(g: OpGraph, hw: Hardware, weights: np.ndarray | None = None) -> np.ndarray:
    """Per-op compute: the roofline of the peak rate x `efficiency.flops`; on a TPU with fitted
    components, matmuls instead cost the MXU weight push (components.matmul_time: flat for few
    rows; a routed op issues two dots per distinct expert)."""
    eff, table = hw.efficiency.flops, {dt: hw.flops_rate(dt) for dt in set(g.dtype) if dt}
    rates = np.array([table[dt] if dt else 1.0 for dt in g.dtype])
    t = np.where(g.is_collective, 0.0, g.flops / (rates * eff))
    experts = max(1.0, math.ceil(g.distinct_experts))
    if cm.is_tpu_model(hw.components):
        w = op_weights(g) if weights is None else weights
        dots = np.where(g.routed_bytes > 0, 2.0 * experts, 1.0)
        for j in np.flatnonzero((w > 0) & (g.flops > 0)):
            t[j] = cm.matmul_time(hw.components, w[j], g.dtype[j], g.flops[j] / (2 * w[j]), dots[j])
    return t + np.where(g.routed_bytes > 0, experts * hw.efficiency.expert_overhead_s, 0.0)


def collective_s(g: OpGraph, hw: Hardware) -> np.ndarray:
    """Per-op collective time: the fitted component (TPU in-kernel collectives, GPU all-reduce
    library) where the hardware file has one, else the spec-sheet model (perfmodel.collectives)."""
    c, scale = hw.components, hw.efficiency.collective_latency_scale
    if cm.is_tpu_model(c):
        f = lambda k, b, p: cm.collective_time(c, k, b, p, hw.cores_per_chip, scale=scale)[0]
    elif cm.is_gpu_model(c):
        f = lambda k, b, p: cm.gpu_all_reduce_time(c, b, p, scale)
    else:
        f = lambda k, b, p: collective_time_s(hw, k, b, p)
    return np.array([f(k, b, p) if c_ else 0.0
                     for c_, k, b, p in zip(g.is_collective, g.coll_kind, g.coll_bytes, g.coll_group)])


def stream_terms(hw: Hardware, multikernel: bool = False) -> tuple[float, float, float]:
    """(bandwidth, first-byte latency, per-descriptor cost) of one core's HBM -> on-chip copies:
    the fitted DMA component on a TPU, the achieved decode-kernel bandwidth of a multi-kernel
    engine on a GPU, else the spec sheet x `efficiency.hbm`."""
    c, peak = hw.components, hw.core_hbm_bandwidth_bytes_per_s
    if cm.is_tpu_model(c):
        return c["dma_bandwidth_bytes_per_s"], c["dma_latency_s"], c["dma_descriptor_s"]
    if cm.is_gpu_model(c) and multikernel:
        return peak * c["kernel_bandwidth_efficiency"], hw.dma_latency_s, 0.0
    return peak * hw.efficiency.hbm, hw.dma_latency_s, 0.0


def launch_s(hw: Hardware) -> float:
    """Per-kernel cost of a multi-kernel engine: the CUDA-graph launch component on a GPU."""
    c = hw.components
    return (c["kernel_launch_s"] if cm.is_gpu_model(c) else hw.launch_overhead_s) + hw.efficiency.op_overhead_s


def call_s(hw: Hardware) -> float:
    """Per device call (one per step): host dispatch where the hardware file has it."""
    return cm.device_call_time(hw.components) if "host_dispatch_s" in hw.components else 0.0


def fused_norms(g: OpGraph, hw: Hardware) -> np.ndarray:
    """Norm ops that follow an all-reduce on a GPU with a fitted all-reduce component: the
    measured kernel is all-reduce + RMSNorm fused (components.gpu_all_reduce_time)."""
    if not cm.is_gpu_model(hw.components) or len(g) < 2:
        return np.zeros(len(g), bool)
    after_ar = np.r_[False, g.is_collective[:-1] & (np.array(g.coll_kind[:-1]) == "all_reduce")]
    return after_ar & np.array([n.endswith("_norm") for n in g.name])


def simulate_multikernel(g: OpGraph, hw: Hardware, record: bool = False,
                         weights: np.ndarray | None = None) -> Timeline:
    bw, dma_lat, desc = stream_terms(hw, multikernel=True)
    comp, coll = op_compute_s(g, hw, weights), collective_s(g, hw)
    nbytes = g.bytes
    t_mem = nbytes / bw + np.where(nbytes > 0, desc * np.ceil(nbytes / hw.dma_tile_bytes), 0.0)
    if cm.is_host_model(hw.components):  # XLA:CPU dots: achieved bandwidth by rows (hostbench)
        w = op_weights(g) if weights is None else weights
        for j in np.flatnonzero((w > 0) & (g.flops > 0)):
            rows = g.flops[j] / (2 * w[j])
            t_mem[j] = (cm.host_dot_time(hw.components, g.static_bytes[j] + g.routed_bytes[j], rows)
                        + (g.kv_bytes[j] + g.act_bytes[j]) / bw)
    tile = np.minimum(nbytes, hw.dma_tile_bytes)
    first = tile / bw
    last = np.where(nbytes > 0, comp * tile / np.maximum(nbytes, 1.0), comp)
    core = np.maximum(t_mem + last, first + comp)
    lat = np.where(nbytes > 0, dma_lat, 0.0)
    launch = np.full(len(g), launch_s(hw))
    if len(g):
        launch[0] += call_s(hw)
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


def ring_banks(hw: Hardware, prefetch_bytes: float | None) -> int:
    """Ring depth in tiles; by default half the on-chip buffer (the rest holds experts, KV, activations)."""
    depth = prefetch_bytes if prefetch_bytes is not None else hw.onchip_bytes / 2
    banks = max(1, int(depth // hw.dma_tile_bytes))
    if max(depth, banks * hw.dma_tile_bytes) > hw.onchip_bytes:
        need = max(depth, banks * hw.dma_tile_bytes)
        raise SpecError("prefetch_bytes", depth, f"a ring of {banks} x {hw.dma_tile_bytes} B tiles exceeds the "
                        f"{hw.onchip_kind} of {hw.name} ({hw.onchip_bytes:.0f} B per core) by "
                        f"{need - hw.onchip_bytes:.0f} B; at most "
                        f"{hw.onchip_bytes // hw.dma_tile_bytes * hw.dma_tile_bytes / 2**20:.4g} MiB fits")
    return banks


def expert_slots(g: OpGraph, hw: Hardware, d: Deployment, banks: int, top_k: int) -> tuple[int, int]:
    """(expert buffers, tiles per expert): as many whole-expert buffers as asked, or by default as
    fit beside the ring (at most top_k). When not even one expert fits, each expert streams
    through the buffers (two by default) in tiles, as real kernels do: more, smaller copies."""
    per_expert = float(g.routed_bytes.max(initial=0)) / max(1, math.ceil(g.distinct_experts))
    if per_expert == 0:
        return d.expert_slots or top_k, 1
    ring = banks * hw.dma_tile_bytes
    free = hw.onchip_bytes - ring
    fit = int(free // per_expert)
    if fit < 1:
        if free <= 0:
            raise SpecError("prefetch_bytes", ring, f"the ring ({banks} x {hw.dma_tile_bytes} B) leaves no room "
                            f"in the {hw.onchip_kind} of {hw.name} ({hw.onchip_bytes:.0f} B per core) for expert "
                            "buffers")
        slots = d.expert_slots or 2
        return slots, math.ceil(slots * per_expert / free)
    slots = d.expert_slots or min(top_k, fit)
    if slots > fit:
        raise SpecError("expert_slots", slots,
                        f"{slots} x {per_expert:.0f} B expert buffers plus the ring ({banks} x "
                        f"{hw.dma_tile_bytes} B) exceed the {hw.onchip_kind} of {hw.name} "
                        f"({hw.onchip_bytes:.0f} B per core) by "
                        f"{slots * per_expert + ring - hw.onchip_bytes:.0f} B; at most {fit} fit")
    return slots, 1


@dataclass
class Stream:
    """What the megakernel's DMA engine moves: ring tiles in stream order, the byte range of the
    stream each op consumes, bytes issued at each layer's start (KV / state, small vectors), and
    each layer's routed copies."""
    tile_bytes: list[float]
    tile_end: list[float]       # cumulative position of each tile's last byte
    op_begin: list[float]
    op_end: list[float]
    layer_start_bytes: dict[int, float]
    routed_copies: dict[int, list[float]]


def uniform_stream(g: OpGraph, tile_bytes: float) -> Stream:
    """The model's own stream: static weights packed back to back in consumption order and cut
    into uniform tiles (banks); each MoE layer fetches ceil(E[distinct]) equal expert copies."""
    op_end = np.cumsum(g.static_bytes)
    total = float(op_end[-1]) if len(g) else 0.0
    n_tiles = math.ceil(total / tile_bytes)
    tiles = np.minimum(tile_bytes, total - tile_bytes * np.arange(n_tiles))
    count = max(1, math.ceil(g.distinct_experts))
    routed = np.bincount(g.layer, weights=g.routed_bytes)
    return Stream(tiles.tolist(), np.cumsum(tiles).tolist(), (op_end - g.static_bytes).tolist(), op_end.tolist(),
                  dict(enumerate(np.bincount(g.layer, weights=g.kv_bytes).tolist())),
                  {int(l): [routed[l] / count] * count for l in np.flatnonzero(routed)})


def plan_stream(g: OpGraph, plan: list[Copy]) -> Stream:
    """A kernel's real DMA plan (perfmodel.dmaplan): its ring tiles in order, each layer's ops
    consuming that layer's tiles in proportion to the bytes the model gives them; the plan's
    other copies (KV / state reads and write-backs, vectors, embedding rows) at layer start."""
    ring = [c for c in plan if c.ring]
    tiles = np.array([c.bytes for c in ring], float)
    tile_end = np.cumsum(tiles)
    model_static = np.bincount(g.layer, weights=g.static_bytes, minlength=int(g.layer.max()) + 1)
    begin, end = np.zeros(len(g)), np.zeros(len(g))
    for layer in sorted({c.layer for c in ring}):
        idx = np.flatnonzero([c.layer == layer for c in ring])
        if np.any(np.diff(idx) != 1) or layer >= len(model_static) or model_static[layer] == 0:
            raise SpecError("plan", f"layer {layer}", "ring tiles must be contiguous in the stream and "
                            "belong to a layer whose ops the model streams weights for")
        a, size = tile_end[idx[0]] - tiles[idx[0]], tiles[idx].sum()
        m = g.layer == layer
        within = np.cumsum(g.static_bytes[m]) / model_static[layer]
        within[-1] = 1.0  # the layer's last op consumes its last tile exactly
        end[m] = a + size * within
        begin[m] = end[m] - size * g.static_bytes[m] / model_static[layer]
    layer_start: dict[int, float] = {}
    routed: dict[int, list[float]] = {}
    for c in plan:
        if c.routed:
            routed.setdefault(c.layer, []).append(float(c.bytes))
        elif not c.ring:
            layer_start[c.layer] = layer_start.get(c.layer, 0.0) + c.bytes
    return Stream(tiles.tolist(), tile_end.tolist(), begin.tolist(), end.tolist(), layer_start, routed)


def simulate_megakernel(g: OpGraph, hw: Hardware, d: Deployment, top_k: int,
                        record: bool = False, plan: list[Copy] | None = None,
                        weights: np.ndarray | None = None) -> Timeline:
    """The megakernel timeline; on the model's own uniform stream or on a kernel's DMA plan.

    In-layer dependencies: a MoE layer's expert copies are issued when its router's top-k is
    known (shared experts compute meanwhile), the expert matmuls wait for them, the all-reduce
    follows, and the next layer's ops follow that. With fitted TPU components, each phase of a
    collective moves its bytes as a remote copy on this same DMA engine."""
    bw, lat, desc = stream_terms(hw)
    dma = DmaEngine(bw, lat, hw.dma_sharing == "shared", record, desc)
    c = hw.components
    remote = cm.is_tpu_model(c)
    issue, completion, done = dma.issue, dma.completion, dma.done
    banks = ring_banks(hw, d.prefetch_bytes)
    st = uniform_stream(g, float(hw.dma_tile_bytes)) if plan is None else plan_stream(g, plan)
    tile_bytes, tile_end, op_begin, op_end = st.tile_bytes, st.tile_end, st.op_begin, st.op_end
    n_tiles = len(tile_bytes)
    total = tile_end[-1] if n_tiles else 0.0
    owner = np.searchsorted(op_end, np.asarray(tile_end) - 0.5, side="right").tolist()
    slots, pieces = expert_slots(g, hw, d, banks, top_k)
    names, layers = g.name, g.layer.tolist()
    label = lambda k: record and (names[min(owner[k], len(g) - 1)], layers[min(owner[k], len(g) - 1)])
    comp, coll = op_compute_s(g, hw, weights).tolist(), collective_s(g, hw).tolist()
    routed, kv_op = g.routed_bytes.tolist(), g.kv_bytes.tolist()
    is_coll = g.is_collective.tolist()
    t0 = call_s(hw)
    tile_id = [issue(t0, tile_bytes[k], label(k)) for k in range(min(banks, n_tiles))]
    next_tile = len(tile_id)
    overhead = hw.efficiency.op_overhead_s
    n = len(g)
    start, end = [0.0] * n, [0.0] * n
    stream, fetch, coll_w = [0.0] * n, [0.0] * n, [0.0] * n
    events = []
    now = t0
    kv_id = {}
    expert_ids: dict[int, list[int]] = {}  # layer -> its expert copies issued so far
    for j in range(n):
        layer = layers[j]
        if layer not in kv_id:  # layer start: prefetch its KV cache / state
            kv_id[layer] = issue(now, st.layer_start_bytes.get(layer, 0.0), ("kv_cache/state", layer))
        if is_coll[j]:
            t = now + coll[j]
            if remote:  # its phases' remote copies queue on this core's DMA engine
                scale = hw.efficiency.collective_latency_scale
                t = now + scale * c["collective_call_s"]
                k, m, p = g.coll_kind[j], float(g.coll_bytes[j]), int(g.coll_group[j])
                cores = min(hw.cores_per_chip, p)
                alg = cm.collective_time(c, k, m, p, hw.cores_per_chip, scale=scale)[1]
                for ph in cm.collective_phases(k, alg, m, p, hw.cores_per_chip):
                    cid = issue(t, ph.dma_bytes, (names[j], layer), remote=True)
                    t = max(t + cm.phase_time(c, ph, p // cores, cores, scale), completion(cid))
            start[j], end[j] = now, t
            coll_w[j] = t - now
            if record:
                events.append(("link", names[j], layer, now, end[j]))
            now = end[j]
            continue
        ready = max(now, completion(kv_id[layer])) if kv_op[j] > 0 else now
        stream[j] = ready - now
        start[j] = ready
        t = ready + overhead
        if op_end[j] > op_begin[j]:  # consume this op's byte range of the stream, tile by tile
            per_byte = comp[j] / (op_end[j] - op_begin[j])
            lo, hi = op_begin[j], op_end[j]
            k = bisect.bisect_right(tile_end, lo)
            while k < n_tiles and tile_end[k] - tile_bytes[k] < hi:
                arrive = done.get(tile_id[k]) or completion(tile_id[k])
                if arrive > t:
                    stream[j] += arrive - t
                    t = arrive
                t += per_byte * (min(hi, tile_end[k]) - max(lo, tile_end[k] - tile_bytes[k]))
                if (hi >= tile_end[k] or hi >= total) and next_tile < n_tiles:  # consumed: refill its bank
                    tile_id.append(issue(t, tile_bytes[next_tile], label(next_tile)))
                    next_tile += 1
                k += 1
        elif routed[j] > 0:  # experts: fetched into slots once the router has picked them
            copies = [b / pieces for b in st.routed_copies.get(layer, []) for _ in range(pieces)]
            step = comp[j] / max(1, len(copies))
            ids = expert_ids.get(layer) or [issue(t, b, (names[j], layer)) for b in copies[:slots]]
            for e in range(len(copies)):
                arrive = completion(ids[e])
                if arrive > t:
                    fetch[j] += arrive - t
                    t = arrive
                t += step
                if e + slots < len(copies):
                    ids.append(issue(t, copies[e + slots], (names[j], layer)))
        else:
            t += comp[j]
            if names[j] == "top_k" and st.routed_copies.get(layer):  # routing known: fetch now
                expert_ids[layer] = [issue(t, b, ("routed_experts", layer))
                                     for b in st.routed_copies[layer][:slots]]
        end[j] = t
        if record:
            events.append(("compute", names[j], layer, start[j], t))
        now = t
    arr = np.asarray
    comp_a = arr(comp) * ~g.is_collective
    waits = {"compute": comp_a, "weight_streaming": arr(stream), "expert_fetch": arr(fetch),
             "collective": arr(coll_w), "launch": np.where(g.is_collective, 0.0, overhead) + t0 * (arr(range(n)) == 0),
             "fill_drain": np.zeros(n)}
    start, end = arr(start), arr(end)
    tl = Timeline(start, end, waits, now, dma.busy_bytes, expert_tiles=pieces)
    if record:
        tl.events = events + dma.lane_events()
    return tl
