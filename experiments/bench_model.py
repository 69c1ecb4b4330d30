"""Benchmark the model's speed (its speed targets): median time of one Kimi K3 prediction at one
batch (target <= 10 ms) and of a 4-batch x 8-depth prefetch sweep (target <= 250 ms).

Usage: python experiments/bench_model.py [--repeats 15]
Prints medians and min/max; "warm" reuses the cached op graph (as sweeps and the dashboard do),
"cold" builds everything from a freshly loaded model.
"""
import argparse
import platform
import statistics
import time

from perfmodel.arch import load_model
from perfmodel.deployment import Deployment
from perfmodel.hardware import load_hardware
from perfmodel.predict import predict
from perfmodel.sweep import sweep


def timed(fn, repeats):
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out), min(out), max(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    a = ap.parse_args()
    hw = load_hardware("tpu-v7")
    d = Deployment(devices=32, tp=32, ep=8, engine="megakernel", batch=1)
    model = load_model("kimi-k3")
    predict(model, hw, d)
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}")
    rows = [("predict kimi-k3 tpu-v7 megakernel b=1 (warm)", timed(lambda: predict(model, hw, d), a.repeats), 10e-3),
            ("predict kimi-k3 tpu-v7 megakernel b=1 (cold)",
             timed(lambda: predict(load_model("kimi-k3"), hw, d), a.repeats), 10e-3)]
    axes = {"batch": [1, 2, 4, 8], "prefetch_bytes": [2**20 * m for m in (4, 8, 12, 16, 24, 32, 40, 48)]}
    rows.append(("sweep 4 batches x 8 depths (warm)",
                 timed(lambda: sweep(model, hw, d, axes), max(3, a.repeats // 3)), 250e-3))
    for name, (med, lo, hi), target in rows:
        verdict = "met" if med <= target else "MISSED"
        print(f"{name:48s} median {med * 1e3:8.2f} ms  (min {lo * 1e3:.2f}, max {hi * 1e3:.2f})  "
              f"target <= {target * 1e3:.0f} ms: {verdict}")


if __name__ == "__main__":
    main()
