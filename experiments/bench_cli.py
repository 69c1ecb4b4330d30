"""The command line as a user runs it: whole fresh processes, medians of repeats, against a bare
`python -c "import numpy"` measured in the same run (the machine's own start-up cost).

    python experiments/bench_cli.py [--repeats 5] [--out experiments/results/bench_cli.json]

Targets: one `perfmodel predict` (Kimi K3, TPU v7, one batch) within 2x `import numpy`, and one
with a GPU serving engine's kernels (Kimi K3 on 16 GB200, vLLM) within 2x too;
`perfmodel --help` within 1.5x; the 10,000-configuration design sweep with default flags
(`perfmodel sweep --design experiments/designs/kimi-k3-tpu-v7-10k.toml --out rows.parquet`)
under 3 s. The load average is printed with every figure (the machine may be shared). The
commands run with Python's bytecode cache on, as in a user's shell (a PYTHONDONTWRITEBYTECODE in
this process's environment is not passed on: it would recompile every module of every run).
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
    base = res["import_numpy"]["median_s"]
    checks = {"predict": ("predict_vs_numpy", res["predict"]["median_s"] / base, 2.0),
              "predict_serving": ("predict_serving_vs_numpy", res["predict_serving"]["median_s"] / base, 2.0),
              "help": ("help_vs_numpy", res["help"]["median_s"] / base, 1.5),
              "sweep_10k": ("sweep_10k_s", res["sweep_10k"]["median_s"], 3.0)}
    out = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                      f"python {platform.python_version()}", "date": time.strftime("%Y-%m-%d %H:%M"),
           "commands": {k: " ".join(shown.get(x, x) for x in v) for k, v in runs.items()},
           "results": res,
           "targets": {key: {"value": v, "target": t, "met": v <= t} for key, v, t in checks.values()}}
    for name, r in res.items():
        line = (f"{name:14s} median {r['median_s']:.3f} s (min {r['min_s']:.3f}, max {r['max_s']:.3f}; "
                f"CPU {r['cpu_median_s']:.2f} s; load {r['load_before']:.1f} -> {r['load_after']:.1f})")
        if name in checks:
            key, v, t = checks[name]
            unit = "x import numpy" if key.endswith("numpy") else "s"
            line += f"  {v:.2f} {unit}, target <= {t:g}: {'met' if v <= t else 'MISSED'}"
        print(line)
    write_atomic(a.out, json.dumps(out, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
