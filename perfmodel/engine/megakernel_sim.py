"""The megakernel timeline as loops over plain arrays: the DMA engine and the walk over the ops.

perfmodel.engine.megakernel.simulate_megakernel flattens an op graph, its weight stream and its
collective phases into the arrays `run` takes; `run_many` evaluates many ring depths / expert-slot
counts / DMA modes of the same arrays at once and returns only step times and cause totals (sweeps).

The same code runs two ways. By default as plain Python (one Kimi K3 step in about 40 ms, with no
compiler to load: a one-off prediction answers at once). `compile_loops()` compiles it with numba
(about 1 ms a step once loaded; loading numba and its cached machine code costs about 0.3 s per
process), after which `run` and `run_many` are the compiled versions; sweeps, fits and the
dashboard call it. tests/test_simulator_equivalence.py holds both to the same timelines.

The DMA engine: a copy issued at t starts at t + latency (a remote copy, a collective's, at t)
and then needs its bytes (+ a descriptor's fixed cost, as engine bytes) / bandwidth. FIFO serves
copies one after another in issue order (closed form). Shared serves the started copies at
bandwidth / (number in service), tracked with a virtual clock v (bytes served to each copy in
service): a heap of the copies' finish v, and the arrivals in issue order. With a limit K
(the chip's dma_concurrent_copies) at most K copies are in service at once, round-robin among
them, and the other started copies wait in issue order (K = 1 is FIFO).

Engine state lives in small arrays so that the functions stay plain compiled code:
  f  = [engine clock t, virtual clock v, HBM bytes issued]
  ni = [copies issued, next arrival to admit, arrivals queued]
The equivalence with the event loop this was derived from is tested to 1e-9 relative on a
random corpus (tests/test_simulator_equivalence.py).
"""
from __future__ import annotations

import heapq
import math

import numpy as np

# op kinds (set by megakernel.megakernel_arrays) and copy tags (what a copy is, for the DMA lane's labels)
PLAIN, STREAM, ROUTED, COLL, TOPK = 0, 1, 2, 3, 4
TAG_TILE, TAG_KV, TAG_TOPK, TAG_OP, TAG_WB, TAG_VEC = 0, 1, 2, 3, 4, 5
# cause totals returned by run_many, in this order
TOTALS = ("compute", "weight_streaming", "expert_fetch", "collective", "launch")


def _issue(t, nbytes, remote, tag, ref, eng, f, ni, done, pa, pi, pb, begin, tags, refs, descriptors):
    """Issue a copy of `descriptors` DMA descriptors at `t`; returns its id. eng = [bandwidth,
    latency, one descriptor's cost as bytes, shared, descriptors of a routed copy, copies in
    service at once (shared; 0: no limit)]."""
    cid = ni[0]
    ni[0] += 1
    if not remote:
        f[2] += nbytes
    start = t if remote else t + eng[1]
    if nbytes > 0:
        nbytes += eng[2] * descriptors
    if nbytes <= 0:
        done[cid] = t
    elif eng[3] > 0:
        q = ni[2]
        pa[q], pi[q], pb[q] = start, cid, nbytes
        ni[2] = q + 1
    else:
        start = max(f[0], start)
        f[0] = start + nbytes / eng[0]
        done[cid] = f[0]
    begin[cid], tags[cid], refs[cid] = start, tag, ref
    return cid


def _completion(cid, bw, cap, f, ni, done, pa, pi, pb, heap):
    """Serve copies (with the arrivals queued now) until copy `cid`, not yet complete, is; its end.
    At most `cap` copies are in service at once (0: no limit); a started copy beyond them waits, in
    issue order, for one to complete. Callers look up a copy already complete in `done` themselves
    (compiled, the check at the call site makes a step about 40 % faster than inside)."""
    t, v = f[0], f[1]
    while math.isnan(done[cid]):
        n = len(heap)
        t_next = t + (heap[0][0] - v) * n / bw if n else math.inf
        h = ni[1]
        if h < ni[2] and pa[h] <= t_next and (cap <= 0 or n < cap):
            arrival, i, b = pa[h], pi[h], pb[h]
            ni[1] = h + 1
            if arrival > t:
                if n:
                    v += (arrival - t) * bw / n
                t = arrival
            heapq.heappush(heap, (v + b, i))
        else:
            v, i = heapq.heappop(heap)
            t = t_next
            done[i] = t
    f[0], f[1] = t, v
    return done[cid]


