"""Benchmark the serving simulator and the one-off predict against their targets, each command in
a fresh process (as a user runs it), medians of repeats, with the machine's load printed:

- `perfmodel serve --model llama-3.1-8b --hardware h100 --devices 1 --requests 10000 --rate 20
  --input-len 1024 --output-len 256 --seed 1 --json` (the default engine, megakernel, and
  --engine multikernel): wall time <= 10 s;
- `perfmodel predict` (Kimi K3 on TPU v7, batch 1): within 2x a bare `python -c "import numpy"`.

Usage: python experiments/bench_serve.py [--repeats 3] [--out experiments/results/bench_serve.json]
"""
import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PERFMODEL = [sys.executable, "-m", "perfmodel.cli"]
SERVE = ["serve", "--model", "llama-3.1-8b", "--hardware", "h100", "--devices", "1", "--requests", "10000",
         "--rate", "20", "--input-len", "1024", "--output-len", "256", "--seed", "1", "--json"]
PREDICT = ["predict", "--model", "kimi-k3", "--hardware", "tpu-v7", "--devices", "32", "--tp", "32", "--ep", "8"]
SERVE_TARGET_S = 10.0
PREDICT_TARGET_X = 2.0


def wall(argv: list[str]) -> tuple[float, str]:
    t = time.perf_counter()
    r = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    dt = time.perf_counter() - t
    if r.returncode:
        sys.exit(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()[-500:]}")
    return dt, r.stdout


def median_of(argv: list[str], repeats: int) -> tuple[dict, str]:
    times, out = [], ""
    for _ in range(repeats):
        dt, out = wall(argv)
        times.append(dt)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "runs_s": times}, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "experiments" / "results" / "bench_serve.json"))
    a = ap.parse_args()
    load_start = os.getloadavg()
    wall(PERFMODEL + SERVE[:-1] + ["--requests", "10", "--no-progress"])  # numba's cache warm, as for a user's 2nd run
    results = {}
    for engine in ("megakernel", "multikernel"):
        argv = PERFMODEL + SERVE + ([] if engine == "megakernel" else ["--engine", "multikernel"])
        timing, text = median_of(argv, a.repeats)
        sim = json.loads(text)
        pool = sim["pools"][0]
        results[f"serve_{engine}"] = {**timing, "command": "perfmodel " + " ".join(argv[len(PERFMODEL):]),
                                      "steps": pool["steps"], "step_shapes_costed": pool["step_shapes_costed"],
                                      "ttft_s": sim["ttft_s"], "tpot_s": sim["tpot_s"],
                                      "throughput_tokens_per_s": sim["throughput_tokens_per_s"],
                                      "target_s": SERVE_TARGET_S, "met": timing["median_s"] <= SERVE_TARGET_S}
        r = results[f"serve_{engine}"]
        print(f"serve ({engine:11s}) {r['median_s']:6.2f} s median of {a.repeats} (min {r['min_s']:.2f}, max "
              f"{r['max_s']:.2f}); target <= {SERVE_TARGET_S:g} s: {'met' if r['met'] else 'MISSED'}; "
              f"{r['steps']} steps, {r['step_shapes_costed']} step shapes costed; TTFT p50 {r['ttft_s']['p50']:.3f} s, "
              f"TPOT p50 {1e3 * r['tpot_s']['p50']:.2f} ms, {r['throughput_tokens_per_s']:.0f} tokens/s")
    numpy, _ = median_of([sys.executable, "-c", "import numpy"], 5)
    predict, _ = median_of(PERFMODEL + PREDICT, 5)
    ratio = predict["median_s"] / numpy["median_s"]
    results["predict"] = {**predict, "command": "perfmodel " + " ".join(PREDICT), "import_numpy": numpy,
                          "ratio": ratio, "target_ratio": PREDICT_TARGET_X, "met": ratio <= PREDICT_TARGET_X}
    print(f"predict: {predict['median_s']:.3f} s median of 5 against {numpy['median_s']:.3f} s for import numpy: "
          f"{ratio:.2f}x; target <= {PREDICT_TARGET_X:g}x: {'met' if ratio <= PREDICT_TARGET_X else 'MISSED'}")
    load_end = os.getloadavg()
    print(f"load average (1 / 5 / 15 min) at the start {load_start[0]:.2f} / {load_start[1]:.2f} / {load_start[2]:.2f}, "
          f"at the end {load_end[0]:.2f} / {load_end[1]:.2f} / {load_end[2]:.2f}; {os.cpu_count()} CPUs")
    meta = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "load_average": {"start": load_start, "end": load_end},
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "python experiments/bench_serve.py " + " ".join(sys.argv[1:])}
    Path(a.out).write_text(json.dumps({**meta, "results": results}, indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0 if all(r["met"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
