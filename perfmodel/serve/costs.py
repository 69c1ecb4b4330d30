"""Step costs for the serving simulator: the engines' seconds per step shape, on a grid.

A simulation takes tens of thousands of steps of varying shape (decode rows, their mean
context, prompt chunks of some length after some cached tokens). Each of those four sizes is
exact up to 16 and above it lies between two points of a grid of `POINTS_PER_OCTAVE` values per
octave; the step's seconds are interpolated linearly in each size between the grid's corner
shapes, each corner costed once by `perfmodel.step.prefill.step_cost` (the same engines as
`perfmodel predict`). The number of chunks and of chunks ending their prompt stay exact. A
megakernel step is two programs (prompt chunks in XLA, then the decode rows), costed apart.
"""
from __future__ import annotations

import itertools
import math

from perfmodel.graph.prefill import StepShape
from perfmodel.spec.arch import ModelSpec
from perfmodel.spec.deployment import Deployment
from perfmodel.spec.hardware import Hardware
from perfmodel.step.prefill import step_cost

POINTS_PER_OCTAVE = 4
EXACT_UP_TO = 16


def bracket(n: int) -> tuple[int, int, float]:
    """The grid points around `n` and the weight of the upper one (module doc)."""
    if n <= EXACT_UP_TO:
        return n, n, 0.0
    grain = 2 ** int(math.log2(n)) // POINTS_PER_OCTAVE
    lo = n // grain * grain
    return (n, n, 0.0) if lo == n else (lo, lo + grain, (n - lo) / grain)


class StepCosts:
    """Seconds of a step by shape on one deployment (module doc); `misses` counts the corner
    shapes costed by the engines, `calls` the lookups."""

    def __init__(self, model: ModelSpec, hw: Hardware, d: Deployment):
        self.model, self.hw, self.d = model, hw, d
        self.corners: dict[tuple, float] = {}
        self.calls = 0

    @property
    def misses(self) -> int:
        return len(self.corners)

    def corner(self, key: tuple) -> float:
        s = self.corners.get(key)
        if s is None:
            s = self.corners[key] = step_cost(self.model, self.hw, self.d, StepShape(*key)).step_s
        return s

    def seconds(self, decode: int, context: int, chunks: int = 0, chunk_tokens: int = 0,
                chunk_context: int = 0, finishing: int = 0) -> float:
        """One step of `decode` rows at mean `context` and `chunks` prompt chunks of
        `chunk_tokens` after `chunk_context` cached tokens, `finishing` of them ending their
        prompt (the StepShape fields, per attention replica)."""
        self.calls += 1
        dec = (decode, context if decode else 0)
        pre = (chunk_tokens, chunk_context) if chunks else (0, 0)
        if self.d.engine == "megakernel" and decode and chunks:  # two programs: their seconds add
            return self._interpolated(dec, (0, 0), 0, 0) + self._interpolated((0, 0), pre, chunks, finishing)
        return self._interpolated(dec, pre, chunks, finishing)

    def _interpolated(self, dec: tuple[int, int], pre: tuple[int, int], chunks: int, finishing: int) -> float:
        if not chunks:  # a decode step: bilinear in its rows and their context
            (b0, b1, wb), (c0, c1, wc) = bracket(dec[0]), bracket(dec[1])
            f = lambda b, c: self.corner((b, c, 0, 0, 0, finishing))
            lo = f(b0, c0) if not wc else (1 - wc) * f(b0, c0) + wc * f(b0, c1)
            if not wb:
                return lo
            return (1 - wb) * lo + wb * (f(b1, c0) if not wc else (1 - wc) * f(b1, c0) + wc * f(b1, c1))
        total = 0.0
        dims = [bracket(v) for v in dec + pre]
        for pick in itertools.product(*(((lo, 1 - w), (hi, w)) if w else ((lo, 1.0),) for lo, hi, w in dims)):
            b, ctx, ct, cc = (v for v, _ in pick)
            total += math.prod(w for _, w in pick) * self.corner((b, ctx, chunks, ct, cc, finishing))
        return total


_SHARED: dict[tuple, StepCosts] = {}


def shared(model: ModelSpec, hw: Hardware, d: Deployment) -> StepCosts:
    """The StepCosts of (model, chip, deployment) in this process: simulations of the same pool
    at other loads (a sweep's points, a load curve) reuse the shapes already costed. The
    objects are kept alive with it, so their ids stay theirs."""
    key = (id(model), id(hw), d)
    if key not in _SHARED:
        if len(_SHARED) >= 64:
            _SHARED.clear()
        _SHARED[key] = StepCosts(model, hw, d)
    return _SHARED[key]
