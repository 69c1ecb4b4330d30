"""Benchmark the model's speed against its targets, single process, medians of repeats:
one Kimi K3 megakernel prediction (<= 2 ms warm, <= 5 ms cold), a 10,000-configuration sweep
(mixed batch / depth / slots / context / VMEM on Kimi K3 + TPU v7, <= 10 s) and the What-if
dashboard re-render after a widget change (<= 100 ms).

Usage: python experiments/bench_model.py [--repeats 15] [--no-dashboard] [--profile [--sample 500]] [--stages]
"warm" reuses the cached op graph (as sweeps and the dashboard do); "cold" builds everything from
a freshly loaded model. The sweep is all 10,000 points of experiments/designs/kimi-k3-tpu-v7-10k.toml
evaluated in this process (`perfmodel sweep --design ... --jobs 1`); experiments/bench_cli.py times
the same sweep as a user runs it (a fresh process, default flags). The simulator's compiled loops
are built (or loaded from numba's cache) before any timing.
The What-if figure is the median re-render while the model runs (values not yet cached),
driven as in experiments/bench_dashboard.py. --profile prints where the time goes instead (cProfile,
by own time): 20 warm predictions at batch 1 and at batch 8, 5 cold ones, and the sweep sample.
--stages prints the whole sweep's time by stage (settings, validation, op graphs, on-chip sizing,
timeline arrays, simulation, result rows, the Parquet file), each stage's calls timed in place.
"""
import argparse
import cProfile
import collections
import dataclasses
import json
import os
import platform
import pstats
import statistics
import sys
import time
from pathlib import Path

from perfmodel.engine import megakernel_sim
from perfmodel.search import design
from perfmodel.search.sweep import run_design
from perfmodel.spec.deployment import Deployment
from perfmodel.spec.hardware import load_hardware
from perfmodel.spec.loaders import load_model
from perfmodel.step.predict import predict
from perfmodel.util.files import write_atomic

HERE = Path(__file__).resolve().parent
DESIGN = HERE / "designs" / "kimi-k3-tpu-v7-10k.toml"
TARGETS_S = {"warm": 2e-3, "cold": 5e-3, "sweep": 10.0, "whatif": 0.100}


def timed(fn, repeats):
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out), min(out), max(out)


RESULTS: dict[str, dict] = {}  # written to --out


def report(key: str, name: str, seconds: float, target: float | None, detail: str = "") -> None:
    unit, scale = ("s", 1) if (target or seconds) >= 1 else ("ms", 1e3)
    verdict = "" if target is None else f"target <= {target * scale:g} {unit}: " + (
        "met" if seconds <= target else "MISSED")
    print(f"{name:52s} {seconds * scale:9.2f} {unit:2s} {verdict:22s} {detail}")
    RESULTS[key] = {"what": name, "seconds": seconds, "target_s": target, "detail": detail}


def sweep_time(sample: int | None = None) -> tuple[float, str]:
    """Seconds for the 10k design (or, when profiling, a sample of it) in one process."""
    full = design.load(str(DESIGN))
    d = full if sample is None else dataclasses.replace(full, samples=sample)
    s = run_design(d, jobs=1, top=10, keep_rows=False, progress=False)
    return s["elapsed_s"], (f"({s['ok']} evaluated, {sum(s['filtered'].values())} filtered; "
                            f"{s['elapsed_s'] / len(d) * 1e3:.2f} ms per configuration)")


def whatif_rerender() -> tuple[float | None, str]:
    sys.path.insert(0, str(HERE))
    try:
        from bench_dashboard import WHATIF, drive
        from streamlit import logger
    except ImportError as e:
        return None, f"not measured ({e}; needs the [dashboard] extra)"
    logger.set_log_level("error")  # AppTest's bare-mode warnings
    r = drive("What-if", WHATIF, rounds=1)
    return r["cold_median_s"], f"(median of {r['changes']} widget changes, model running; max {r['cold_max_s'] * 1e3:.0f} ms)"


def profile(label: str, fn, lines: int = 12) -> None:
    pr = cProfile.Profile()
    pr.enable()
    fn()
    pr.disable()
    print(f"\n=== {label} ===")
    st = pstats.Stats(pr).strip_dirs()
    st.sort_stats("tottime").print_stats(lines)
    print("cumulative, the model's stages:")
    st.sort_stats("cumulative").print_stats(r"\((predict|simulate_megakernel|megakernel_arrays|run_many|collective_terms|"
                                            r"op_compute_s|build|_layer_rows|validate|evaluate|run_design)\)")


