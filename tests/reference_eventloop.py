"""The megakernel event loop as it was written first (with the held-back refills and the limit on
copies in service added since): a Python DMA engine object and one loop over the ops. It is the
reference the compiled simulator (perfmodel.engine.megakernel) must agree with to 1e-9 relative
(tests/test_simulator_equivalence.py); it is not used by the package."""
from __future__ import annotations

import bisect
import heapq
import math
from collections import deque

import numpy as np

from perfmodel.cost import components as cm
from perfmodel.engine.megakernel import (bank_bytes, held_refills, megakernel_compute_s, plan_stream, sizing,
                                        uniform_stream)
from perfmodel.engine.terms import Timeline, call_s, collective_terms, stream_terms
from perfmodel.graph.dmaplan import Copy
from perfmodel.graph.ops import OpGraph
from perfmodel.spec.deployment import Deployment
from perfmodel.spec.hardware import Hardware


class DmaEngine:
    """HBM -> on-chip copies; a copy starts `latency` after issue and then needs bytes/bandwidth.

    FIFO: copies are served one after another in issue order. Shared: every copy in service gets
    bandwidth / (number in service), tracked with a virtual clock V (bytes served to each copy in
    service) so that each arrival or completion costs O(log n); at most `concurrent` copies are in
    service (0: no limit), the other started copies waiting in issue order.
    """

    def __init__(self, bandwidth: float, latency: float, shared: bool, record: bool = False,
                 descriptor_s: float = 0.0, concurrent: int = 0):
        self.bw, self.lat, self.shared, self.record = bandwidth, latency, shared, record
        self.concurrent = concurrent
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
              remote: bool = False, descriptors: float = 1.0) -> int:
        """A copy of `descriptors` descriptors issued at `t`. A remote copy (VMEM to another core, a
        collective's) reads no HBM and pays its phase's round instead of the HBM first-byte latency."""
        cid = self.n
        self.n += 1
        if not remote:
            self.busy_bytes += nbytes
        start = t + (0.0 if remote else self.lat)
        if nbytes > 0:
            nbytes += self.extra * descriptors
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
        room = lambda n: not self.concurrent or n < self.concurrent
        while cid not in done:
            n = len(heap)
            t_next = t + (heap[0][0] - v) * n / bw if n else math.inf
            if pending and pending[0][0] <= t_next and room(n):
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


