"""The best Kimi K3 layout under a TTFT and TPOT target on TPU v7 and on GB200 (README "Serving").

    python experiments/serve_sweeps.py [--jobs 2] [--chips tpu-v7,gb200]

Runs each serving design (experiments/designs/kimi-k3-serve-<chip>.toml, the same as
`perfmodel sweep --design FILE`) and writes experiments/results/serve_sweep_<chip>.json: the
summary (points, filtered counts), the top 10 by tokens/s per chip, the Pareto front, every row,
with the command, machine, date and load average. Prints the best layout of each chip.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path

from perfmodel.search import design
from perfmodel.search.sweep import run_design
from perfmodel.step.report import plain
from perfmodel.util.files import write_atomic

ROOT = Path(__file__).resolve().parent.parent
CHIPS = ("tpu-v7", "gb200")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=None)
    ap.add_argument("--chips", default=",".join(CHIPS), help=f"comma-separated, of {', '.join(CHIPS)}")
    a = ap.parse_args()
    chips = a.chips.split(",")
    if not set(chips) <= set(CHIPS):
        ap.error(f"--chips={a.chips!r}: each of {', '.join(CHIPS)}")
    for chip in chips:
        path = ROOT / "experiments" / "designs" / f"kimi-k3-serve-{chip}.toml"
        load = [os.getloadavg()[0]]
        s = run_design(design.load(str(path)), jobs=a.jobs, chunk=4, progress=False)
        load.append(os.getloadavg()[0])
        best = s["top"][0]
        meta = {"command": f"perfmodel sweep --design {path.relative_to(ROOT)} --chunk 4",
                "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "load_average_1min": {"start": load[0], "end": load[1]}}
        write_atomic(ROOT / "experiments" / "results" / f"serve_sweep_{chip}.json", json.dumps(plain(meta | s), indent=1) + "\n")
        print(f"{chip}: {s['points']} layouts x loads, {s['ok']} within the targets, filtered {s['filtered']}, "
              f"{s['elapsed_s']:.0f} s (load {load[0]:.1f} -> {load[1]:.1f}); best: {best['devices']} devices "
              f"({best['chips']} chips) tp {best['tp']} ep {best['ep']} {best['engine']}, {best['concurrency']} clients: "
              f"{best['tokens_per_s_per_chip']:.1f} tokens/s per chip ({best['tokens_per_s']:.0f} in all), "
              f"TTFT p90 {best['ttft_p90_s']:.3f} s, TPOT p90 {1e3 * best['tpot_p90_s']:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
