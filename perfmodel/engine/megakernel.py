"""The megakernel engine: one program for the whole step, simulated on the DMA engine, the
compute unit and the links.

Static weights stream through a ring of `banks` on-chip tiles in program order, a tile being
issued when the tile `banks` earlier has been consumed, so loads run ahead through collectives,
routing and layer boundaries. KV cache / state copies are issued at layer start. Routed experts
are issued only after that layer's router, into `slots` expert buffers. Activations stay on
chip. With fitted TPU components each phase of a collective moves its bytes as a remote copy on
the same DMA engine as the weight stream and the experts (they queue and share bandwidth). The
DMA engine serves outstanding copies first-in-first-out or shares its bandwidth equally among
them (round-robin), as the chip preset says (`dma_sharing`); shared, it serves at most
`dma_concurrent_copies` at once (0: any number), the other started copies waiting in issue order. The loops run compiled
(perfmodel.engine.megakernel_sim) on arrays built here once per op graph and chip.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from perfmodel.cost import components as cm
from perfmodel.engine.terms import (RECURRENCES, Sizing, Timeline, call_s, collective_terms, op_compute_s,
                                    stream_terms)
from perfmodel.graph.dmaplan import Copy
from perfmodel.graph.ops import OpGraph
from perfmodel.spec.deployment import Deployment
from perfmodel.spec.hardware import Hardware
from perfmodel.util import interrupts, limits
from perfmodel.util.errors import SpecError


def bank_bytes(g: OpGraph, hw: Hardware) -> int:
    """The ring's bank (DMA tile): the model's kernel's own ([megakernel] bank_bytes), else the chip's."""
    return g.recipe.bank_bytes or hw.dma_tile_bytes


def onchip_request(g: OpGraph, hw: Hardware, d: Deployment, top_k: int) -> Sizing:
    """What a deployment asks of the on-chip buffer, unchecked: the ring depth (by default the
    model's kernel's ring, else half the buffer; the rest holds experts, KV and activations) in
    whole tiles, and the expert buffers (by default the kernel's, else as many whole experts as fit
    beside the ring, at most top_k; two tiled buffers when not even one fits)."""
    tile, rc = bank_bytes(g, hw), g.recipe
    depth = d.prefetch_bytes if d.prefetch_bytes is not None else \
        rc.ring_banks * tile if rc.ring_banks else hw.onchip_bytes / 2
    d_slots = d.expert_slots or rc.expert_slots or None
    banks = max(1, int(depth // tile))
    per_expert = float(g.routed_bytes.max(initial=0)) / max(1, math.ceil(g.distinct_experts))
    free = hw.onchip_bytes - banks * tile
    if per_expert == 0:
        return Sizing(hw.onchip_bytes, tile, banks, max(depth, banks * tile), 0.0, d_slots or top_k, 1, top_k)
    fit = max(0, int(free // per_expert))
    if fit < 1:
        slots = d_slots or 2
        tiles = math.ceil(slots * per_expert / free) if free > 0 else 1
    else:
        slots, tiles = d_slots or min(top_k, fit), 1
    return Sizing(hw.onchip_bytes, tile, banks, max(depth, banks * tile), per_expert, slots, tiles, fit)


def sizing(g: OpGraph, hw: Hardware, d: Deployment, top_k: int) -> Sizing:
    """The deployment's on-chip budget (onchip_request), or SpecError naming the field that does
    not fit: the ring (`prefetch_bytes`) or the expert buffers (`expert_slots`)."""
    s = onchip_request(g, hw, d, top_k)
    kind, cap = hw.onchip_kind, hw.onchip_bytes
    if s.depth_bytes > cap:
        raise SpecError("prefetch_bytes", d.prefetch_bytes if d.prefetch_bytes is not None else s.depth_bytes,
                        f"a ring of {s.banks} x {s.tile_bytes} B tiles exceeds the {kind} of {hw.name} "
                        f"({cap:.0f} B per core) by {s.depth_bytes - cap:.0f} B; at most "
                        f"{cap // s.tile_bytes * s.tile_bytes / 2**20:.4g} MiB fits")
    if s.expert_bytes and s.fit < 1 and cap - s.ring_bytes <= 0:
        raise SpecError("prefetch_bytes", s.ring_bytes, f"the ring ({s.banks} x {s.tile_bytes} B) leaves no room "
                        f"in the {kind} of {hw.name} ({cap:.0f} B per core) for expert buffers")
    if s.expert_bytes and s.fit >= 1 and s.slots > s.fit:
        split = (f" (ep = {d.expert_groups} splits each expert over {d.devices // d.expert_groups} of the "
                 f"{d.devices} devices; --ep 1 splits it over all of them)" if d.expert_groups > 1 else "")
        raise SpecError("expert_slots", s.slots,
                        f"{s.slots} x {s.expert_bytes:.0f} B expert buffers plus the ring ({s.banks} x "
                        f"{s.tile_bytes} B) exceed the {kind} of {hw.name} ({cap:.0f} B per core) by "
                        f"{s.slots * s.expert_bytes + s.ring_bytes - cap:.0f} B; at most {s.fit} fit{split}")
    return s


@dataclass
class Stream:
    """What the megakernel's DMA engine moves: ring tiles in stream order, the byte range of the
    stream each op consumes, bytes issued at each layer's start (KV / state, small vectors), each
    layer's routed copies, the bytes an op copies itself when it starts (KV / state without
    prefetch), and per layer the descriptors of its KV / state copy, its cache write-back
    (OpGraph.kv_copies, OpGraph.writeback) and the next layer's vectors it copies as it starts
    ([megakernel] layer_vector_bytes)."""
    tile_bytes: np.ndarray
    tile_end: np.ndarray        # cumulative position of each tile's last byte
    op_begin: np.ndarray
    op_end: np.ndarray
    layer_start_bytes: dict[int, float]
    routed_copies: dict[int, list[float]]
    op_fetch: np.ndarray
    expert_descriptors: int = 1  # descriptors of one routed copy (the model's stream: one per matrix and scale)
    kv_copies: dict[int, int] = field(default_factory=dict)  # per layer: descriptors of its KV copy (default 1)
    writeback: dict[int, tuple[float, int]] = field(default_factory=dict)  # per layer: (bytes, descriptors)
    # per layer: (bytes, descriptors) of the next layer's vectors, copied as it starts, before its KV
    vectors: dict[int, tuple[float, int]] = field(default_factory=dict)
    # layers whose attention ends waiting for its write-back (else the layer's next collective does)
    writeback_awaited: frozenset[int] = frozenset()


def uniform_stream(g: OpGraph, tile_bytes: float) -> Stream:
    """The model's own stream: static weights packed back to back in consumption order and cut
    into uniform tiles (banks); each MoE layer fetches ceil(E[distinct]) equal expert copies; KV /
    state copies issued at layer start, or by the op that reads them where the model's kernel does
    not prefetch them ([megakernel] kv_prefetch = false)."""
    op_end = np.cumsum(g.static_bytes)
    total = float(op_end[-1]) if len(g) else 0.0
    n_tiles = math.ceil(total / tile_bytes)
    tiles = np.minimum(tile_bytes, total - tile_bytes * np.arange(n_tiles))
    count = max(1, math.ceil(g.distinct_experts))
    routed = np.bincount(g.layer, weights=g.routed_bytes)
    prefetch = g.recipe.kv_prefetch
    kv = np.bincount(g.layer, weights=g.kv_bytes if prefetch else np.zeros(len(g))).tolist()
    return Stream(tiles, np.cumsum(tiles), op_end - g.static_bytes, op_end, dict(enumerate(kv)),
                  {int(l): [routed[l] / count] * count for l in np.flatnonzero(routed)},
                  np.zeros(len(g)) if prefetch else g.kv_bytes.astype(float), g.expert_descriptors,
                  g.kv_copies, g.writeback, vector_copies(g))


def vector_copies(g: OpGraph) -> dict[int, tuple[float, int]]:
    """Per layer, the (bytes, descriptors) of the next layer's vectors the model's kernel copies as
    the layer starts ([megakernel] layer_vector_bytes): layers 0 (the glue before the first decoder
    layer) to n - 1; the last decoder layer (n) and the head (n + 1) copy none."""
    vec = g.recipe.layer_vector_bytes
    n_layers = int(g.layer.max(initial=0)) - 1
    return {l: (float(sum(vec)), len(vec)) for l in range(n_layers)} if vec else {}


def plan_stream(g: OpGraph, plan: list[Copy]) -> Stream:
    """A kernel's real DMA plan (perfmodel.graph.dmaplan; its HBM copies): its ring tiles in
    order, each layer's ops consuming that layer's tiles in proportion to the bytes the model
    gives them; each routed expert one copy of its descriptors (consecutive copies of one expert:
    its matrices and scales); the plan's write-backs issued by the op that reads the layer's KV /
    state, an MLA cache's awaited as its attention ends (megakernel.mla_attention; a KDA state's by
    the next KDA layer, long after: not awaited); the plan's other copies (KV / state reads,
    vectors, embedding rows) at layer start."""
    ring = [c for c in plan if c.ring]
    tiles = np.array([c.bytes for c in ring], float)
    tile_end = np.cumsum(tiles)
    model_static = np.bincount(g.layer, weights=g.static_bytes, minlength=int(g.layer.max()) + 1)
    begin, end = np.zeros(len(g)), np.zeros(len(g))
    for layer in sorted({c.layer for c in ring}):
        idx = np.flatnonzero([c.layer == layer for c in ring])
        if np.any(np.diff(idx) != 1) or not 0 <= layer < len(model_static) or model_static[layer] == 0:
            raise SpecError("plan", f"layer {layer}", "ring tiles must be contiguous in the stream and "
                            "belong to a layer whose ops the model streams weights for")
        a, size = tile_end[idx[0]] - tiles[idx[0]], tiles[idx].sum()
        m = g.layer == layer
        within = np.cumsum(g.static_bytes[m]) / model_static[layer]
        within[-1] = 1.0  # the layer's last op consumes its last tile exactly
        end[m] = a + size * within
        begin[m] = end[m] - size * g.static_bytes[m] / model_static[layer]
    layer_start: dict[int, float] = {}
    writeback: dict[int, tuple[float, int]] = {}
    awaited: set[int] = set()
    routed: dict[int, list[float]] = {}
    descriptors: list[int] = []  # per routed expert copy
    last = None
    for c in plan:
        if c.routed:  # one expert's descriptors (its matrices, its scales) follow each other
            expert = (c.layer, c.name.split(" (")[0])
            if expert == last:
                routed[c.layer][-1] += c.bytes
                descriptors[-1] += 1
            else:
                routed.setdefault(c.layer, []).append(float(c.bytes))
                descriptors.append(1)
            last = expert
        elif c.writes_back:
            b, n = writeback.get(c.layer, (0.0, 0))
            writeback[c.layer] = (b + c.bytes, n + 1)
            if c.family == "kv_cache":
                awaited.add(c.layer)
        elif not c.ring:
            layer_start[c.layer] = layer_start.get(c.layer, 0.0) + c.bytes
    per = max(1, round(float(np.mean(descriptors)))) if descriptors else 1
    return Stream(tiles, tile_end, begin, end, layer_start, routed, np.zeros(len(g)), per,
                  writeback=writeback, writeback_awaited=frozenset(awaited))


@dataclass
class MegakernelArrays:
    """One op graph's megakernel inputs as flat arrays (megakernel_sim.run), shared by every ring
    depth, slot count and DMA mode simulated on it."""
    eng: np.ndarray            # [bandwidth, first-byte latency, descriptor cost as bytes, shared, descriptors
    #                            of one routed copy]
    t0: float                  # host dispatch of one device call (shared by its steps)
    overhead: float
    tile_bytes: np.ndarray
    tile_end: np.ndarray
    kind: np.ndarray           # megakernel_sim.PLAIN / STREAM / ROUTED / COLL / TOPK
    layer: np.ndarray
    op_begin: np.ndarray
    op_end: np.ndarray
    comp: np.ndarray
    coll: np.ndarray
    kv_wait: np.ndarray
    op_fetch: np.ndarray
    layer_start: np.ndarray
    kv_copies: np.ndarray      # per layer: the descriptors of its KV / state copy
    writeback: np.ndarray      # per layer: bytes, descriptors of its attention's cache write-back and the op
    #                            whose end waits for it (-1: the next collective), shape (3, layers)
    vectors: np.ndarray        # per layer: bytes and descriptors of the vectors copied as it starts, shape (2, layers)
    rc_off: np.ndarray
    rc_bytes: np.ndarray
    ph_off: np.ndarray
    ph_bytes: np.ndarray
    ph_time: np.ndarray
    coll_call: np.ndarray
    remote: bool
    defer: np.ndarray          # per op: its refills for a later layer's tiles are held back (held_refills)
    flush: np.ndarray          # per op: issues the held-back refills at its end
    tile_layer: np.ndarray     # per tile: the layer of its first byte

    def args(self) -> tuple:
        """The arguments of megakernel_sim.run / run_many after the per-configuration ones."""
        return (self.tile_bytes, self.tile_end, self.kind, self.layer, self.op_begin, self.op_end, self.comp,
                self.coll, self.kv_wait, self.op_fetch, self.layer_start, self.kv_copies, self.writeback,
                self.vectors, self.rc_off, self.rc_bytes, self.ph_off, self.ph_bytes, self.ph_time, self.coll_call, self.remote,
                self.defer, self.flush, self.tile_layer)


def held_refills(g: OpGraph, st: Stream) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The model's kernel holding back ring refills ([megakernel] defer_refills_rows): at that many
    rows or fewer, a MoE layer's gemvs before its routed experts (router, latent down-projection,
    shared experts) hold the refills they would issue for a later layer's tiles, and the routed
    experts issue them after their last expert's dots (Muse Spark's kernel: decode_megakernel.py
    `defer=next`, its default at batch <= 4, with `flush=last`). Returns per op (defer, flush) and
    per tile the layer of its first byte."""
    n = len(g)
    defer, flush = np.zeros(n, np.int8), np.zeros(n, np.int8)
    first_byte = st.tile_end - st.tile_bytes
    owner = np.minimum(np.searchsorted(st.op_end, first_byte + 0.5, side="right"), max(n - 1, 0))
    tile_layer = g.layer.astype(np.int64)[owner] if n else np.zeros(len(st.tile_bytes), np.int64)
    rows = g.recipe.defer_refills_rows
    if not rows or g.tokens > rows:
        return defer, flush, tile_layer
    names, phase = np.array(g.name), np.array(g.phase)
    for r in np.flatnonzero(names == "routed_experts").tolist():
        before = (g.layer == g.layer[r]) & (phase == "moe") & (np.arange(n) < r) & (st.op_end > st.op_begin)
        defer[before] = 1
        flush[r] = 1
    return defer, flush, tile_layer