def simulate_megakernel(g: OpGraph, hw: Hardware, d: Deployment, top_k: int,
                        record: bool = False, plan: list[Copy] | None = None,
                        weights: np.ndarray | None = None) -> Timeline:
    """perfmodel.engine.megakernel.simulate_megakernel, walked op by op in Python."""
    bw, lat, desc = stream_terms(hw)
    dma = DmaEngine(bw, lat, hw.dma_sharing == "shared", record, desc, hw.dma_concurrent_copies)
    c = hw.components
    remote = cm.is_tpu_model(c)
    issue, completion, done = dma.issue, dma.completion, dma.done
    s = sizing(g, hw, d, top_k)
    banks = s.banks
    st = uniform_stream(g, float(bank_bytes(g, hw))) if plan is None else plan_stream(g, plan)
    tile_bytes, tile_end, op_begin, op_end = st.tile_bytes, st.tile_end, st.op_begin, st.op_end
    n_tiles = len(tile_bytes)
    total = tile_end[-1] if n_tiles else 0.0
    defer, flush, tile_layer = (a.tolist() for a in held_refills(g, st))
    held: list[int] = []  # refills held back (tile indices) until the next op that flushes them
    owner = np.searchsorted(op_end, np.asarray(tile_end) - 0.5, side="right").tolist()
    slots, pieces = s.slots, s.tiles_per_expert
    names, layers = g.name, g.layer.tolist()
    label = lambda k: record and (names[min(owner[k], len(g) - 1)], layers[min(owner[k], len(g) - 1)])
    comp, coll = megakernel_compute_s(g, hw, weights).tolist(), collective_terms(g, hw, megakernel=True)[0].tolist()
    routed, kv_op, own = g.routed_bytes.tolist(), g.kv_bytes.tolist(), st.op_fetch.tolist()
    is_coll = g.is_collective.tolist()
    t0 = call_s(hw) / d.steps_per_call
    per_copy = max(1.0, st.expert_descriptors / pieces)  # descriptors of one routed copy
    kv_id = {}

    def layer_start(layer, t):  # the next layer's vectors, then its own KV cache / state
        vec_bytes, vec_descriptors = st.vectors.get(layer, (0.0, 0))
        if vec_bytes > 0:
            issue(t, vec_bytes, ("layer_vectors", layer), descriptors=vec_descriptors)
        kv_id[layer] = issue(t, st.layer_start_bytes.get(layer, 0.0), ("kv_cache/state", layer),
                             descriptors=st.kv_copies.get(layer, 1))
    if layers:  # the first layer's copies ahead of the ring's first banks
        layer_start(layers[0], t0)
    tile_id = [issue(t0, tile_bytes[k], label(k)) for k in range(min(banks, n_tiles))]
    next_tile = len(tile_id)
    overhead = hw.efficiency.op_overhead_s
    n = len(g)
    start, end = [0.0] * n, [0.0] * n
    stream, fetch, coll_w = [0.0] * n, [0.0] * n, [0.0] * n
    events = []
    now = t0
    writeback: dict[int, int | None] = {}  # layer -> its cache write-back copy (None: waited for)
    expert_ids: dict[int, list[int]] = {}  # layer -> its expert copies issued so far
    for j in range(n):
        layer = layers[j]
        if layer not in kv_id:
            layer_start(layer, now)
        if is_coll[j]:
            if writeback.get(layer) is not None:  # the attention's cache write-back, waited for first
                now = max(now, completion(writeback[layer]))
                writeback[layer] = None
            t = now + coll[j]
            if remote:  # its phases' remote copies queue on this core's DMA engine
                scale = hw.efficiency.collective_latency_scale
                t = now + scale * c["collective_call_s"]
                k, m, p = g.coll_kind[j], float(g.coll_bytes[j]), int(g.coll_group[j])
                cores = min(hw.cores_per_chip, p)
                alg = g.kernel_all_reduce if k == "all_reduce" and g.kernel_all_reduce else None
                for ph in cm.collective_time(c, k, m, p, hw.cores_per_chip, alg, scale)[2]:
                    cid = issue(t, ph.dma_bytes, (names[j], layer), remote=True)
                    t = max(t + cm.phase_time(c, ph, p // cores, cores, scale), completion(cid))
            start[j], end[j] = now, t
            coll_w[j] = t - now
            if record:
                events.append(("link", names[j], layer, now, end[j]))
            now = end[j]
            continue
        waits = (kv_op[j] > 0 and own[j] == 0) or layer == 0
        ready = max(now, completion(kv_id[layer])) if waits else now
        if own[j] > 0:  # the op's own KV / state copy, issued now
            ready = max(ready, completion(issue(now, own[j], ("kv_cache/state", layer),
                                                descriptors=st.kv_copies.get(layer, 1))))
        stream[j] = ready - now
        start[j] = ready
        wb_bytes, wb_descriptors = st.writeback.get(layer, (0.0, 1))
        if wb_bytes > 0 and layer not in writeback and kv_op[j] > 0:
            writeback[layer] = issue(ready, wb_bytes, ("kv_writeback", layer), descriptors=wb_descriptors)
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
                    if defer[j] and tile_layer[next_tile] > layer:
                        held.append(next_tile)
                        tile_id.append(None)
                    else:
                        tile_id.append(issue(t, tile_bytes[next_tile], label(next_tile)))
                    next_tile += 1
                k += 1
        elif routed[j] > 0:  # experts: fetched into slots once the router has picked them
            copies = [b / pieces for b in st.routed_copies.get(layer, []) for _ in range(pieces)]
            step = comp[j] / max(1, len(copies))
            ids = expert_ids.get(layer) or [issue(t, b, (names[j], layer), descriptors=per_copy)
                                            for b in copies[:slots]]
            for e in range(len(copies)):
                arrive = completion(ids[e])
                if arrive > t:
                    fetch[j] += arrive - t
                    t = arrive
                t += step
                if e + slots < len(copies):
                    ids.append(issue(t, copies[e + slots], (names[j], layer), descriptors=per_copy))
        else:
            t += comp[j]
            if names[j] == "top_k" and st.routed_copies.get(layer):  # routing known: fetch now
                pieced = [b / pieces for b in st.routed_copies[layer] for _ in range(pieces)]
                expert_ids[layer] = [issue(t, b, ("routed_experts", layer), descriptors=per_copy)
                                     for b in pieced[:slots]]
        if flush[j]:  # the refills held back, issued in their order
            for h in held:
                tile_id[h] = issue(t, tile_bytes[h], label(h))
            held = []
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
    tl = Timeline(start, end, waits, now, dma.busy_bytes, sizing=s)
    if record:
        tl.events = events + dma.lane_events()
    return tl