def stages() -> None:
    """The 10k sweep in this process (--jobs 1, rows to a Parquet file), its time split by stage:
    each stage's functions are wrapped with a timer for this run."""
    import tempfile
    from perfmodel.search import batch, sweep
    spent, calls = collections.Counter(), collections.Counter()

    def timer(owner, name: str, stage: str) -> None:
        fn = getattr(owner, name)

        def timed_fn(*args, **kw):
            t = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                spent[stage] += time.perf_counter() - t
                calls[stage] += 1
        setattr(owner, name, timed_fn)

    for owner, name, stage in [
            (design.Design, "settings", "settings of each point (design)"),
            (batch, "configure", "deployment + chip of each point"), (batch, "validate", "validation"),
            (batch.ops, "build", "op graphs (ops.build, cached)"), (batch.megakernel, "sizing", "on-chip sizing"),
            (batch.megakernel, "megakernel_arrays", "timeline arrays"),
            (batch.megakernel_sim, "run_many", "simulation (run_many)"),
            (batch, "_row", "result rows"), (batch, "_filtered", "result rows"),
            (sweep.RowFile, "write", "Parquet file (rows to columns, write)")]:
        timer(owner, name, stage)
    with tempfile.TemporaryDirectory() as tmp:
        t, cpu = time.perf_counter(), time.process_time()
        s = run_design(design.load(str(DESIGN)), jobs=1, out=f"{tmp}/rows.parquet", progress=False)
        total, cpu = time.perf_counter() - t, time.process_time() - cpu
    print(f"sweep of {s['points']} configurations in one process, load {os.getloadavg()[0]:.1f}:")
    for stage, sec in spent.items():
        print(f"  {stage:40s} {sec:7.3f} s  {calls[stage]:6d} calls")
    print(f"  {'the rest (chunks, grouping, top K, Pareto)':40s} {total - sum(spent.values()):7.3f} s")
    print(f"  {'total':40s} {total:7.3f} s  (CPU time {cpu:.3f} s)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--sample", type=int, default=500, help="with --profile: points of the design profiled")
    ap.add_argument("--no-dashboard", action="store_true", help="skip the What-if re-render")
    ap.add_argument("--profile", action="store_true", help="print cProfile tables instead of the targets")
    ap.add_argument("--stages", action="store_true", help="print the sweep's time by stage instead of the targets")
    ap.add_argument("--out", default=str(HERE / "results" / "bench_model.json"), help="results file")
    a = ap.parse_args()
    hw = load_hardware("tpu-v7")
    d = Deployment(devices=32, tp=32, ep=8, engine="megakernel", batch=1)
    model = load_model("kimi-k3")
    megakernel_sim.loops("python")  # the plain loops first (PERFMODEL_LOOPS=python, a one-off command)
    predict(model, hw, d)
    python_mode = timed(lambda: predict(model, hw, d), 5)[0]
    megakernel_sim.compile_loops()
    predict(model, hw, d)  # builds or loads the compiled loops
    run_design(dataclasses.replace(design.load(str(DESIGN)), samples=20), jobs=1, keep_rows=False, progress=False)
    if a.stages:
        return stages()
    if a.profile:
        d8 = dataclasses.replace(d, batch=8)
        predict(model, hw, d8)
        profile("20 warm predictions, batch 1", lambda: [predict(model, hw, d) for _ in range(20)])
        profile("20 warm predictions, batch 8", lambda: [predict(model, hw, d8) for _ in range(20)])
        profile("5 cold predictions, batch 1", lambda: [predict(load_model("kimi-k3"), hw, d) for _ in range(5)])
        profile(f"sweep sample of {a.sample} points", lambda: sweep_time(a.sample))
        return
    machine = f"{platform.processor() or platform.machine()}, python {platform.python_version()}"
    load0 = os.getloadavg()[0]
    print(f"machine: {machine}; medians of {a.repeats} repeats, one process; load {load0:.1f}")
    report("python_mode", "predict kimi-k3 tpu-v7 megakernel b=1 (plain Python)", python_mode, None,
           "(median of 5; the loops without numba: PERFMODEL_LOOPS=python)")
    med, lo, hi = timed(lambda: predict(model, hw, d), a.repeats)
    report("warm", "predict kimi-k3 tpu-v7 megakernel b=1 (warm)", med, TARGETS_S["warm"],
           f"(min {lo * 1e3:.2f}, max {hi * 1e3:.2f} ms)")
    med, lo, hi = timed(lambda: predict(load_model("kimi-k3"), hw, d), a.repeats)
    report("cold", "predict kimi-k3 tpu-v7 megakernel b=1 (cold)", med, TARGETS_S["cold"],
           f"(min {lo * 1e3:.2f}, max {hi * 1e3:.2f} ms)")
    seconds, detail = sweep_time()
    report("sweep", "sweep 10,000 configurations kimi-k3 tpu-v7", seconds, TARGETS_S["sweep"], detail)
    if not a.no_dashboard:
        seconds, detail = whatif_rerender()
        if seconds is None:
            print(f"{'What-if dashboard re-render':52s} {detail}")
        else:
            report("whatif", "What-if dashboard re-render", seconds, TARGETS_S["whatif"], detail)
    write_atomic(a.out, json.dumps({"machine": machine, "date": time.strftime("%Y-%m-%d %H:%M"), "repeats": a.repeats,
                                    "load_before": load0, "load_after": os.getloadavg()[0],
                                    "results": RESULTS}, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
