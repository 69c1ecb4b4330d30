"""The megakernel timeline as loops over plain arrays: the DMA engine and the walk over the ops.

perfmodel.engine.megakernel.simulate_megakernel flattens an op graph, its weight stream and its
collective phases into the arrays `run` takes; `run_many` evaluates many ring depths / expert-slot
counts / DMA modes of the same arrays at once and returns only step times and cause totals (sweeps).

The same code runs two ways (`loops`). By default compiled with numba, its machine code cached on
disk once per install (`make setup` compiles it): one Kimi K3 step in about 0.2 ms, after a
first call in the process that loads numba and the cached code (about 0.5 s). Or as plain Python
(one Kimi K3 step in about 13 ms, nothing to load): PERFMODEL_LOOPS=python, or `expect(layer_steps)`
from a caller whose work is too small to pay for the load (a one-off command).
tests/test_simulator_equivalence.py holds both to the same timelines.

The DMA engine: a copy issued at t starts at t + latency (a remote copy, a collective's, at t)
and then needs its bytes (+ a descriptor's fixed cost, as engine bytes) / bandwidth. FIFO serves
copies one after another in issue order (closed form). Shared serves the started copies at
bandwidth / (number in service), tracked with a virtual clock v (bytes served to each copy in
service): a heap of the copies' finish v, and the arrivals in issue order. With a limit K
(the chip's dma_concurrent_copies) at most K copies are in service at once, round-robin among
them, and the other started copies wait in issue order (K = 1 is FIFO).

Engine state lives in small arrays so that the functions stay plain compiled code:
  f  = [engine clock t, virtual clock v, HBM bytes issued]
  ni = [copies issued, next arrival to admit, arrivals queued, copies in service]
  F  = per copy (float64 rows): completion (NaN until known), queued arrival time and bytes,
       start of service, and the heap of copies in service (its keys)
  I  = per copy (int64 rows): the queued copy's id, tag, reference, and the heap's copy ids
Two state arrays rather than one per field: a compiled call pays an atomic reference count per
array argument, which with ten arrays cost most of a step.
The equivalence with the event loop this was derived from is tested to 1e-9 relative on a
random corpus (tests/test_simulator_equivalence.py).
"""
from __future__ import annotations

import math
import os
import sys

import numpy as np

from perfmodel.util.errors import SpecError

# op kinds (set by megakernel.megakernel_arrays) and copy tags (what a copy is, for the DMA lane's labels)
PLAIN, STREAM, ROUTED, COLL, TOPK = 0, 1, 2, 3, 4
TAG_TILE, TAG_KV, TAG_TOPK, TAG_OP, TAG_WB, TAG_VEC = 0, 1, 2, 3, 4, 5
# cause totals returned by run_many, in this order
TOTALS = ("compute", "weight_streaming", "expert_fetch", "collective", "launch")
# rows of the per-copy state arrays F (float64) and I (int64)
DONE, ARRIVAL, SIZE, BEGIN, HEAP = 0, 1, 2, 3, 4
QUEUED, TAG, REF, HEAP_ID = 0, 1, 2, 3


def _view(a):
    """An array as the loops index it element by element. Plain Python: a memoryview, whose
    elements are Python floats and ints (a third faster to index than numpy's scalars, and several
    times faster to compute with). Compiled: the array itself (numba compiles `_same` instead)."""
    return memoryview(a)


def _same(a):
    return a


def _issue(t, nbytes, remote, tag, ref, eng, f, ni, F, I, descriptors):
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
        F[DONE, cid] = t
    elif eng[3] > 0:
        q = ni[2]
        F[ARRIVAL, q], I[QUEUED, q], F[SIZE, q] = start, cid, nbytes
        ni[2] = q + 1
    else:
        start = max(f[0], start)
        f[0] = start + nbytes / eng[0]
        F[DONE, cid] = f[0]
    F[BEGIN, cid], I[TAG, cid], I[REF, cid] = start, tag, ref
    return cid


