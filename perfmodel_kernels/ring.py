"""The static weight ring: `depth` VMEM banks of `bank_rows` x T bf16, one DMA per bank
(`RingBank`), and the reader that computes a part's grouped matmuls from its banks.

Bank g of the stream (`perfmodel_kernels.stream`) lives in slot g mod depth. At kernel start banks
0..depth-1 are issued; when the last item of bank g has been used (its dot issued) the copy of
bank g + depth is issued into the freed slot. The rule ignores layer and phase boundaries, so
the ring keeps prefetching the next layers' weights during routing, attention, the experts and
the collectives. A bank's copy size is its size class (`Stream.sizes`: full banks, and the
last bank of each part kind); g and the slot are traced scalars inside the layer loop.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from .dma import Copies
from .stream import ROW_TILE, Part, Stream, pad16

F32, BF16 = jnp.float32, jnp.bfloat16
NT = (((1,), (1,)), ((), ()))   # contract the last dims: a @ b.T


class Ring:
    """hbm [stream rows, T] bf16 (HBM); banks [depth, bank_rows, T] bf16 and sems DMA [depth]
    (VMEM); row0 and size class of every bank int32 [n_banks] (SMEM)."""

    def __init__(self, depth: int, s: Stream, hbm, banks, sems, row0, cls, dma):
        self.depth, self.s, self.n = depth, s, len(s.banks)
        self.hbm, self.banks, self.sems, self.row0, self.cls, self.dma = \
            hbm, banks, sems, row0, cls, dma

    def slot(self, g):
        return lax.rem(g, self.depth)

    def bank(self, g, rows: int) -> Copies:
        """The copy of bank g (`rows` rows: its size class) into its slot."""
        s = self.slot(g)
        row0 = pl.multiple_of(self.row0[g], ROW_TILE)   # every bank starts on a whole tile
        return Copies(f"bank {g}", (self.hbm.at[pl.ds(row0, rows)],
                                    self.banks.at[s, pl.ds(0, rows)], self.sems.at[s]))

    def start(self):
        self.dma.note("ring_start")
        for g in range(min(self.depth, self.n)):
            self.bank(g, self.s.banks[g].rows).start()

    def issue(self, g):
        """Start the copy of bank g (traced) if it exists, at its size class."""
        safe = jnp.minimum(g, self.n - 1)
        for k, rows in enumerate(self.s.sizes):
            pl.when(jnp.logical_and(g < self.n, self.cls[safe] == k))(
                lambda rows=rows: self.bank(g, rows).start())


class PartReader:
    """A part's banks, starting at global bank g0 (traced), consumed in order: `matmul(k, x)`
    computes group k, `matrix(k)` returns its weights; xs [>= chunks, bp, T] and ys
    [>= blocks, bp, T] f32 VMEM scratch hold the input's T-wide chunks and the output blocks."""

    def __init__(self, ring: Ring, part: Part, g0, xs, ys):
        self.ring, self.p, self.g0, self.xs, self.ys = ring, part, g0, xs, ys
        self.b, self.sizes = part.bank_rows, part.bank_sizes()
        self.waited = -1
        self.last = {}   # bank -> index of the last item touching it
        for n, it in enumerate(part.items):
            for j in self._banks(it):
                self.last[j] = n
        self.done = 0    # items consumed
        self.released: set[int] = set()
        ring.dma.note("part", name=part.key)

    def _banks(self, it):
        return range(it.row // self.b, (it.row + it.rows - 1) // self.b + 1)

    def _acquire(self, j: int):
        while self.waited < j:
            self.waited += 1
            self.ring.bank(self.g0 + self.waited, self.sizes[self.waited]).wait()

    def _release(self, j: int):
        """Bank j is used up: issue the bank `depth` ahead into its slot."""
        if j not in self.released:
            self.released.add(j)
            self.ring.dma.note("release", name=self.p.key, bank=j)
            self.ring.issue(self.g0 + j + self.ring.depth)

    def _release_through(self, n_item: int):
        """Release the banks whose last item is at most n_item."""
        for j, last in sorted(self.last.items()):
            if last <= n_item:
                self._release(j)

    def _rows(self, j: int, row, rows: int):
        """rows [row, row + rows) of the part (row: a multiple of the tile, maybe traced),
        inside bank j (a value)."""
        start = row - j * self.b
        if not isinstance(start, int):
            start = pl.multiple_of(start, ROW_TILE)
        return self.ring.banks[self.ring.slot(self.g0 + j), pl.ds(start, rows)]

    def _runs(self, k: int):
        """Group k's items as runs: (first item index, count) of consecutive items of one kind
        in one bank, or a single straddling block."""
        idx = [n for n, it in enumerate(self.p.items) if it.group == k]
        runs, cur = [], None
        for n in idx:
            it = self.p.items[n]
            bank = list(self._banks(it))
            key = (it.kind, bank[0]) if len(bank) == 1 else None
            if cur and key and cur[2] == key:
                cur[1] += 1
            else:
                cur = [n, 1, key]
                runs.append(cur)
        assert idx and idx[0] == self.done, "groups must be consumed in stream order"
        return [(n, c) for n, c, _ in runs]

    def matmul(self, k: int, x):
        """x [bp, d_in] f32 @ group k -> [bp, d_out] f32 (f32 accumulation)."""
        g, t = self.p.groups[k], self.p.tile
        bp, d16 = x.shape[0], pad16(g.d_in)
        xb = jnp.pad(x, ((0, 0), (0, d16 - x.shape[1]))).astype(BF16) if d16 > x.shape[1] \
            else x.astype(BF16)
        tail = jnp.zeros((bp, pad16(g.tail(t))), F32) if g.tail(t) else None   # no [bp, 0] array
        if g.tail(t):
            xt = jnp.pad(x, ((0, 0), (0, g.chunks(t) * t - x.shape[1])))
            for c in range(g.chunks(t)):
                self.xs[c] = xt[:, c * t:(c + 1) * t]
        for n0, count in self._runs(k):
            it = self.p.items[n0]
            banks = list(self._banks(it))
            if it.kind == "block" and len(banks) > 1:      # split the input at bank ends
                acc = jnp.zeros((bp, t), F32)
                for j in banks:
                    self._acquire(j)
                    a = max(it.row, j * self.b) - it.row
                    z = min(it.row + it.rows, (j + 1) * self.b) - it.row
                    acc = acc + jnp.dot(xb[:, a:z], self._rows(j, it.row + a, z - a),
                                        preferred_element_type=F32)
                    if j != banks[-1]:
                        self._release(j)
                self.ys[it.index] = acc
            elif it.kind == "block":
                j = banks[0]
                self._acquire(j)

                def body(q, carry, it=it, j=j):
                    w = self._rows(j, it.row + q * it.rows, it.rows)
                    self.ys[it.index + q] = jnp.dot(xb, w, preferred_element_type=F32)
                    return carry
                lax.fori_loop(0, count, body, 0)
            else:
                j = banks[0]
                self._acquire(j)

                def body(q, acc, it=it, j=j):
                    w = self._rows(j, it.row + q * it.rows, it.rows)
                    return acc + lax.dot_general(self.xs[it.index + q].astype(BF16), w, NT,
                                                 preferred_element_type=F32)
                tail = lax.fori_loop(0, count, body, tail)
            self._release_through(n0 + count - 1)
            self.done = n0 + count
        parts = [self.ys[j] for j in range(g.blocks(t))]
        parts += [tail[:, :g.tail(t)]] if g.tail(t) else []
        return jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]

    def matrix(self, k: int):
        """Group k's weights [d_in, d_out] as a bf16 value (its items read from the banks)."""
        g, t = self.p.groups[k], self.p.tile
        cols, chunks = [], []
        idx = [n for n, it in enumerate(self.p.items) if it.group == k]
        assert idx[0] == self.done, "groups must be consumed in stream order"
        for n in idx:
            it = self.p.items[n]
            segs, banks = [], list(self._banks(it))
            for j in banks:
                self._acquire(j)
                a = max(it.row, j * self.b)
                z = min(it.row + it.rows, (j + 1) * self.b)
                segs.append(self._rows(j, a, z - a))
                if j != banks[-1]:   # read: free its slot, or a one-bank ring waits forever
                    self._release(j)
            self._release_through(n)
            w = jnp.concatenate(segs, axis=0) if len(segs) > 1 else segs[0]
            (cols if it.kind == "block" else chunks).append(w)
        self.done = idx[-1] + 1
        if chunks:   # the tail: chunk c is [r16, T] holding input rows c*T.. transposed
            tail = jnp.concatenate(chunks, axis=1)[:g.tail(t), :g.d_in].T
            cols.append(tail)
        full = jnp.concatenate([c[:g.d_in] for c in cols], axis=1) if len(cols) > 1 else \
            cols[0][:g.d_in]
        return full

    def finish(self):
        """Every item consumed (and so every bank released)."""
        assert self.done == len(self.p.items), f"part {self.p.key} not fully consumed"