def megakernel_arrays(g: OpGraph, hw: Hardware, st: Stream, weights: np.ndarray | None = None) -> MegakernelArrays:
    """Flatten the op graph, its stream and its collectives' phases for megakernel_sim."""
    from perfmodel.engine import megakernel_sim as ms
    bw, lat, desc = stream_terms(hw)
    secs, call, ph_off, ph_bytes, ph_time = collective_terms(g, hw, megakernel=True)
    layer = g.layer.astype(np.int64)
    n_layers = 1 + max(int(layer.max(initial=0)), *st.layer_start_bytes, *st.routed_copies, 0)
    kind = np.full(len(g), ms.PLAIN, np.int8)
    has_experts = np.isin(layer, list(st.routed_copies))
    top_k = np.zeros(len(g), bool)
    top_k[[j for j, nm in enumerate(g.name) if nm == "top_k"]] = True
    kind[top_k & has_experts] = ms.TOPK
    kind[g.routed_bytes > 0] = ms.ROUTED
    kind[st.op_end > st.op_begin] = ms.STREAM
    kind[g.is_collective] = ms.COLL
    if np.bincount(layer[kind == ms.ROUTED], minlength=1).max() > 1:
        raise ValueError("megakernel_sim takes at most one routed-expert op per layer")
    layer_start, kv_copies = np.zeros(n_layers), np.ones(n_layers)
    writeback, vectors = np.zeros((3, n_layers)), np.zeros((2, n_layers))
    writeback[2] = -1
    for l, b in st.layer_start_bytes.items():
        layer_start[l] = b
    for l, n in st.kv_copies.items():
        kv_copies[l] = n
    attention = np.array(g.phase) == "attention"
    for l, (b, n) in st.writeback.items():
        last = np.flatnonzero(attention & (layer == l))
        writeback[:, l] = b, n, last[-1] if l in st.writeback_awaited and len(last) else -1
    for l, (b, n) in st.vectors.items():
        vectors[:, l] = b, n
    counts = np.zeros(n_layers + 1, np.int64)
    for l, copies in st.routed_copies.items():
        counts[l + 1] = len(copies)
    rc_bytes = np.array([b for l in sorted(st.routed_copies) for b in st.routed_copies[l]], float)
    remote = cm.is_tpu_model(hw.components)
    # an op waits for its layer's KV / state copy; layer 0's ops (the embedding) for its rows
    kv_wait = ((g.kv_bytes > 0) & (st.op_fetch == 0)) | (layer == 0)
    return MegakernelArrays(
        np.array([bw, lat, desc * bw, float(hw.dma_sharing == "shared"), st.expert_descriptors,
                  float(hw.dma_concurrent_copies)]), call_s(hw),
        hw.efficiency.op_overhead_s,
        st.tile_bytes, st.tile_end, kind, layer, st.op_begin, st.op_end, megakernel_compute_s(g, hw, weights),
        secs, kv_wait, st.op_fetch, layer_start, kv_copies, writeback, vectors,
        np.cumsum(counts),
        rc_bytes, ph_off, ph_bytes, ph_time, call, remote, *held_refills(g, st))