def _completion(cid, bw, cap, f, ni, F, I):
    """Serve copies (with the arrivals queued now) until copy `cid`, not yet complete, is; its end.
    At most `cap` copies are in service at once (0: no limit); a started copy beyond them waits, in
    issue order, for one to complete. Callers look up a copy already complete in F[DONE] themselves
    (compiled, the check at the call site makes a step about 40 % faster than inside). The copies
    in service are a binary heap of (finish v, copy id) in F[HEAP] / I[HEAP_ID][:ni[3]]."""
    t, v = f[0], f[1]
    while math.isnan(F[DONE, cid]):
        n = ni[3]
        t_next = t + (F[HEAP, 0] - v) * n / bw if n else math.inf
        h = ni[1]
        if h < ni[2] and F[ARRIVAL, h] <= t_next and (cap <= 0 or n < cap):
            arrival, i, b = F[ARRIVAL, h], I[QUEUED, h], F[SIZE, h]
            ni[1] = h + 1
            if arrival > t:
                if n:
                    v += (arrival - t) * bw / n
                t = arrival
            key = v + b  # sift up
            j = n
            while j > 0:
                p = (j - 1) >> 1
                if F[HEAP, p] < key or (F[HEAP, p] == key and I[HEAP_ID, p] < i):
                    break
                F[HEAP, j], I[HEAP_ID, j] = F[HEAP, p], I[HEAP_ID, p]
                j = p
            F[HEAP, j], I[HEAP_ID, j] = key, i
            ni[3] = n + 1
        else:
            v, done_id = F[HEAP, 0], I[HEAP_ID, 0]
            n -= 1  # the last entry sifted down from the root
            key, i = F[HEAP, n], I[HEAP_ID, n]
            j = 0
            while True:
                c = 2 * j + 1
                if c >= n:
                    break
                if c + 1 < n and (F[HEAP, c + 1] < F[HEAP, c] or
                                  (F[HEAP, c + 1] == F[HEAP, c] and I[HEAP_ID, c + 1] < I[HEAP_ID, c])):
                    c += 1
                if key < F[HEAP, c] or (key == F[HEAP, c] and i < I[HEAP_ID, c]):
                    break
                F[HEAP, j], I[HEAP_ID, j] = F[HEAP, c], I[HEAP_ID, c]
                j = c
            F[HEAP, j], I[HEAP_ID, j] = key, i
            ni[3] = n
            t = t_next
            F[DONE, done_id] = t
    f[0], f[1] = t, v
    return F[DONE, cid]


