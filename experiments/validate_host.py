"""Host validation: measure this machine, trace the reference decode step, compare with the model.

    python experiments/validate_host.py [--quick] [--traces out/host_traces] [--steps 5]

1. `perfmodel.hostbench` -> experiments/results/host-cpu.toml (+ .json): the only input the
   model gets from this machine (no fitting on the decode runs below); measured again after
   the runs (`hostbench_after` in the JSON) to show how far the machine drifted meanwhile.
2. For kimi-k3-host-large (f32 weights about 1.8 GB, far beyond the LLC) and kimi-k3-host-small
   (about 27 MiB, within a 32 MiB LLC), batch 1, 2, 4, 8, 16, 32 and contexts 256 and 4096:
   traces of the reference step as one compiled program and op by op (`perfmodel.validate.traces`).
3. Predictions with the multi-kernel engine on one CPU device (`perfmodel.validate.host`), twice:
   `file` = the hardware file as written; `matched` = efficiency.hbm from hostbench's
   decode-matmul microbenchmark at the run's batch (still microbenchmarks only).
Writes experiments/results/host_validation.csv (one row per layer and per step, with the
machine, date and command in its header) and host_validation.json (summaries, targets, gaps).
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
from pathlib import Path

import validation_report
from perfmodel.spec.loaders import load_model
from perfmodel.validate import host as validate
from perfmodel_jax import hostbench
from perfmodel_jax.capture import capture_reference

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"
MODELS = ("kimi-k3-host-large", "kimi-k3-host-small")
BATCHES = (1, 2, 4, 8, 16, 32)
CONTEXTS = (256, 4096)
TARGETS = {"median_abs_step_error": 0.15, "median_abs_layer_error": 0.25,
           "median_abs_gap_error": 0.25}
VARIANTS = {"file": False, "matched": True}


def dispatch_gap_s(model: str, bench) -> float:
    """Diagnostic: the op-by-op gap if each dispatched phase (embed, per layer attention and
    FFN/MoE, head) paid hostbench's dispatch cost for its number of array arguments, less the
    one dispatch of the compiled step; the model instead charges one launch per graph op."""
    from perfmodel_kernels.reference import cache_shapes, small_param_shapes
    spec = load_model(model)
    per_layer = [len(small_param_shapes(spec, l)) + len(spec.layer_matmuls(l)) for l in spec.layers]
    leaves, cache = sum(per_layer) + 3, len(cache_shapes(spec, 1, 1))
    d = bench.dispatch_s_for
    phases = 2 * d(leaves + 1) + sum(d(n + cache + 2) + d(n + 1) for n in per_layer)
    return phases - d(leaves + cache + 2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sweep (smoke test; not the result)")
    ap.add_argument("--traces", default=str(ROOT / "out" / "host_traces"))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=7, help="hostbench repeats")
    ap.add_argument("--skip-capture", action="store_true", help="reuse the traces already there")
    a = ap.parse_args()
    models, batches, contexts = MODELS, BATCHES, CONTEXTS
    out_csv, out_json = RESULTS / "host_validation.csv", RESULTS / "host_validation.json"
    hw_file = RESULTS / "host-cpu.toml"
    if a.quick:
        models, batches, contexts = ("kimi-k3-host-small",), (1, 4), (256,)
        out_csv, out_json = Path(a.traces) / "quick.csv", Path(a.traces) / "quick.json"
        hw_file = Path(a.traces) / "host-cpu.toml"
    command = "python " + " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    load_before = os.getloadavg()[0]
    hw_file.parent.mkdir(parents=True, exist_ok=True)

    bench = hostbench.measure(a.repeats, quick=a.quick)
    hostbench.write(bench, hw_file)
    print(f"hardware file: {hw_file}")
    traces = Path(a.traces)
    if not a.skip_capture:
        for m in models:
            capture_reference(m, traces, batches, contexts, steps=a.steps)

    after = hostbench.measure(a.repeats, quick=a.quick)  # the same figures after the runs
    drift = {"stream_read": (bench.stream_bandwidth.median, after.stream_bandwidth.median),
             **{f"matvec_{dt}_{r}rows": (bench.matvec_bandwidth[(dt, r)].median,
                                        after.matvec_bandwidth[(dt, r)].median)
                for dt, r in bench.matvec_bandwidth if dt == "f32"},
             "dispatch_s": (bench.dispatch_s.median, after.dispatch_s.median)}
    print("hostbench before -> after the runs (medians): " + ", ".join(
        f"{k} {b:.3g} -> {x:.3g}" for k, (b, x) in drift.items()))

    rows, summaries = [], {}
    for variant, matched in VARIANTS.items():
        results = [c for c in validate.validate(traces, hardware=str(hw_file),
                                                 matched_efficiency=matched)
                   if c.model in {load_model(m).name for m in models} and c.batch in batches
                   and c.context in contexts]
        s = validation_report.summary_of(results, models, TARGETS)
        for g in s["gaps"]:
            g["per_dispatch_gap_s"] = dispatch_gap_s(g["model"], bench)
            g["per_dispatch_gap_error"] = validate.rel_error(g["per_dispatch_gap_s"],
                                                             g["measured_gap_s"])
        summaries[variant] = s
        rows += validation_report.rows_of(variant, results)

    meta = {"machine": bench.cpu, "jax_devices": bench.devices, "date": started,
            "command": command, "hardware_file": str(hw_file.relative_to(ROOT)
                                                     if hw_file.is_relative_to(ROOT) else hw_file),
            "load_average_1min": {"start": load_before, "end": os.getloadavg()[0]},
            "models": list(models), "batches": list(batches), "contexts": list(contexts),
            "steps": a.steps, "weights_dtype": "f32",
            "note": "the model is not fitted on these runs: only hostbench feeds it"}
    validation_report.write(out_csv, out_json, meta, rows, {"hostbench": bench.json(),
                                                            "hostbench_after": after.json(),
                                                            "summary": summaries})
    validation_report.print_summaries(summaries)
    print(f"\nwrote {out_csv} and {out_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