ATTENTION_CORES = ("gqa_attention", "mla_attention", "kda_recurrence", "gdn_recurrence", "mamba2_scan",
                   "csa_attention")


def kernel_terms(g: OpGraph, hw: Hardware) -> dict[str, np.ndarray]:
    """Per op, the in-kernel costs a TPU megakernel pays beside its FLOPs and bytes, by mechanism:
    `bank_dots` (the kernel consumes each ring bank with a dot of its own, so a matmul streamed over
    n banks issues n - 1 dots beyond the one components.matmul_time counts, each
    `mxu_dot_issue_s`: Muse Spark's stream.py consumes every load with one MXU op, and the stream
    micro-benchmarks that fit the issue cost were timed so), `attention_core` (each sequence's
    decode attention core: a latency a sequence and one per cache tile it walks, OpGraph.core_tiles,
    components.attention_core_time; a recurrence's where its compute does not hold it,
    components.recurrence_time), `top_k` (routing's
    pick, components.topk_time, by the kernel's algorithm), `embed_pick` (the kernel's pick of each
    sequence's embedding row out of its copied tile, Megakernel.embedding_pick_values, on hardware
    that measures components.embed_pick_time), `xla_embedding` (the lookup and psum in
    XLA glue around the kernel, components.xla_embedding_time) and `xla_sampling` (the greedy pick
    in XLA glue after it, components.xla_sampling_time). Zero without TPU components."""
    out: dict[str, np.ndarray] = {}
    if not cm.is_tpu_model(hw.components) or not len(g):
        return out
    c, k = hw.components, g.top_k or 1
    glue = {"xla_embedding": cm.xla_embedding_time(c), "xla_sampling": cm.xla_sampling_time(c)}
    per_op = {"top_k": cm.topk_time(c, g.recipe.top_k, k), **glue}
    names = np.array(g.name)
    on_vpu = cm.recurrence_on_vpu(c)  # a recurrence's latency is then in its compute (op_compute_s)
    cost = np.array([0.0 if on_vpu and nm in RECURRENCES else
                     cm.attention_core_time(c, g.sequences, g.core_tiles.get(int(l), 0)) if nm in ATTENTION_CORES
                     else per_op.get(nm, 0.0) for nm, l in zip(g.name, g.layer)])
    cost *= (g.flops > 0) | np.isin(names, list(glue))
    banks = np.ceil(g.static_bytes / bank_bytes(g, hw))
    out["bank_dots"] = np.where((g.flops > 0) & (banks > 1), (banks - 1) * cm.param(c, "mxu_dot_issue_s"), 0.0)
    out["attention_core"] = np.where(np.isin(names, ATTENTION_CORES), cost, 0.0)
    for term in ("top_k", *glue):
        out[term] = np.where(names == term, cost, 0.0)
    if g.recipe.embedding_pick_values and "embed_pick_s" in c:
        out["embed_pick"] = np.where(names == "embedding_gather",
                                     cm.embed_pick_time(c, g.recipe.embedding_pick_values), 0.0)
    return out


