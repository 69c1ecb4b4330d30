"""The kernel's DMAs as named objects: `Copies` (start() / wait() of one or more async copies
that belong together) and `Dma`, which records every issue site while the kernel is traced so
that `perfmodel_kernels.plan` derives the DMA plan from the kernel's own code."""
from __future__ import annotations

from jax.experimental.pallas import tpu as pltpu


class Copies:
    """One named transfer made of async copies (src, dst, sem) issued and awaited together."""

    def __init__(self, name: str, *triples):
        self.name = name
        self.copies = [pltpu.make_async_copy(src, dst, sem) for src, dst, sem in triples]

    def start(self):
        for cp in self.copies:
            cp.start()

    def wait(self):
        for cp in self.copies:
            cp.wait()


class Dma:
    """Issues nothing itself; records each DMA issue site (in program order) for the plan.

    A record is a dict(site, scope, when, layer, family, name, bytes, routed, **extra); scope
    is "pre" (before the layer loop), "loop" (the loop body, traced once for all layers) or
    "post" (the head); when is None or the ("attention" | "ffn", kind) of the branch it lies
    in. Sites: "copy" (one copy; layer None = the loop's current layer), "ring_start" (the
    first `depth` banks), "part" (the banks of part `name` of the current layer, each followed
    by the issue of the bank `depth` ahead), "vectors" (the vector block of layer `layer`
    relative to the current one), "experts" (per distinct expert picked, `copies` copies of
    `bytes`), "cache_blocks" (per sequence, ceil(pos / block) copies), "cache_window" (one per
    sequence that keeps a row), "exchange" (one message of `bytes` to each other member of a group of
    `kind`, for collective `what`) and "wait" (name = the copies waited for), so that
    orderings can be checked."""

    def __init__(self, record: list | None):
        self.record, self.scope, self.when = record, "pre", None

    def note(self, site, layer=None, family=None, name="", nbytes=0, routed=False, **extra):
        if self.record is not None:
            self.record.append(dict(site=site, scope=self.scope, when=self.when, layer=layer,
                                    family=family, name=name, bytes=int(nbytes), routed=routed,
                                    **extra))

    def branch(self, when):
        """Records of `fn` (traced inside a cond branch) are tagged with `when`."""
        def wrap(fn):
            def traced(*a):
                outer, self.when = self.when, when
                try:
                    return fn(*a)
                finally:
                    self.when = outer
            return traced
        return wrap
