"""Tuned sizes as data: the bank, ring and slot sizes (and the reduction wire) a preset runs
with on a mesh of `devices` TensorCores, and why. `perfmodel_kernels.run` and the TPU script take them as
defaults; command-line options override them. The one-chip slices' entries were chosen for a
TPU v5e (128-lane tile: 2 MiB banks of 8192 rows); `experiments/tpu_megakernel.py` sweeps depth,
slots and bank size around them on the chip. There depth 16 and 16384-row banks each ran faster
(docs/tpu.md); the entries stay until the two are measured together."""
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
for _slice in ("kimi-k3-tp32-core", "kimi-k3-tp8-core"):
    TUNED[(_slice, 1)] = Tuned(
        8192, 8, 2, "f32",
        "2 MiB banks at v5e's 128 lanes: the chip's in-kernel stream reaches its plateau (755 "
        "GB/s) from 512 KiB copies with 2 in flight (experiments/results/tpu_v5e_microbench.json)"
        "; 8 in flight; 2 expert slots (top-4 picks about 4 distinct experts at batch 1)")
TUNED[("kimi-k3-tp8-dense", 1)] = Tuned(
    8192, 8, 2, "f32", "the MoE slices' ring on the same chip (no routed experts: the slots are unused)")
DEFAULT = Tuned(1024, 6, 2, "f32", "defaults for MINI-scale runs (interpret mode)")


def tuned(preset: str, devices: int) -> Tuned:
    return TUNED.get((preset, devices), DEFAULT)