def megakernel_compute_s(g: OpGraph, hw: Hardware, weights: np.ndarray | None = None) -> np.ndarray:
    """Per-op compute in the megakernel: engine.terms.op_compute_s plus kernel_terms."""
    return op_compute_s(g, hw, weights, megakernel=True) + sum(kernel_terms(g, hw).values(), np.zeros(len(g)))


def cached_arrays(g: OpGraph, hw: Hardware, plan: list[Copy] | None = None,
                  weights: np.ndarray | None = None) -> MegakernelArrays:
    """megakernel_arrays of the uniform stream or of `plan`, kept for the same graph, hardware
    and plan objects and weights (sweeps over depth and slots, repeated predictions); callers
    must not mutate them."""
    key = (id(g), id(hw), id(plan), None if weights is None else weights.tobytes())
    if key not in _ARRAYS:
        if len(_ARRAYS) >= 64:
            _ARRAYS.clear()
        st = uniform_stream(g, float(bank_bytes(g, hw))) if plan is None else plan_stream(g, plan)
        _ARRAYS[key] = ((g, hw, plan), megakernel_arrays(g, hw, st, weights))  # the objects kept alive
    return _ARRAYS[key][1]


_ARRAYS: dict[tuple, tuple[tuple, MegakernelArrays]] = {}


