"""The command line as a user runs it: whole fresh processes, medians of repeats, against a bare
`python -c "import numpy"` measured in the same run (the machine's own start-up cost).

    python experiments/bench_cli.py [--repeats 5] [--out experiments/results/bench_cli.json]

Targets: one `perfmodel predict` (Kimi K3, TPU v7, one batch) within 2x `import numpy`, and one
with a GPU serving engine's kernels (Kimi K3 on 16 GB200, vLLM) within 2x too;
`perfmodel --help` within 1.5x; the 10,000-configuration design sweep with default flags
(`perfmodel sweep --design experiments/designs/kimi-k3-tpu-v7-10k.toml --out rows.parquet`)
under 3 s; and in the Python API, `perfmodel.predict` of the same step called again in a fresh
process (nothing else called first) within 1 ms, its first call (which loads the compiled
simulator) printed beside it. The load average is printed with every figure (the machine may be
shared). The commands run with Python's bytecode cache on, as in a user's shell (a
PYTHONDONTWRITEBYTECODE in this process's environment is not passed on: it would recompile every
module of every run).
"""
import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from perfmodel.util.files import write_atomic

HERE = Path(__file__).resolve().parent
DESIGN = HERE / "designs" / "kimi-k3-tpu-v7-10k.toml"
PERFMODEL = [sys.executable, "-m", "perfmodel.cli"]


ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
# the Python API as a user's script calls it: a fresh process, one prediction, then the same again
API_CALLS = 20
API = f"""import json, statistics, time
import perfmodel
model, chip = perfmodel.load_model("kimi-k3"), perfmodel.load_hardware("tpu-v7")
d = perfmodel.Deployment(devices=32, tp=32, ep=8, batch=1)
t = time.perf_counter()
perfmodel.predict(model, chip, d)
first, warm = time.perf_counter() - t, []
for _ in range({API_CALLS}):
    t = time.perf_counter()
    perfmodel.predict(model, chip, d)
    warm.append(time.perf_counter() - t)
print(json.dumps({{"first_s": first, "warm_median_s": statistics.median(warm), "warm_max_s": max(warm)}}))
"""


def timed(argv: list[str], repeats: int) -> dict:
    """Wall seconds of `argv` run `repeats` times (after one untimed run that fills the OS,
    bytecode and numba caches), with the load average before and after, and the median CPU
    seconds (user + system, the command and its worker processes: what the load does not add)."""
    subprocess.run(argv, check=True, capture_output=True, env=ENV)
    load0, times, cpu = os.getloadavg()[0], [], []
    for _ in range(repeats):
        c, t = _children_cpu(), time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True, env=ENV)
        times.append(time.perf_counter() - t)
        cpu.append(_children_cpu() - c)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "runs": repeats,
            "cpu_median_s": statistics.median(cpu), "load_before": load0, "load_after": os.getloadavg()[0]}


def api_timed(repeats: int) -> dict:
    """`perfmodel.predict` in `repeats` fresh processes (after one untimed): the medians over the
    processes of its first call and of the median of its next API_CALLS calls."""
    argv = [sys.executable, "-c", API]
    subprocess.run(argv, check=True, capture_output=True, env=ENV)
    load0 = os.getloadavg()[0]
    runs = [json.loads(subprocess.run(argv, check=True, capture_output=True, text=True, env=ENV).stdout)
            for _ in range(repeats)]
    return {"first_median_s": statistics.median(r["first_s"] for r in runs),
            "warm_median_s": statistics.median(r["warm_median_s"] for r in runs),
            "warm_max_s": max(r["warm_max_s"] for r in runs), "runs": repeats, "calls_per_run": API_CALLS,
            "load_before": load0, "load_after": os.getloadavg()[0]}


def _children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=str(HERE / "results" / "bench_cli.json"))
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = Path(tmp) / "rows.parquet"
        runs = {
            "import_numpy": [sys.executable, "-c", "import numpy"],
            "predict": PERFMODEL + ["predict", "--model", "kimi-k3", "--hardware", "tpu-v7", "--devices", "32",
                                    "--tp", "32", "--ep", "8", "--batch", "1"],
            "predict_serving": PERFMODEL + ["predict", "--model", "kimi-k3", "--hardware", "gb200", "--devices", "16",
                                            "--tp", "16", "--ep", "1", "--engine", "multikernel",
                                            "--serving-engine", "vllm", "--batch", "1"],
            "help": PERFMODEL + ["--help"],
            "sweep_10k": PERFMODEL + ["sweep", "--design", str(DESIGN), "--out", str(rows), "--no-progress"],
        }
        res = {name: timed(argv, a.repeats) for name, argv in runs.items()}
        # the commands as a user in the checkout types them (no path of this machine)
        shown = {sys.executable: "python", str(DESIGN): str(DESIGN.relative_to(HERE.parent)), str(rows): "rows.parquet"}
    api = api_timed(a.repeats)
    base = res["import_numpy"]["median_s"]
    checks = {"predict": ("predict_vs_numpy", res["predict"]["median_s"] / base, 2.0),
              "predict_serving": ("predict_serving_vs_numpy", res["predict_serving"]["median_s"] / base, 2.0),
              "help": ("help_vs_numpy", res["help"]["median_s"] / base, 1.5),
              "sweep_10k": ("sweep_10k_s", res["sweep_10k"]["median_s"], 3.0)}
    out = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                      f"python {platform.python_version()}", "date": time.strftime("%Y-%m-%d %H:%M"),
           "commands": {k: " ".join(shown.get(x, x) for x in v) for k, v in runs.items()},
           "results": res, "api_predict": api,
           "targets": {key: {"value": v, "target": t, "met": v <= t} for key, v, t in checks.values()}}
    out["targets"]["api_predict_warm_ms"] = {"value": api["warm_median_s"] * 1e3, "target": 1.0,
                                             "met": api["warm_median_s"] * 1e3 <= 1.0}
    for name, r in res.items():
        line = (f"{name:14s} median {r['median_s']:.3f} s (min {r['min_s']:.3f}, max {r['max_s']:.3f}; "
                f"CPU {r['cpu_median_s']:.2f} s; load {r['load_before']:.1f} -> {r['load_after']:.1f})")
        if name in checks:
            key, v, t = checks[name]
            unit = "x import numpy" if key.endswith("numpy") else "s"
            line += f"  {v:.2f} {unit}, target <= {t:g}: {'met' if v <= t else 'MISSED'}"
        print(line)
    t = out["targets"]["api_predict_warm_ms"]
    print(f"{'api_predict':14s} warm median {api['warm_median_s'] * 1e3:.3f} ms (max {api['warm_max_s'] * 1e3:.2f}; "
          f"first call {api['first_median_s']:.3f} s; load {api['load_before']:.1f} -> {api['load_after']:.1f})  "
          f"target <= 1 ms: {'met' if t['met'] else 'MISSED'}")
    write_atomic(a.out, json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
