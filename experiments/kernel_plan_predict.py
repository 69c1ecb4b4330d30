"""This project's megakernel, predicted from its own DMA plan, beside the model's own megakernel:
Kimi K3 on 32 TPU v7 devices (TP32, EP8), batches 1, 2, 4, 8, 64 steps per device call.

    python experiments/kernel_plan_predict.py [--plans DIR]

Writes each batch's plan file with `python -m perfmodel_kernels.run ... --plan-out` (JAX traces the kernel
for one device's shapes: about a minute a batch here; `--plans DIR` reuses the files in DIR),
then runs `perfmodel predict --kernel-plan` on them and writes
experiments/results/kernel_plan_kimi-k3.json (the README's kernel-plan figure).
"""
import argparse
import contextlib
import json
import platform
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

from perfmodel.cli.main import main as perfmodel
from perfmodel.util.files import write_atomic

OUT = Path(__file__).parent / "results" / "kernel_plan_kimi-k3.json"
BATCHES = (1, 2, 4, 8)
KERNEL = ["--preset", "kimi-k3", "--devices", "32", "--tp", "32", "--ep", "8", "--context", "4352"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--plans", help="directory holding k3-b<batch>.plan.json (default: write them afresh)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(a.plans or tmp)
        paths = [where / f"k3-b{b}.plan.json" for b in BATCHES]
        for b, p in zip(BATCHES, paths):
            if not (a.plans and p.exists()):
                subprocess.run([sys.executable, "-m", "perfmodel_kernels.run", *KERNEL, "--batch", str(b), "--plan-out", str(p)],
                               check=True)
        res = Path(tmp) / "out.json"
        with open(res, "w") as f, contextlib.redirect_stdout(f):
            rc = perfmodel(["predict", *[x for p in paths for x in ("--kernel-plan", str(p))], "--steps-per-call", "64",
                            "--json"])
        if rc:
            return rc
        out = json.loads(res.read_text())
    for p in out["kernel_plans"]:
        p["plan"] = Path(p["plan"]).name
    out["command"] = f"python {' '.join(sys.argv)}"
    out["machine"] = f"{platform.platform()}, {datetime.now(timezone.utc).isoformat(timespec='seconds')}"
    write_atomic(OUT, json.dumps(out, indent=1) + "\n")
    for p in out["kernel_plans"]:
        print(f"batch {p['deployment']['batch']}: recipe {p['recipe_step_s'] * 1e3:.2f} ms, "
              f"kernel {p['kernel_step_s'] * 1e3:.2f} ms")
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
