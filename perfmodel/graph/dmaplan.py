"""A decode step's DMA plan as data: every copy a kernel's DMA engine makes, in issue order.

The Pallas megakernel (`kernels.plan`) emits its real plan in this form, one `Copy` per DMA
descriptor, and the schedule simulator (`perfmodel.engine.megakernel`) runs on it, so the model
and the kernel agree copy by copy.

Fields beyond the copy itself (all with defaults, so a plan of HBM copies needs none of them):
- `padding`: how many of `bytes` are zeros the kernel's layout added (tile or bank padding,
  filler scale rows), which an analytic model of the weights does not count;
- `peer` and `collective`: a remote copy of an in-kernel collective to mesh device `peer`
  (the position on the kernel's tensor-parallel axis), `collective` naming the collective and
  its algorithm, e.g. "all_reduce one_shot" or "all_gather"; `peer` is -1 for HBM <-> on-chip
  copies. A consumer that models collectives by itself must leave remote copies out.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class Copy:
    order: int       # issue position within the step (0-based)
    layer: int       # 1-based layer; 0 = embedding, n_layers + 1 = final norm / lm_head
    family: str      # a weight family of perfmodel.spec.arch (e.g. "attention"), "kv_cache" /
    #                  "state", or "activation" (a remote copy)
    name: str        # what is copied, e.g. "attention[bank 3]" or "expert 2 -> slot 0"
    bytes: int
    routed: bool = False  # data dependent: issued only after this layer's router has run
    ring: bool = False    # a static weight bank streamed through the ring of on-chip banks
    padding: int = 0      # of `bytes`, zeros added by the kernel's layout
    peer: int = -1        # a remote copy to this mesh device (-1: HBM <-> on-chip)
    collective: str = ""  # the collective (and algorithm) a remote copy belongs to


def bytes_by_layer_family(plan: list[Copy]) -> dict[tuple[int, str], int]:
    out: dict[tuple[int, str], int] = {}
    for c in plan:
        out[(c.layer, c.family)] = out.get((c.layer, c.family), 0) + c.bytes
    return out
