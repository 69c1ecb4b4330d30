"""In-kernel collectives of the megakernel over the tensor-parallel mesh axis, written with
remote DMAs (`pltpu.make_async_remote_copy`) and DMA semaphores.

Every device runs the same sequence of collectives. A collective with n members sends one piece
to each other member (a remote copy into slot `my position` of the peer's receive buffer),
then waits for its sends and for the n - 1 pieces it receives. Each kind of group (the whole
axis, the same-core plane, the sibling pair) has its own receive buffers, double buffered by
the parity of that kind's exchange count (an SMEM counter): a device reuses a parity's buffer
only two exchanges of the same group later, and the group's members have then consumed it,
since they send the intermediate exchange's pieces only after reading theirs. (Buffers shared
by two kinds of group race, as the race detector showed: a member of one group can overtake
the reads of an exchange of another group it takes no part in.)

- all_gather(x [bp, w]) -> [bp, n*w] in member order (one piece per peer, each padded to 128
  lanes);
- reduce_scatter(x [bp, n*c]) -> [bp, c], the sum over members of their c-wide chunk `pos`;
- all_reduce = reduce_scatter + all_gather (w split into n chunks);
- hierarchical all_reduce: first with the sibling TensorCore of the same chip (mesh devices
  2k and 2k+1), then reduce_scatter + all_gather among the n/2 devices of the same core index.
"""
from __future__ import annotations

import math

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

AXIS = "tp"
F32 = jnp.float32


def _lanes(w: int) -> int:
    return -(-w // 128) * 128


def buffer_widths(gathered: list[int], reduced: list[int], tp: int, hierarchical: bool
                  ) -> tuple[int, int]:
    """(send width, receive slot width) in lanes that hold every collective of the kernel:
    all-gathers of the `gathered` widths, reduce-scatters / all-reduces of the `reduced`."""
    n = tp // 2 if hierarchical and tp % 2 == 0 else tp
    sends = [tp * _lanes(w) for w in gathered] + [n * _lanes(math.ceil(w / n)) for w in reduced]
    recvs = [_lanes(w) for w in gathered] + [_lanes(math.ceil(w / n)) for w in reduced]
    if n != tp:
        sends += [2 * _lanes(w) for w in reduced]
        recvs += [_lanes(w) for w in reduced]
    return max(sends + [128]), max(recvs + [128])


class Comm:
    """Collectives of one kernel invocation: me_ref (SMEM [1]) holds this device's index on the
    mesh axis; send [bp, S] and recv [6, tp, bp, R] f32 VMEM (3 group kinds x 2 parities); DMA
    semaphores sems [2, 6] (send, receive); counter SMEM [3] (exchanges per group kind)."""

    def __init__(self, tp, me_ref, send, recv, sems, counter, hierarchical=False):
        self.tp, self.me_ref, self.send, self.recv = tp, me_ref, send, recv
        self.sems, self.counter, self.hierarchical = sems, counter, hierarchical

    def _exchange(self, pieces, group):
        """Send pieces[k] (equal-width [bp, w] values) to member k of the group; returns the n
        pieces meant for me, in member order (my own passed through)."""
        n, pos, member, kind = group
        par = 2 * kind + self.counter[kind] % 2
        w = pieces[0].shape[1]
        wp = _lanes(w)
        for k, p in enumerate(pieces):
            self.send[:, k * wp:k * wp + w] = p

        def copy(k, slot):  # my piece k to member k, into its slot `slot`
            return pltpu.make_async_remote_copy(
                self.send.at[:, pl.ds(k * wp, wp)], self.recv.at[par, slot, :, pl.ds(0, wp)],
                self.sems.at[0, par], self.sems.at[1, par], device_id={AXIS: member(k)})

        for k in range(n):
            pl.when(k != pos)(lambda k=k: copy(k, pos).start())
        for k in range(n):
            @pl.when(k != pos)
            def _(k=k):
                copy(k, pos).wait_send()
                copy(k, k).wait_recv()  # member k's piece for me lands in my slot k
        own = sum(jnp.where(k == pos, p, 0.0) for k, p in enumerate(pieces))
        got = [jnp.where(k == pos, own, self.recv[par, k, :, :w]) for k in range(n)]
        self.counter[kind] += 1
        return got

    def _axis(self):
        me = self.me_ref[0]
        return self.tp, me, lambda k: k, 0

    def _plane(self):
        """The devices with my core index (one per chip), as a group."""
        me = self.me_ref[0]
        return self.tp // 2, me // 2, lambda k: 2 * k + me % 2, 1

    def _sibling(self):
        me = self.me_ref[0]
        return 2, me % 2, lambda k: 2 * (me // 2) + k, 2

    def all_gather(self, x, group=None):
        if self.tp == 1:
            return x
        group = group or self._axis()
        return jnp.concatenate(self._exchange([x] * group[0], group), axis=1)

    def reduce_scatter(self, x, group=None):
        """x [bp, w], w split into n chunks of ceil(w/n) (zero-padded): my chunk's sum."""
        if self.tp == 1:
            return x
        group = group or self._axis()
        n = group[0]
        c = math.ceil(x.shape[1] / n)
        if c * n != x.shape[1]:
            x = jnp.concatenate([x, jnp.zeros((x.shape[0], c * n - x.shape[1]), F32)], axis=1)
        got = self._exchange([x[:, k * c:(k + 1) * c] for k in range(n)], group)
        return sum(got[1:], got[0])

    def all_reduce(self, x):
        if self.tp == 1:
            return x
        w = x.shape[1]
        if self.hierarchical and self.tp % 2 == 0:
            pair = self._exchange([x, x], self._sibling())
            x = pair[0] + pair[1]
            if self.tp == 2:
                return x
            group = self._plane()
        else:
            group = self._axis()
        return self.all_gather(self.reduce_scatter(x, group), group)[:, :w]
