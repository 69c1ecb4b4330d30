"""In-kernel collectives of the megakernel over the tensor-parallel mesh axis, written with
remote DMAs (`pltpu.make_async_remote_copy`) and DMA semaphores.

Safety. Before its first remote write a call meets every peer at a barrier (each device
signals every peer's barrier semaphore once and waits for tp - 1 signals; the semaphore comes
from the kernel's `collective_id`), so no device writes into the VMEM of a peer that has not
entered the kernel yet (whose VMEM may still belong to the previous program). Every device
runs the same collectives in the same order. An exchange within a group (n members) sends one
message to each other member (a remote copy into slot `my position` of the peer's receive
buffer) and waits for its sends and for the n - 1 messages it receives. Each kind of group has
its own receive buffers, double buffered by the parity of that kind's exchange count: a device
reuses a parity's buffer only two exchanges of the same kind later, when the group's members
have consumed it (they send the intermediate exchange's messages only after reading theirs).
The counts are carried from call to call (an SMEM input aliased to an output), so the first
exchange of a call never lands in the buffer the last exchange of the previous call used.

Wire format (`Wire`): a message packs the real token rows of a [bp, w] value densely into one
[R, L] tile-aligned block (R = 16 rows of bf16 or 8 of f32): with n' = the next power of two
>= the rows, row i's w values fill rows i*f .. i*f + f - 1 (f = R / n') of L = w / f lanes
(rounded up to 128). One row of 7168 values is a [16, 512] bf16 message (16 KiB), not 8 padded
rows. Reductions travel in `KernelConfig.wire` (f32 by default: exact partial sums, so a mesh
matches the one-device reference; bf16 halves the bytes, as the analytic model counts them and
as Inferact's kernel sends them, at the price of one bf16 rounding of every partial sum);
gathers in f32, except values that are bf16 already (embedding rows) or only feed bf16 dots
(the latent projection).

Groups: the whole axis; the same-core plane (devices 2k + c); the sibling pair (2k, 2k + 1);
the host (`host_devices` consecutive devices) and the same position across hosts.
All-reduce algorithms (`perfmodel.graph.ops.kernel_all_reduce` picks one from the model's
`[megakernel] shard_collective_rows`, so the model and the kernel cannot disagree):
- one_shot: every device sends its whole value to every other member of its host and sums;
  across hosts the host sums go the same way to the same position of every host;
- rs_ag: reduce-scatter (member k sums chunk k) + all-gather of the chunks;
- hierarchical: the sibling core first, then rs_ag over the same-core plane.
Every exchange records itself for the DMA plan (`Dma.note("exchange", ...)`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from perfmodel.graph.ops import kernel_all_reduce

from . import chip, shard

AXIS = "tp"
F32, BF16 = jnp.float32, jnp.bfloat16
WIRE = {"f32": F32, "bf16": BF16}
AXIS_K, PLANE, SIBLING, HOST, ACROSS = range(5)   # kinds of group
KINDS = ("axis", "plane", "sibling", "host", "across hosts")


def _lanes(w: int) -> int:
    return -(-w // 128) * 128


@dataclass(frozen=True)
class Wire:
    """The dense [rows, lanes] block that carries `n` token rows of width w in `dtype`."""
    n: int
    w: int
    dtype: object

    @property
    def sub(self) -> int:
        return chip.tile_rows(jnp.dtype(self.dtype))

    @property
    def fold(self) -> int:
        p = 1 << max(0, (self.n - 1).bit_length())   # next power of two >= n
        return max(1, self.sub // p)

    @property
    def padded_rows(self) -> int:
        """Token rows a message carries (the real ones and padding): the next power of two."""
        return self.sub // self.fold if self.fold > 1 else self.rows

    @property
    def rows(self) -> int:
        return max(self.sub, -(-self.n // self.sub) * self.sub) if self.fold == 1 else self.sub

    @property
    def lanes(self) -> int:
        return _lanes(math.ceil(self.w / self.fold))

    @property
    def bytes(self) -> int:
        return self.rows * self.lanes * jnp.dtype(self.dtype).itemsize

    def pack(self, x):
        """x [bp, w] f32 -> [rows, lanes] in the wire dtype (rows past n are zero)."""
        f, lanes = self.fold, self.lanes
        if f == 1:
            x = _pad(x[:min(x.shape[0], self.rows)], self.rows, lanes)
            return x.astype(self.dtype)
        row = lax.broadcasted_iota(jnp.int32, (self.rows, lanes), 0)
        out = jnp.zeros((self.rows, lanes), F32)
        for i in range(self.n):
            for q in range(min(f, -(-self.w // lanes))):   # the pieces that hold values
                piece = _pad(x[i:i + 1, q * lanes:min((q + 1) * lanes, self.w)], 1, lanes)
                out = jnp.where(row == i * f + q, jnp.broadcast_to(piece, out.shape), out)
        return out.astype(self.dtype)

    def unpack(self, m, bp: int):
        """[rows, lanes] -> [bp, w] f32 (rows past n zero)."""
        m = m.astype(F32)
        if self.fold == 1:
            return _pad(m[:min(bp, self.rows)], bp, self.lanes)[:, :self.w]
        row = lax.broadcasted_iota(jnp.int32, (bp, self.w), 0)
        out = jnp.zeros((bp, self.w), F32)
        for i in range(self.n):
            pieces = [m[i * self.fold + q:i * self.fold + q + 1]
                      for q in range(min(self.fold, -(-self.w // self.lanes)))]
            r = (jnp.concatenate(pieces, axis=1) if len(pieces) > 1 else pieces[0])[:, :self.w]
            out = jnp.where(row == i, jnp.broadcast_to(r, out.shape), out)
        return out


def _pad(x, rows: int, lanes: int):
    r, c = x.shape
    if c < lanes:
        x = jnp.concatenate([x, jnp.zeros((r, lanes - c), x.dtype)], axis=1)
    if r < rows:
        x = jnp.concatenate([x, jnp.zeros((rows - r, lanes), x.dtype)], axis=0)
    return x


def group(kind: int, tp: int, me, host: int):
    """(members n, my position, member(k) -> mesh index) of my group of `kind`; `me` an int or
    a traced scalar. host: devices per host (the host and across-hosts groups)."""
    if kind == AXIS_K:
        return tp, me, lambda k: k
    if kind == PLANE:
        return tp // 2, me // 2, lambda k: 2 * k + me % 2
    if kind == SIBLING:
        return 2, me % 2, lambda k: 2 * (me // 2) + k
    if kind == HOST:
        return host, me % host, lambda k: host * (me // host) + k
    return tp // host, me // host, lambda k: host * k + me % host


def algorithm(spec, cfg) -> str:
    """The all-reduce algorithm of this spec and configuration, as the model file's
    `[megakernel]` table says (`perfmodel.graph.ops.kernel_all_reduce`: its `all_reduce`, else
    one_shot where `shard_collective_rows` excludes the step's token rows); where it says
    nothing, rs_ag (hierarchical with cfg.hierarchical). Hierarchical needs an even tp."""
    alg = kernel_all_reduce(spec, cfg.token_rows) or \
        ("hierarchical" if cfg.hierarchical else "rs_ag")
    return "rs_ag" if alg == "hierarchical" and getattr(spec, "tp", 1) % 2 else alg


def host_size(cfg, tp: int) -> int:
    """Devices per host for the two-level one-shot (the whole axis when cfg.host_devices is 0 or
    does not divide tp)."""
    h = cfg.host_devices
    return h if 0 < h < tp and tp % h == 0 else tp


@dataclass(frozen=True)
class Exchange:
    """One kind of message a kernel sends: group kind, wire, distinct pieces per member."""
    kind: int
    wire: Wire
    scatter: bool


class Comm:
    """Collectives of one kernel invocation. me_ref (SMEM [1]): this device's index on the mesh
    axis; buffers: {(kind, dtype name): (send [pieces, R, L], recv [2, n, R, L])} VMEM; sems DMA
    [2, 5, 2] (send / receive, kind, parity); counter SMEM [5] (exchanges per kind, carried
    across calls)."""

    def __init__(self, tp, me_ref, buffers, sems, counter, cfg, spec, dma):
        self.tp, self.me_ref, self.buffers, self.sems = tp, me_ref, buffers, sems
        self.counter, self.alg, self.host = counter, algorithm(spec, cfg), host_size(cfg, tp)
        self.rows, self.wire, self.dma = cfg.token_rows, WIRE[cfg.wire], dma

    def barrier(self, skip: bool = False):
        """Meet every peer before the first remote write of the call (`skip`: test only)."""
        if self.tp == 1 or skip:
            return
        sem, me = pltpu.get_barrier_semaphore(), self.me_ref[0]
        for k in range(self.tp):
            pl.when(k != me)(lambda k=k: pl.semaphore_signal(sem, 1, device_id={AXIS: k}))
        pl.semaphore_wait(sem, self.tp - 1)

    def _exchange(self, messages, kind, wire, name, what, reduce=False):
        """Send messages[k] ([R, L] in the wire dtype; one message: the same to all) to member
        k of my group of `kind`. Returns the n messages meant for me in member order (mine
        included) as f32, or with reduce=True their sum, added in member order (the same bits
        on every member)."""
        n, pos, member = group(kind, self.tp, self.me_ref[0], self.host)
        send, recv = self.buffers[(kind, jnp.dtype(wire.dtype).name)]
        par = self.counter[kind] % 2
        r, l = wire.rows, wire.lanes
        for k, m in enumerate(messages):
            send[k, :r, :l] = m
        self.dma.note("exchange", name=name, kind=kind, nbytes=wire.bytes, what=what)

        def copy(k, slot):   # my message for member k into its slot `slot`
            src = send.at[k if len(messages) > 1 else 0, pl.ds(0, r), pl.ds(0, l)]
            return pltpu.make_async_remote_copy(
                src, recv.at[par, slot, pl.ds(0, r), pl.ds(0, l)], self.sems.at[0, kind, par],
                self.sems.at[1, kind, par], device_id={AXIS: member(k)})

        def each(fn):
            def body(k, carry):
                pl.when(k != pos)(lambda: fn(k))
                return carry
            lax.fori_loop(0, n, body, 0)

        if len(messages) > 1:   # distinct messages: member k's is static piece k
            for k in range(n):
                pl.when(k != pos)(lambda k=k: copy(k, pos).start())
        else:
            each(lambda k: copy(k, pos).start())

        def done(k):
            copy(k, pos).wait_send()
            copy(k, k).wait_recv()   # member k's message for me lands in my slot k
        each(done)
        mine = messages[0] if len(messages) == 1 else \
            sum(jnp.where(k == pos, m.astype(F32), 0.0) for k, m in enumerate(messages))
        mine = mine.astype(F32)
        self.counter[kind] += 1
        if reduce:
            return lax.fori_loop(0, n, lambda k, acc: acc + jnp.where(
                k == pos, mine, recv[par, k, :r, :l].astype(F32)), jnp.zeros((r, l), F32))
        return [jnp.where(k == pos, mine, recv[par, k, :r, :l].astype(F32)) for k in range(n)]

    def all_gather(self, x, name, kind=AXIS_K, dtype=F32, what="all_gather"):
        """x [bp, w] -> [bp, n*w] in member order."""
        if self.tp == 1:
            return x
        wire = Wire(self.rows, x.shape[1], dtype)
        got = self._exchange([wire.pack(x)], kind, wire, name, what)
        return jnp.concatenate([wire.unpack(g, x.shape[0]) for g in got], axis=1)

    def reduce_scatter(self, x, name, kind=AXIS_K, what="reduce_scatter"):
        """x [bp, w], w split into n chunks of ceil(w/n) (zero-padded): my chunk's sum over the
        group, summed in member order (the same bits on every member)."""
        if self.tp == 1:
            return x
        n = group(kind, self.tp, self.me_ref[0], self.host)[0]
        c = math.ceil(x.shape[1] / n)
        x = _pad(x, x.shape[0], c * n)
        wire = Wire(self.rows, c, self.wire)
        got = self._exchange([wire.pack(x[:, k * c:(k + 1) * c]) for k in range(n)], kind,
                             wire, name, what, reduce=True)
        return wire.unpack(got, x.shape[0])

    def _one_shot(self, x, name, kind):
        wire = Wire(self.rows, x.shape[1], self.wire)
        got = self._exchange([wire.pack(x)], kind, wire, name, "all_reduce one_shot", True)
        return wire.unpack(got, x.shape[0])

    def all_reduce(self, x, name):
        """The sum of x [bp, w] over the axis, by this kernel's algorithm."""
        if self.tp == 1:
            return x
        w = x.shape[1]
        if self.alg == "one_shot":
            x = self._one_shot(x, name, HOST if self.host < self.tp else AXIS_K)
            return self._one_shot(x, name, ACROSS) if self.host < self.tp else x
        what = f"all_reduce {self.alg}"
        if self.alg == "hierarchical":
            wire = Wire(self.rows, w, self.wire)
            pair = wire.unpack(self._exchange([wire.pack(x)], SIBLING, wire, name, what, True),
                               x.shape[0])
            if self.tp == 2:
                return pair
            return self.all_gather(self.reduce_scatter(pair, name, PLANE, what), name, PLANE,
                                   self.wire, what)[:, :w]
        return self.all_gather(self.reduce_scatter(x, name, AXIS_K, what), name, AXIS_K,
                               self.wire, what)[:, :w]

    def my_chunk(self, x, n: int):
        """Chunk `me` of x [bp, w] cut into n chunks of w / n (static slices, selected)."""
        c, me = x.shape[1] // n, self.me_ref[0]
        return sum(jnp.where(me == k, x[:, k * c:(k + 1) * c], 0.0) for k in range(n))


def exchanges(spec, cfg, widths: dict[str, list[int]], tp: int) -> list[Exchange]:
    """Every kind of message the kernel sends (to size its buffers), from the widths
    {"gather_f32", "gather_bf16": all-gathered; "reduce": all-reduced; "scatter":
    reduce-scattered}."""
    alg, host, n = algorithm(spec, cfg), host_size(cfg, tp), cfg.token_rows
    wire = lambda w: Wire(n, w, WIRE[cfg.wire])
    out = [Exchange(AXIS_K, Wire(n, w, F32), False) for w in widths["gather_f32"]]
    out += [Exchange(AXIS_K, Wire(n, w, BF16), False) for w in widths["gather_bf16"]]
    out += [Exchange(AXIS_K, wire(math.ceil(w / tp)), True) for w in widths["scatter"]]
    for w in widths["reduce"]:
        if alg == "one_shot":
            out.append(Exchange(HOST if host < tp else AXIS_K, wire(w), False))
            out += [Exchange(ACROSS, wire(w), False)] if host < tp else []
            continue
        k, m = (PLANE, tp // 2) if alg == "hierarchical" else (AXIS_K, tp)
        out += [Exchange(k, wire(math.ceil(w / m)), True), Exchange(k, wire(math.ceil(w / m)),
                                                                    False)]
        out += [Exchange(SIBLING, wire(w), False)] if alg == "hierarchical" else []
    return out


def buffer_shapes(spec, cfg, widths, tp: int) -> dict[tuple[int, str], tuple[tuple, tuple]]:
    """{(kind, dtype name): (send shape [pieces, R, L], receive shape [2, n, R, L])}."""
    host = host_size(cfg, tp)
    out: dict = {}
    for e in exchanges(spec, cfg, widths, tp):
        n = group(e.kind, tp, 0, host)[0]
        key = (e.kind, jnp.dtype(e.wire.dtype).name)
        (p, r, l), _ = out.get(key, ((1, 8, 128), None))
        p, r, l = max(p, n if e.scatter else 1), max(r, e.wire.rows), max(l, e.wire.lanes)
        out[key] = ((p, r, l), (2, n, r, l))
    return out


def collective_widths(spec, cfg) -> dict[str, list[int]]:
    """The widths the kernel gathers (f32, bf16), all-reduces and reduce-scatters
    (`comm.buffer_shapes`)."""
    tp = getattr(spec, "tp", 1)
    f32 = [2] + [mm.d_out for l in spec.layers for mm in spec.layer_matmuls(l)
                 if mm.name in shard.GATHERED and mm.name != "latent_down"]
    bf16 = [spec.hidden // tp]
    lat = spec.moe.latent_dim if spec.moe and spec.count(ffn="moe") else 0
    bf16 += [lat // tp] if lat else []
    one_shot = algorithm(spec, cfg) == "one_shot"
    return {"gather_f32": sorted(set(f32)), "gather_bf16": sorted(set(bf16)),
            "reduce": [spec.hidden] + ([lat] if lat and one_shot else []),
            "scatter": [lat] if lat and not one_shot else []}