def _run(eng, t0, overhead, banks, slots, pieces, tile_bytes, tile_end, kind, layer, op_begin, op_end,
        comp, coll, kv_wait, op_fetch, layer_start, kv_copies, writeback, vectors, rc_off, rc_bytes, ph_off, ph_bytes,
        ph_time, coll_call, remote, defer, flush, tile_layer):
    """One timeline. Per op (program order): kind, layer, its byte range of the weight stream,
    compute and collective seconds, whether it waits for its layer's KV / state copy, the bytes it
    copies itself when it starts and waits for (a KV cache read without prefetch). Per layer:
    the next layer's vectors (bytes, descriptors) issued first at its start and waited for by none of
    its ops, bytes issued at its start, the descriptors of that KV / state copy (or of an op's own, kv_copies),
    the cache write-back (bytes, descriptors, and the op whose end waits for it or -1) its first op
    that reads the KV / state issues when it starts and that op, else its next collective, waits
    for, its routed expert copies
    rc_bytes[rc_off[l]:rc_off[l+1]] (each streamed in `pieces` equal copies through `slots` buffers).
    Per collective op: the entry cost and its phases (remote-copy bytes and phase seconds)
    ph_*[ph_off[j]:ph_off[j+1]], used when `remote` (else its `coll` seconds). At most one routed op
    per layer (as perfmodel.graph.ops builds).
    The first layer's copies (its vectors and its start copy: a kernel plan's embedding rows) are
    issued before the ring's first banks, as the kernel does; layer 0's ops wait for them (kv_wait).
    Held-back refills: an op with `defer` keeps the refills it would issue for tiles of a later layer
    (tile_layer) until the next op with `flush`, which issues them, in order, at its end.
    Returns (start, end, stream wait, expert wait, collective time per op, step end, HBM bytes,
    and per copy: start of service, completion, tag, reference)."""
    n, n_tiles, n_layers = len(kind), len(tile_bytes), len(layer_start)
    max_copies = n_tiles + 3 * n_layers + len(ph_bytes) + rc_off[n_layers] * pieces + n
    F = np.empty((5, max_copies))
    F[DONE] = np.nan
    # every array read or written element by element through _view (plain Python: a memoryview,
    # whose elements are Python numbers; compiled: the array itself)
    f, ni = _view(np.zeros(3)), _view(np.zeros(4, np.int64))
    F, I = _view(F), _view(np.empty((4, max_copies), np.int64))
    start, end = _view(np.zeros(n)), _view(np.zeros(n))
    stream, fetch, coll_w = _view(np.zeros(n)), _view(np.zeros(n)), _view(np.zeros(n))
    tile_id = _view(np.empty(n_tiles, np.int64))
    kv_id = _view(np.full(n_layers, -1, np.int64))
    wb_id = _view(np.full(n_layers, -1, np.int64))  # the layer's write-back: -1 not issued, -2 waited for
    expert_id = _view(np.empty(rc_off[n_layers] * pieces, np.int64))
    issued = _view(np.zeros(n_layers, np.int64))  # expert copies issued per layer
    held = _view(np.empty(n_tiles, np.int64))  # refills held back (tile indices), held[:n_held]
    eng, tile_bytes, kind, layer, op_begin, op_end = (_view(eng), _view(tile_bytes), _view(kind), _view(layer),
                                                      _view(op_begin), _view(op_end))
    comp, coll, kv_wait, op_fetch = _view(comp), _view(coll), _view(kv_wait), _view(op_fetch)
    layer_start = _view(layer_start)
    kv_copies, writeback, vectors, rc_off, rc_bytes = (_view(kv_copies), _view(writeback), _view(vectors), _view(rc_off),
                                                       _view(rc_bytes))
    ph_off, ph_bytes, ph_time, coll_call = _view(ph_off), _view(ph_bytes), _view(ph_time), _view(coll_call)
    defer, flush, tile_layer, ends = _view(defer), _view(flush), _view(tile_layer), _view(tile_end)
    bw, cap = eng[0], eng[5]
    total = ends[n_tiles - 1] if n_tiles else 0.0
    n_held = 0
    if n:  # the first layer's copies go ahead of the ring's first banks, as the kernel issues them
        l0 = layer[0]
        if vectors[0, l0] > 0:
            _issue(t0, vectors[0, l0], False, TAG_VEC, l0, eng, f, ni, F, I, vectors[1, l0])
        kv_id[l0] = _issue(t0, layer_start[l0], False, TAG_KV, l0, eng, f, ni, F, I, kv_copies[l0])
    first = min(banks, n_tiles)
    for k in range(first):
        tile_id[k] = _issue(t0, tile_bytes[k], False, TAG_TILE, k, eng, f, ni, F, I, 1.0)
    next_tile = first
    now = t0
    for j in range(n):
        lj = layer[j]
        if kv_id[lj] < 0:  # layer start: the next layer's vectors, then its own KV cache / state
            if vectors[0, lj] > 0:
                _issue(now, vectors[0, lj], False, TAG_VEC, lj, eng, f, ni, F, I,
                       vectors[1, lj])
            kv_id[lj] = _issue(now, layer_start[lj], False, TAG_KV, lj, eng, f, ni, F, I, kv_copies[lj])
        if kind[j] == COLL:
            if wb_id[lj] >= 0:  # the attention's cache write-back, waited for first
                c = wb_id[lj]
                landed = F[DONE, c] if not math.isnan(F[DONE, c]) else _completion(c, bw, cap, f, ni, F, I)
                now = max(now, landed)
                wb_id[lj] = -2
            t = now + coll[j]
            if remote:  # its phases' remote copies queue on this core's DMA engine
                t = now + coll_call[j]
                for p in range(ph_off[j], ph_off[j + 1]):
                    cid = _issue(t, ph_bytes[p], True, TAG_OP, j, eng, f, ni, F, I, 1.0)
                    landed = F[DONE, cid]
                    if math.isnan(landed):
                        landed = _completion(cid, bw, cap, f, ni, F, I)
                    t = max(t + ph_time[p], landed)
            start[j], end[j], coll_w[j] = now, t, t - now
            now = t
            continue
        ready = now
        if kv_wait[j]:
            c = kv_id[lj]
            landed = F[DONE, c] if not math.isnan(F[DONE, c]) else _completion(c, bw, cap, f, ni, F, I)
            ready = max(now, landed)
        if op_fetch[j] > 0:  # issued here, waited for at once
            cid = _issue(now, op_fetch[j], False, TAG_KV, lj, eng, f, ni, F, I,
                         kv_copies[lj])
            landed = F[DONE, cid] if not math.isnan(F[DONE, cid]) else _completion(cid, bw, cap, f, ni, F, I)
            ready = max(ready, landed)
        stream[j] = ready - now
        start[j] = ready
        if writeback[0, lj] > 0 and wb_id[lj] == -1 and (kv_wait[j] or op_fetch[j] > 0):
            wb_id[lj] = _issue(ready, writeback[0, lj], False, TAG_WB, lj, eng, f, ni, F, I, writeback[1, lj])
        t = ready + overhead
        base, count = rc_off[lj] * pieces, (rc_off[lj + 1] - rc_off[lj]) * pieces
        if kind[j] == STREAM:  # consume this op's byte range of the stream, tile by tile
            lo, hi = op_begin[j], op_end[j]
            per_byte = comp[j] / (hi - lo)
            k = int(np.searchsorted(tile_end, lo, side="right"))
            while k < n_tiles and ends[k] - tile_bytes[k] < hi:
                c = tile_id[k]
                arrive = F[DONE, c] if not math.isnan(F[DONE, c]) else _completion(c, bw, cap, f, ni, F, I)
                if arrive > t:
                    stream[j] += arrive - t
                    t = arrive
                t += per_byte * (min(hi, ends[k]) - max(lo, ends[k] - tile_bytes[k]))
                if (hi >= ends[k] or hi >= total) and next_tile < n_tiles:  # consumed: refill its bank
                    if defer[j] and tile_layer[next_tile] > lj:
                        held[n_held] = next_tile
                        n_held += 1
                    else:
                        tile_id[next_tile] = _issue(t, tile_bytes[next_tile], False, TAG_TILE, next_tile, eng, f,
                                                    ni, F, I, 1.0)
                    next_tile += 1
                k += 1
        elif kind[j] == ROUTED:  # experts: fetched into slots once the router has picked them
            step = comp[j] / max(1, count)
            if issued[lj] == 0:
                for e in range(min(slots, count)):
                    expert_id[base + e] = _issue(t, rc_bytes[rc_off[lj] + e // pieces] / pieces, False, TAG_OP, j,
                                                 eng, f, ni, F, I, max(1.0, eng[4] / pieces))
                issued[lj] = min(slots, count)
            for e in range(count):
                c = expert_id[base + e]
                arrive = F[DONE, c] if not math.isnan(F[DONE, c]) else _completion(c, bw, cap, f, ni, F, I)
                if arrive > t:
                    fetch[j] += arrive - t
                    t = arrive
                t += step
                if e + slots < count:
                    expert_id[base + e + slots] = _issue(t, rc_bytes[rc_off[lj] + (e + slots) // pieces] / pieces,
                                                         False, TAG_OP, j, eng, f, ni, F, I, max(1.0, eng[4] / pieces))
        else:
            t += comp[j]
            if kind[j] == TOPK:  # routing known: fetch the first experts now
                for e in range(min(slots, count)):
                    expert_id[base + e] = _issue(t, rc_bytes[rc_off[lj] + e // pieces] / pieces, False, TAG_TOPK,
                                                 lj, eng, f, ni, F, I, max(1.0, eng[4] / pieces))
                issued[lj] = min(slots, count)
        if writeback[2, lj] == j and wb_id[lj] >= 0:  # the op that ends waiting for the write-back
            c = wb_id[lj]
            landed = F[DONE, c] if not math.isnan(F[DONE, c]) else _completion(c, bw, cap, f, ni, F, I)
            if landed > t:
                stream[j] += landed - t
                t = landed
            wb_id[lj] = -2
        if flush[j]:  # issue the refills held back, in their order
            for h in range(n_held):
                tile_id[held[h]] = _issue(t, tile_bytes[held[h]], False, TAG_TILE, held[h], eng, f, ni, F, I, 1.0)
            n_held = 0
        end[j] = t
        now = t
    n_copies = ni[0]
    for i in range(n_copies):  # complete the copies still in flight (the DMA lane)
        if math.isnan(F[DONE, i]):
            _completion(i, bw, cap, f, ni, F, I)
    F, I = np.asarray(F), np.asarray(I)
    return (np.asarray(start), np.asarray(end), np.asarray(stream), np.asarray(fetch), np.asarray(coll_w), now, f[2],
            F[BEGIN, :n_copies].copy(), F[DONE, :n_copies].copy(), I[TAG, :n_copies].astype(np.int8),
            I[REF, :n_copies].copy())


def _run_many(eng, t0, overhead, banks, slots, pieces, shared, tile_bytes, tile_end, kind, layer, op_begin, op_end,
             comp, coll, kv_wait, op_fetch, layer_start, kv_copies, writeback, vectors, rc_off, rc_bytes, ph_off,
             ph_bytes, ph_time, coll_call, remote, defer, flush, tile_layer):
    """`_run` for each (banks[i], slots[i], pieces[i], shared[i]) on the same arrays: step seconds
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
        out = _run(e, t0, overhead, banks[i], slots[i], pieces[i], tile_bytes, tile_end, kind, layer, op_begin,
                  op_end, comp, coll, kv_wait, op_fetch, layer_start, kv_copies, writeback, vectors, rc_off, rc_bytes,
                  ph_off, ph_bytes, ph_time, coll_call, remote, defer, flush, tile_layer)
        steps[i], hbm[i] = out[5], out[6]
        totals[i, 0] = comp_total
        totals[i, 1] = out[2].sum()
        totals[i, 2] = out[3].sum()
        totals[i, 3] = out[4].sum()
        totals[i, 4] = launch
    return steps, hbm, totals


# ----- which loops run: compiled (numba, machine code cached on disk) or plain Python -----------

MODES = ("compiled", "python")
ENV = "PERFMODEL_LOOPS"   # "python": plain loops unless a caller asks for compiled ones (compile_loops)
# layer steps (perfmodel.util.limits) whose plain-Python time equals loading the compiled loops in
# a fresh process (about 0.14 ms a layer step, Kimi K3 on TPU v7's 95 in 13.5 ms, against about
# 0.5 s: numba's import and target setup)
BREAK_EVEN_LAYER_STEPS = 3_500
_JIT = {"_view": {"inline": "always"}, "_issue": {"inline": "always"}, "_completion": {"inline": "always"},
        "_run": {}, "_run_many": {}}
_PLAIN = {name: globals()[name] for name in _JIT}
_COMPILED: dict = {}
_MODE = {"now": None}


def run(*args):
    """One timeline (`_run`), by the loops this process runs (`loops`), chosen at the first call."""
    loops()
    return _run(*args)


def run_many(*args):
    """Many configurations of one set of arrays (`_run_many`), by the loops this process runs."""
    loops()
    return _run_many(*args)


def loops(mode: str | None = None) -> str:
    """The loops `run` and `run_many` use in this process: `mode` when given; else the ones
    already chosen; else PERFMODEL_LOOPS; else compiled (plain Python where numba cannot be
    imported). Returns the mode now in use."""
    if mode is None:
        if _MODE["now"] is not None:
            return _MODE["now"]
        mode = os.environ.get(ENV) or "compiled"
        if mode not in MODES:
            raise SpecError(ENV, mode, f"must be one of {', '.join(MODES)}")
        if mode == "compiled":
            try:
                import numba  # noqa: F401
            except ImportError:
                mode = "python"
    if mode not in MODES:
        raise SpecError("loops", mode, f"must be one of {', '.join(MODES)}")
    if mode == _MODE["now"]:
        return mode
    impl = _compiled() if mode == "compiled" else _PLAIN
    g = globals()
    g.update(impl)
    g["run"], g["run_many"] = impl["_run"], impl["_run_many"]
    _MODE["now"] = mode
    return mode


def compile_loops() -> None:
    """Run the compiled loops from now on (a caller that simulates many timelines: sweeps, fits,
    the dashboard). Idempotent; the first call in a process loads numba and the machine code."""
    loops("compiled")


def expect(layer_steps: int) -> str:
    """A caller that knows how much it will simulate says so before it starts: in a process whose
    loops are not chosen yet, work below BREAK_EVEN_LAYER_STEPS runs the plain loops (a one-off
    command answers before numba would have loaded), more runs compiled ones. Returns the mode."""
    if _MODE["now"] is None and not os.environ.get(ENV) and layer_steps < BREAK_EVEN_LAYER_STEPS:
        return loops("python")
    if _MODE["now"] == "python" and layer_steps >= BREAK_EVEN_LAYER_STEPS and os.environ.get(ENV) != "python":
        return loops("compiled")
    return loops()


def is_compiled() -> bool:
    return _MODE["now"] == "compiled"


def signatures() -> dict:
    """The one signature each compiled loop is built for (so the disk cache holds one entry per
    function, and an argument of another type is an error rather than a minute of compiling)."""
    from numba import types as nt
    f8, i8, i1, b1 = nt.float64, nt.int64, nt.int8, nt.boolean
    vec, mat = (lambda t: nt.Array(t, 1, "C")), nt.Array(f8, 2, "C")
    arrays = (vec(f8), vec(f8), vec(i1), vec(i8), vec(f8), vec(f8), vec(f8), vec(f8), vec(b1), vec(f8), vec(f8),
              vec(f8), mat, mat, vec(i8), vec(f8), vec(i8), vec(f8), vec(f8), vec(f8), b1, vec(i1), vec(i1), vec(i8))
    per_config = nt.Array(i8, 1, "A")
    return {"_run": (vec(f8), f8, f8, i8, i8, i8) + arrays,
            "_run_many": (vec(f8), f8, f8, per_config, per_config, per_config, nt.Array(f8, 1, "A")) + arrays}


def _compiled() -> dict:
    """The loops compiled with numba, callees before callers (numba resolves them through this
    module's globals). numba keeps the machine code on disk: in __pycache__ beside this file, or
    in its per-user cache where that is read-only (NUMBA_CACHE_DIR sets another), so a process
    loads it rather than compiles; compiling (once per install and Python: `make setup` does it)
    takes 10 to 30 s, announced on stderr after 3 s."""
    if _COMPILED:
        return _COMPILED
    import threading   # here, beside numba (which imports it too): the plain loops need neither
    from numba import njit
    sigs = signatures()
    note = threading.Timer(3.0, lambda: print("perfmodel: compiling the simulator's loops (numba), once for this "
                                              "install and Python, 10 to 30 s ...", file=sys.stderr, flush=True))
    note.daemon = True
    note.start()
    g = globals()
    try:
        g.update(_PLAIN)
        for name, options in _JIT.items():
            fn = njit(*[sigs[name]] if name in sigs else [], cache=True, error_model="numpy", **options)
            g[name] = fn(_same if name == "_view" else _PLAIN[name])
        _COMPILED.update({name: g[name] for name in _JIT})
    finally:
        note.cancel()
        note.join()  # no thread left behind: a sweep forks its workers only from a single-threaded process
        if not _COMPILED:
            g.update(_PLAIN)
    return _COMPILED
