"""Tuned sizes as data: the bank, ring and slot sizes (and the reduction wire) a preset runs
with on a mesh of `devices` TensorCores, and why. `kernels.run` and the TPU script take them as
defaults; command-line options override them. None of these has been swept on a TPU yet:
`experiments/tpu_megakernel.py` sweeps depth and slots around them on a TPU VM."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tuned:
    bank_rows: int       # rows of one ring bank (x tile 256 x 2 B: 8192 rows = 4 MiB)
    depth: int           # banks in flight
    expert_slots: int
    wire: str            # dtype reductions travel in between devices
    why: str


TUNED = {
    ("kimi-k3", 32): Tuned(
        8192, 8, 4, "bf16",
        "4 MiB banks (the tpu-v7 model's ring bank) and 8 in flight (its default ring, half the "
        "VMEM); 4 expert slots and a bf16 wire as Inferact's TPU7x kernel (docs/sources.md); "
        "fits the 58 MiB VMEM budget at batch 1 to 8 (tests/test_kernel_plan.py)"),
}
DEFAULT = Tuned(1024, 6, 2, "f32", "defaults for MINI-scale runs (interpret mode)")


def tuned(preset: str, devices: int) -> Tuned:
    return TUNED.get((preset, devices), DEFAULT)