def run(eng, t0, overhead, banks, slots, pieces, tile_bytes, tile_end, kind, layer, op_begin, op_end,
        comp, coll, kv_wait, op_fetch, layer_start, kv_copies, writeback, vectors, rc_off, rc_bytes, ph_off, ph_bytes,
        ph_time, coll_call, remote, defer, flush, tile_layer):
    """One timeline. Per op (program order): kind, layer, its byte range of the weight stream,
    compute and collective seconds, whether it waits for its layer's KV / state copy, the bytes it
    copies itself when it starts and waits for (a KV cache read without prefetch). Per layer:
    the next layer's vectors (bytes, descriptors) issued first at its start and waited for by none of
    its ops, bytes issued at its start, the descriptors of that KV / state copy (or of an op's own, kv_copies),
    the cache write-back (bytes, descriptors) its first op that reads the KV / state issues when it
    starts and its next collective waits for, its routed expert copies
    rc_bytes[rc_off[l]:rc_off[l+1]] (each streamed in `pieces` equal copies through `slots` buffers).
    Per collective op: the entry cost and its phases (remote-copy bytes and phase seconds)
    ph_*[ph_off[j]:ph_off[j+1]], used when `remote` (else its `coll` seconds). At most one routed op
    per layer (as perfmodel.graph.ops builds).
    Held-back refills: an op with `defer` keeps the refills it would issue for tiles of a later layer
    (tile_layer) until the next op with `flush`, which issues them, in order, at its end.
    Returns (start, end, stream wait, expert wait, collective time per op, step end, HBM bytes,
    and per copy: start of service, completion, tag, reference)."""
    n, n_tiles, n_layers = len(kind), len(tile_bytes), len(layer_start)
    bw, cap = eng[0], eng[5]
    total = tile_end[n_tiles - 1] if n_tiles else 0.0
    max_copies = n_tiles + 3 * n_layers + len(ph_bytes) + rc_off[n_layers] * pieces + n
    f = np.zeros(3)
    ni = np.zeros(3, np.int64)
    done = np.full(max_copies, np.nan)
    pa, pb = np.empty(max_copies), np.empty(max_copies)
    pi = np.empty(max_copies, np.int64)
    begin = np.empty(max_copies)
    tags = np.empty(max_copies, np.int8)
    refs = np.empty(max_copies, np.int64)
    heap = [(0.0, np.int64(0))]
    heap.pop()
    start, end = np.zeros(n), np.zeros(n)
    stream, fetch, coll_w = np.zeros(n), np.zeros(n), np.zeros(n)
    tile_id = np.empty(n_tiles, np.int64)
    kv_id = np.full(n_layers, -1, np.int64)
    wb_id = np.full(n_layers, -1, np.int64)  # the layer's write-back: -1 not issued, -2 waited for
    expert_id = np.empty(rc_off[n_layers] * pieces, np.int64)
    issued = np.zeros(n_layers, np.int64)  # expert copies issued per layer
    held = np.empty(n_tiles, np.int64)  # refills held back (tile indices), held[:n_held]
    n_held = 0
    first = min(banks, n_tiles)
    for k in range(first):
        tile_id[k] = _issue(t0, tile_bytes[k], False, TAG_TILE, k, eng, f, ni, done, pa, pi, pb, begin, tags, refs, 1.0)
    next_tile = first
    now = t0
    for j in range(n):
        lj = layer[j]
        if kv_id[lj] < 0:  # layer start: the next layer's vectors, then its own KV cache / state
            if vectors[0, lj] > 0:
                _issue(now, vectors[0, lj], False, TAG_VEC, lj, eng, f, ni, done, pa, pi, pb, begin, tags, refs,
                       vectors[1, lj])
            kv_id[lj] = _issue(now, layer_start[lj], False, TAG_KV, lj, eng, f, ni, done, pa, pi, pb, begin,
                               tags, refs, kv_copies[lj])
        if kind[j] == COLL:
            if wb_id[lj] >= 0:  # the attention's cache write-back, waited for first
                c = wb_id[lj]
                landed = done[c] if not math.isnan(done[c]) else _completion(c, bw, cap, f, ni, done, pa, pi, pb, heap)
                now = max(now, landed)
                wb_id[lj] = -2
            t = now + coll[j]
            if remote:  # its phases' remote copies queue on this core's DMA engine
                t = now + coll_call[j]
                for p in range(ph_off[j], ph_off[j + 1]):
                    cid = _issue(t, ph_bytes[p], True, TAG_OP, j, eng, f, ni, done, pa, pi, pb, begin, tags, refs, 1.0)
                    landed = done[cid]
                    if math.isnan(landed):
                        landed = _completion(cid, bw, cap, f, ni, done, pa, pi, pb, heap)
                    t = max(t + ph_time[p], landed)
            start[j], end[j], coll_w[j] = now, t, t - now
            now = t
            continue
        ready = now
        if kv_wait[j]:
            c = kv_id[lj]
            landed = done[c] if not math.isnan(done[c]) else _completion(c, bw, cap, f, ni, done, pa, pi, pb, heap)
            ready = max(now, landed)
        if op_fetch[j] > 0:  # issued here, waited for at once
            cid = _issue(now, op_fetch[j], False, TAG_KV, lj, eng, f, ni, done, pa, pi, pb, begin, tags, refs,
                         kv_copies[lj])
            landed = done[cid] if not math.isnan(done[cid]) else _completion(cid, bw, cap, f, ni, done, pa, pi, pb, heap)
            ready = max(ready, landed)
        stream[j] = ready - now
        start[j] = ready
        if writeback[0, lj] > 0 and wb_id[lj] == -1 and (kv_wait[j] or op_fetch[j] > 0):
            wb_id[lj] = _issue(ready, writeback[0, lj], False, TAG_WB, lj, eng, f, ni, done, pa, pi, pb, begin, tags,
                               refs, writeback[1, lj])
        t = ready + overhead
        base, count = rc_off[lj] * pieces, (rc_off[lj + 1] - rc_off[lj]) * pieces
        if kind[j] == STREAM:  # consume this op's byte range of the stream, tile by tile
            lo, hi = op_begin[j], op_end[j]
            per_byte = comp[j] / (hi - lo)
            k = np.searchsorted(tile_end, lo, side="right")
            while k < n_tiles and tile_end[k] - tile_bytes[k] < hi:
                c = tile_id[k]
                arrive = done[c] if not math.isnan(done[c]) else _completion(c, bw, cap, f, ni, done, pa, pi, pb, heap)
                if arrive > t:
                    stream[j] += arrive - t
                    t = arrive
                t += per_byte * (min(hi, tile_end[k]) - max(lo, tile_end[k] - tile_bytes[k]))
                if (hi >= tile_end[k] or hi >= total) and next_tile < n_tiles:  # consumed: refill its bank
                    if defer[j] and tile_layer[next_tile] > lj:
                        held[n_held] = next_tile
                        n_held += 1
                    else:
                        tile_id[next_tile] = _issue(t, tile_bytes[next_tile], False, TAG_TILE, next_tile, eng, f,
                                                    ni, done, pa, pi, pb, begin, tags, refs, 1.0)
                    next_tile += 1
                k += 1
        elif kind[j] == ROUTED:  # experts: fetched into slots once the router has picked them
            step = comp[j] / max(1, count)
            if issued[lj] == 0:
                for e in range(min(slots, count)):
                    expert_id[base + e] = _issue(t, rc_bytes[rc_off[lj] + e // pieces] / pieces, False, TAG_OP, j,
                                                 eng, f, ni, done, pa, pi, pb, begin, tags, refs, max(1.0, eng[4] / pieces))
                issued[lj] = min(slots, count)
            for e in range(count):
                c = expert_id[base + e]
                arrive = done[c] if not math.isnan(done[c]) else _completion(c, bw, cap, f, ni, done, pa, pi, pb, heap)
                if arrive > t:
                    fetch[j] += arrive - t
                    t = arrive
                t += step
                if e + slots < count:
                    expert_id[base + e + slots] = _issue(t, rc_bytes[rc_off[lj] + (e + slots) // pieces] / pieces,
                                                         False, TAG_OP, j, eng, f, ni, done, pa, pi, pb, begin,
                                                         tags, refs, max(1.0, eng[4] / pieces))
        else:
            t += comp[j]
            if kind[j] == TOPK:  # routing known: fetch the first experts now
                for e in range(min(slots, count)):
                    expert_id[base + e] = _issue(t, rc_bytes[rc_off[lj] + e // pieces] / pieces, False, TAG_TOPK,
                                                 lj, eng, f, ni, done, pa, pi, pb, begin, tags, refs, max(1.0, eng[4] / pieces))
                issued[lj] = min(slots, count)
        if flush[j]:  # issue the refills held back, in their order
            for h in range(n_held):
                tile_id[held[h]] = _issue(t, tile_bytes[held[h]], False, TAG_TILE, held[h], eng, f, ni, done, pa,
                                          pi, pb, begin, tags, refs, 1.0)
            n_held = 0
        end[j] = t
        now = t
    n_copies = ni[0]
    for i in range(n_copies):  # complete the copies still in flight (the DMA lane)
        if math.isnan(done[i]):
            _completion(i, bw, cap, f, ni, done, pa, pi, pb, heap)
    return (start, end, stream, fetch, coll_w, now, f[2], begin[:n_copies], done[:n_copies], tags[:n_copies],
            refs[:n_copies])


def run_many(eng, t0, overhead, banks, slots, pieces, shared, tile_bytes, tile_end, kind, layer, op_begin, op_end,
             comp, coll, kv_wait, op_fetch, layer_start, kv_copies, writeback, vectors, rc_off, rc_bytes, ph_off,
             ph_bytes, ph_time, coll_call, remote, defer, flush, tile_layer):
    """`run` for each (banks[i], slots[i], pieces[i], shared[i]) on the same arrays: step seconds
    HBM bytes and the cause totals (TOTALS) per configuration: shapes (m,), (m,), (m, 5)."""
    m = len(banks)
    steps, hbm, totals = np.empty(m), np.empty(m), np.empty((m, len(TOTALS)))
    comp_total, launch = 0.0, t0
    for j in range(len(kind)):
        if kind[j] != COLL:
            comp_total += comp[j]
            launch += overhead
    for i in range(m):
        e = eng.copy()
        e[3] = shared[i]
        out = run(e, t0, overhead, banks[i], slots[i], pieces[i], tile_bytes, tile_end, kind, layer, op_begin,
                  op_end, comp, coll, kv_wait, op_fetch, layer_start, kv_copies, writeback, vectors, rc_off, rc_bytes,
                  ph_off, ph_bytes, ph_time, coll_call, remote, defer, flush, tile_layer)
        steps[i], hbm[i] = out[5], out[6]
        totals[i, 0] = comp_total
        totals[i, 1] = out[2].sum()
        totals[i, 2] = out[3].sum()
        totals[i, 3] = out[4].sum()
        totals[i, 4] = launch
    return steps, hbm, totals


_JIT = {"_issue": {"inline": "always"}, "_completion": {"inline": "always"}, "run": {}, "run_many": {}}


def compile_loops() -> None:
    """Replace this module's loops by their numba-compiled versions (machine code cached on disk
    beside the module, so later processes load it rather than compile). Idempotent; callees are
    compiled before their callers, which numba resolves through the module's globals."""
    g = globals()
    if is_compiled():
        return
    from numba import njit
    for name, options in _JIT.items():
        g[name] = njit(cache=True, error_model="numpy", **options)(g[name])


def is_compiled() -> bool:
    return hasattr(run, "py_func")
