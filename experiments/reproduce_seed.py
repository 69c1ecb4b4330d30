"""Reproduce the seed table: at most one whole-step parameter per platform (none for the TPU),
fitted on batches 1 and 8, predict batches 2 and 4 and the speculative-decoding pair (the no-fit
errors beside), and write experiments/results/seed_reproduction.{json,csv}.

Usage: python experiments/reproduce_seed.py [--no-fit]
Same numbers as `perfmodel reproduce`; this script also records the command and machine.
"""
import argparse
import json
import platform
import sys
from datetime import datetime, timezone
from pathlib import Path

from perfmodel.cli.fit import print_reproduce
from perfmodel.fit.seed import reproduce
from perfmodel.util.files import write_atomic, write_csv

OUT = Path(__file__).parent / "results"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-fit", action="store_true", help="physical defaults only")
    a = ap.parse_args()
    r = reproduce(fit_parameters=not a.no_fit)
    r["provenance"] = {"command": " ".join(["python", *sys.argv]), "machine": platform.platform(),
                       "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    print_reproduce(r)
    stem = OUT / ("seed_reproduction_unfitted" if a.no_fit else "seed_reproduction")
    write_atomic(stem.with_suffix(".json"), json.dumps(r, indent=1, default=float), parents=True)
    prov = r["provenance"]
    write_csv(stem.with_suffix(".csv"), [f"{prov['command']} on {prov['machine']}, {prov['date']}"],
              ["platform", "batch", "spec_decode", "predicted_tokens_per_s", "reported_tokens_per_s",
               "error", "no_fit_error", "role", "within_target", "predicted_step_ms"],
              [[p["platform"], p["batch"], "7 rows, tau 6" if p["spec_decode"] else "",
                f"{p['predicted_tokens_per_s']:.1f}", p["reported_tokens_per_s"], f"{p['error']:.4f}",
                f"{p['no_fit_error']:.4f}" if "no_fit_error" in p else "",
                p["role"], p["within_target"], f"{p['predicted_step_ms']:.3f}"] for p in r["points"]])
    print(f"\nwrote {stem}.json and {stem}.csv")


if __name__ == "__main__":
    main()
