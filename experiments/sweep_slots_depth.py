"""Expert slots x ring depth on TPU v7: where is the optimum, and why?

    python experiments/sweep_slots_depth.py [--model muse-spark] [--batch 1]

The default is the profiled model and deployment (Muse Spark on one TPU7x host, TP8, the phase
profile's harness: perfmodel/data/phase_profiles/musespark.json), the ring in the kernel's own
2 MiB banks; `--model kimi-k3` sweeps Kimi K3 on 32 devices (EP 8) in 4 MiB banks.
Under the TPU's shared (round-robin) DMA service copies issued together land together: more
expert slots make the first expert land later (tests/test_schedule.py works it by hand), and
ring banks in flight share the engine with the expert copies; a deeper ring streams more weights
under the collectives. Ring and slots share the VMEM. Writes
experiments/results/slot_depth_sweep_<model>.csv.
"""
import argparse
import dataclasses
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

from perfmodel.engine import megakernel_sim
from perfmodel.spec.deployment import Deployment
from perfmodel.spec.hardware import load_hardware
from perfmodel.spec.loaders import load_model
from perfmodel.step.phases import load_profile, profile_deployment
from perfmodel.step.predict import predict
from perfmodel.util.errors import SpecError
from perfmodel.util.files import write_csv

RESULTS = Path(__file__).parent / "results"
SLOTS = (1, 2, 3, 4, 6, 8)
BANKS = {"muse-spark": (4, 8, 12, 16, 20, 24), "kimi-k3": (2, 4, 6, 8, 10, 11, 12)}


def deployment(model: str, batch: int) -> Deployment:
    if model == "muse-spark":
        return dataclasses.replace(profile_deployment(load_profile("musespark")), batch=batch)
    return Deployment(devices=32, tp=32, ep=8, engine="megakernel", batch=batch)


def sweep(model_name: str, batch: int) -> tuple[dict, int]:
    """{(slots, banks): step seconds or None (ring + slots beyond VMEM)} and the bank bytes."""
    model, hw = load_model(model_name), load_hardware("tpu-v7")
    bank = model.megakernel.bank_bytes or hw.dma_tile_bytes
    base = deployment(model_name, batch)
    grid = {}
    for s in SLOTS:
        for banks in BANKS[model_name]:
            try:
                grid[s, banks] = predict(model, hw, dataclasses.replace(base, expert_slots=s,
                                                                        prefetch_bytes=banks * bank)).step_s
            except SpecError:
                grid[s, banks] = None
    return grid, bank


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=sorted(BANKS), default="muse-spark")
    ap.add_argument("--batch", type=int, default=1)
    a = ap.parse_args()
    megakernel_sim.compile_loops()
    grid, bank = sweep(a.model, a.batch)
    banks = BANKS[a.model]
    print(f"step ms, {a.model} on tpu-v7 {deployment(a.model, a.batch)}; rows: expert slots, columns: ring banks "
          f"of {bank / 2**20:g} MiB")
    print("slots " + "".join(f"{b:>8}" for b in banks))
    for s in SLOTS:
        print(f"{s:>5} " + "".join(f"{grid[s, b] * 1e3:8.4f}" if grid[s, b] else "    VMEM" for b in banks))
    best = min((v, k) for k, v in grid.items() if v)[1]
    print(f"optimum: {best[0]} slots, {best[1]} banks ({best[1] * bank / 2**20:g} MiB): {grid[best] * 1e3:.4f} ms")
    out = RESULTS / f"slot_depth_sweep_{a.model}.csv"
    write_csv(out, [f"python {' '.join(sys.argv)} on {platform.platform()}, "
                    f"{datetime.now(timezone.utc).isoformat(timespec='seconds')}"],
              ["expert_slots", "ring_banks", "ring_mib", "step_ms"],
              [[s, b, b * bank / 2**20, f"{v * 1e3:.4f}" if v else "exceeds VMEM"] for (s, b), v in grid.items()])
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
