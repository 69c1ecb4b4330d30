"""Tuned sizes as data: the bank, ring and slot sizes (and the reduction wire) a preset runs
with on a mesh of `devices` TensorCores, and why. `perfmodel_kernels.run` and the TPU script take them as
defaults; command-line options override them. The TP32-core slice's entry was measured on a
TPU v5e (128-lane tile), where `experiments/tpu_megakernel.py` swept depth, slots and bank size;
the TP8 slices' ring was chosen by its compile time and then measured on the chip (docs/tpu.md)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class Tuned:
    bank_rows: int       # rows of one ring bank (x tile x 2 B: 8192 rows of 256 lanes = 4 MiB)
    depth: int           # banks in flight
    expert_slots: int
    wire: str            # dtype reductions travel in between devices
    why: str


TUNED = {
    ("kimi-k3", 32): Tuned(
        8192, 8, 3, "bf16",
        "4 MiB banks (the tpu-v7 model's ring bank) and 8 in flight (its default ring, half the "
        "VMEM); a bf16 wire as Inferact's TPU7x kernel (docs/sources.md); 3 expert slots, not its "
        "4: with the KDA update's intermediates counted (vmem.py) 4 exceed the 58 MiB VMEM budget "
        "at batch 8 by 1.6 MB, and the model puts 3 within 0.3 % of 4 (perfmodel predict "
        "--expert-slots: 3.858 / 8.607 ms against 3.868 / 8.630 at batches 1 / 8); fits at batch 1 "
        "to 8 (tests/test_kernel_plan.py)"),
}
TUNED[("kimi-k3-tp32-core", 1)] = Tuned(
    32768, 8, 4, "f32",
    "8 MiB banks at v5e's 128 lanes, 8 in flight (64 MiB of VMEM), 4 expert slots: on the K3 "
    "TP32-core slice with mxfp4 experts 8 MiB banks ran faster than 4 MiB ones at batch 1 in both "
    "calls that ran the two (1005.9 against 1030.0 us a step with the f32 decode, 960.1 against "
    "976.7 with the word decode), and at batch 8 with the word decode (2041.2 against 2053.6; "
    "with the f32 decode 2440.4 against 2424.5, in separate calls), which the model does not "
    "predict (docs/validation.md). Depth 16 or 32 gained nothing. With the word decode 4 slots "
    "beat 1 and 2 at batch 1 (892.1 against 1055.7 and 979.9 us), the model's best (873 us "
    "predicted), and at batch 8 (1952.4 against 2019.6 us at 2); 6 slots ran 1912.6 us there "
    "(the model's best at batch 8) but were not checked against the reference, 4 were at batches "
    "1 and 8: experiments/results/tpu_megakernel.json, the sweep and check runs")
TUNED[("kimi-k3-tp8-core", 1)] = Tuned(
    32768, 6, 2, "f32",
    "8 MiB banks, 6 in flight (48 MiB), 2 expert slots: compiled ahead of time for a v5e on a "
    "2-core CPU box, the kernel's Mosaic compile at batch 1 takes 28.9 s against 53.7 s with "
    "the TP32-core slice's 8 x 4 MiB ring (whose 148 s to lower and compile on the VM missed "
    "the 90 s goal), and 8 such banks run out of VMEM at batch 8; on the TP32-core slice 8 MiB "
    "banks ran within 1 % of 4 MiB ones. On the chip: lowered and compiled in 73.4 s at batch 1, "
    "2869.4 / 6774.5 us a step at batches 1 / 8 (XLA 2874.0 / 6720.8)")
TUNED[("kimi-k3-tp8-dense", 1)] = dataclasses.replace(
    TUNED[("kimi-k3-tp8-core", 1)],
    why="the TP8-core slice's ring (no routed experts: the slots are unused): compiled ahead of time on a "
        "2-core CPU box, 22.9 s at batch 1 against 52.9 s with 8 x 4 MiB banks, the ring its measured "
        "runs used before (1997.2 us a step at batch 1; 113.6 s to lower and compile on the VM). On "
        "the chip at this ring: 1986.4 us at batch 1, lowered and compiled in 50.2 s")
DEFAULT = Tuned(1024, 6, 2, "f32", "defaults for MINI-scale runs (interpret mode)")


def tuned(preset: str, devices: int) -> Tuned:
    return TUNED.get((preset, devices), DEFAULT)
