"""Expert slots x ring depth on TPU v7, Kimi K3, batch 1 (32 devices, EP 8): where is the optimum?

    python experiments/sweep_slots_depth.py [--batch 1]

Under the TPU's shared (round-robin) DMA service, copies in flight together land together, so
extra expert slots and extra ring banks make the copies needed first land later; the VMEM
budget makes slots and banks compete too. Writes experiments/results/slot_depth_sweep.csv.
"""
import argparse
import dataclasses
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

from perfmodel.spec.deployment import Deployment
from perfmodel.spec.hardware import load_hardware
from perfmodel.spec.loaders import load_model
from perfmodel.step.predict import predict
from perfmodel.util.errors import SpecError
from perfmodel.util.files import write_csv

OUT = Path(__file__).parent / "results" / "slot_depth_sweep.csv"
SLOTS = (1, 2, 3, 4, 6, 8)
DEPTHS_MIB = (8, 16, 24, 32, 40, 44, 48)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    a = ap.parse_args()
    model, hw = load_model("kimi-k3"), load_hardware("tpu-v7")
    base = Deployment(devices=32, tp=32, ep=8, engine="megakernel", batch=a.batch)
    grid = {}
    for s in SLOTS:
        for m in DEPTHS_MIB:
            try:
                grid[s, m] = predict(model, hw, dataclasses.replace(base, expert_slots=s,
                                                                    prefetch_bytes=m * 2**20)).step_s
            except SpecError:  # ring + slots beyond VMEM
                grid[s, m] = None
    print(f"step ms, kimi-k3 on 32 x tpu-v7 (ep 8), batch {a.batch}; rows: expert slots, columns: ring MiB")
    print("slots " + "".join(f"{m:>8}" for m in DEPTHS_MIB))
    for s in SLOTS:
        print(f"{s:>5} " + "".join(f"{grid[s, m] * 1e3:8.4f}" if grid[s, m] else "    VMEM" for m in DEPTHS_MIB))
    best = min((v, k) for k, v in grid.items() if v)[1]
    interior = SLOTS[0] < best[0] < SLOTS[-1] and DEPTHS_MIB[0] < best[1] < DEPTHS_MIB[-1]
    print(f"optimum: {best[0]} slots, {best[1]} MiB ring: {grid[best] * 1e3:.4f} ms "
          f"({'interior' if interior else 'on the edge'} of the grid)")
    write_csv(OUT, [f"python {' '.join(sys.argv)} on {platform.platform()}, "
                    f"{datetime.now(timezone.utc).isoformat(timespec='seconds')}"],
              ["expert_slots", "ring_mib", "step_ms"],
              [[s, m, f"{v * 1e3:.4f}" if v else "exceeds VMEM"] for (s, m), v in grid.items()])
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