def simulate_megakernel(g: OpGraph, hw: Hardware, d: Deployment, top_k: int,
                        record: bool = False, plan: list[Copy] | None = None,
                        weights: np.ndarray | None = None) -> Timeline:
    """The megakernel timeline; on the model's own uniform stream or on a kernel's DMA plan.

    In-layer dependencies: a MoE layer's expert copies are issued when its router's top-k is
    known (shared experts compute meanwhile), the expert matmuls wait for them, the all-reduce
    follows, and the next layer's ops follow that. A kernel that moves its KV cache in tiles
    ([megakernel] kv_tile_tokens) reads them as a copy per tile and cache array and issues the
    write-back of the last tile as the attention starts; the layer's next collective waits for it
    (on a kernel's plan, an MLA cache's write-back is awaited as its attention ends, as the
    kernel does).
    With fitted TPU components, each phase of a collective moves its bytes as a remote copy on this
    same DMA engine. The loops run compiled
    (perfmodel.engine.megakernel_sim)."""
    from perfmodel.engine import megakernel_sim as ms
    limits.spend("layer_steps", int(g.layer[-1]) + 1 if len(g) else 0)
    s = sizing(g, hw, d, top_k)
    banks, slots, pieces = s.banks, s.slots, s.tiles_per_expert
    a = cached_arrays(g, hw, plan, weights)
    t0 = a.t0 / d.steps_per_call
    with interrupts.deferred():  # compiled: a signal inside is raised when it returns
        start, end, stream, fetch, coll_w, now, hbm_bytes, begin, done, tags, refs = ms.run(
            a.eng, t0, a.overhead, banks, slots, pieces, *a.args())
    n = len(g)
    waits = {"compute": a.comp * ~g.is_collective, "weight_streaming": stream, "expert_fetch": fetch,
             "collective": coll_w, "launch": np.where(g.is_collective, 0.0, a.overhead) + t0 * (np.arange(n) == 0),
             "fill_drain": np.zeros(n)}
    tl = Timeline(start, end, waits, float(now), float(hbm_bytes), sizing=s)
    if record:
        names, layers = g.name, g.layer.tolist()
        tl.events = [("link" if a.kind[j] == ms.COLL else "compute", names[j], layers[j], start[j], end[j])
                     for j in range(n)]
        owner = np.minimum(np.searchsorted(a.op_end, a.tile_end - 0.5, side="right"), n - 1).tolist()
        label = {ms.TAG_TILE: lambda r: (names[owner[r]], layers[owner[r]]),
                 ms.TAG_KV: lambda r: ("kv_cache/state", r), ms.TAG_WB: lambda r: ("kv_writeback", r),
                 ms.TAG_VEC: lambda r: ("layer_vectors", r),
                 ms.TAG_TOPK: lambda r: ("routed_experts", r),
                 ms.TAG_OP: lambda r: (names[r], layers[r])}
        tl.events += [("dma", *label[tag](ref), b, e)
                      for tag, ref, b, e in zip(tags.tolist(), refs.tolist(), begin.tolist(), done.tolist())]
    return tl
