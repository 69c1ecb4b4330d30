"""A decode step's DMA plan as data: every HBM -> on-chip copy, in issue order.

The Pallas megakernel (`kernels.plan`) emits its real plan in this form, and the schedule
simulator (`perfmodel.engine.megakernel`) runs on it, so the model and the kernel agree copy by copy.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class Copy:
    order: int       # issue position within the step (0-based)
    layer: int       # 1-based layer; 0 = embedding, n_layers + 1 = final norm / lm_head
    family: str      # a weight family of perfmodel.spec.arch (e.g. "attention") or "kv_cache"/"state"
    name: str        # what is copied, e.g. "q_proj[tile 3]" or "expert slot 2"
    bytes: int
    routed: bool = False  # data dependent: issued only after this layer's router has run
    ring: bool = False    # a static weight tile streamed through the ring of on-chip banks


def bytes_by_layer_family(plan: list[Copy]) -> dict[tuple[int, str], int]:
    out: dict[tuple[int, str], int] = {}
    for c in plan:
        out[(c.layer, c.family)] = out.get((c.layer, c.family), 0) + c.bytes
    return out
