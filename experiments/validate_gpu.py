"""GPU validation: trace the reference decode step on a GPU and compare it with the model.

    python experiments/validate_gpu.py [--hardware h200] [--quick] [--steps 5] [--budget-s 420]

One prepared run for a machine with one NVIDIA GPU and jax[cuda] (under 6 minutes on an H200
with the defaults; nothing else is needed from the machine):
1. Profiler traces of the pure-JAX reference step (`perfmodel_kernels/reference.py`, f32 weights) of
   kimi-k3-host-small and kimi-k3-host-large at batch 1, 4 and 16 and contexts 256 and 4096, as one
   compiled program and op by op (`perfmodel_jax.capture`); every kernel is attributed to its
   layer and phase through the named scopes of the compiled HLO (`perfmodel.validate.traces`).
2. Predictions of the same runs with the multi-kernel engine on one device of `--hardware` (a
   preset: its GPU components come from public figures and this project's H200 micro-benchmarks
   (experiments/gpu_microbench.py), docs/sources.md; nothing is fitted on these runs).
3. experiments/results/gpu_validation.csv (one row per layer and per step) and .json (summaries).
Captures stop when `--budget-s` is spent; the runs already captured are compared.
Without a GPU it stops with exit status 2; `--allow-cpu` runs the same pipeline on the CPU as a
smoke test (a CPU trace against a GPU prediction: its numbers mean nothing, and it writes under
--traces, not experiments/results). `--compare-only` compares the runs already captured under
--traces, on any machine (after a change to the parser or the model); the results say where and
when they were captured.

Besides the step (the untraced wall time) and its layers (each layer's kernel time), each run
gets a `kernels` row: the model's step against the traced GPU busy time per step, since the GPU
idles while the host dispatches and while a loop's condition is copied back (`idle_share`).
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time
from pathlib import Path

import validation_report
from perfmodel.spec.loaders import load_model
from perfmodel.util.errors import SpecError
from perfmodel.validate import host as validate
from perfmodel.validate.traces import capture_meta
from perfmodel_jax.capture import capture_reference

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"
MODELS = ("kimi-k3-host-small", "kimi-k3-host-large")
BATCHES = (1, 4, 16)
CONTEXTS = (256, 4096)
TARGETS = {"median_abs_step_error": 0.15, "median_abs_layer_error": 0.25}


def kernel_rows(variant: str, results) -> tuple[list[list], dict]:
    """A `kernels` CSV row per run (the model's step against the traced busy time per step) and
    their summary: the median |error| and the median idle share of the traced steps."""
    errors = [validate.rel_error(c.predicted_step_s, c.traced_busy_s) for c in results]
    rows = [[variant, c.model, c.mode, c.batch, c.context, "kernels", "kernels", c.predicted_step_s,
             c.traced_busy_s, "", "", e, "", "", c.hbm_efficiency, c.unattributed_share]
            for c, e in zip(results, errors)]
    med = lambda xs: statistics.median(xs) if xs else float("nan")
    return rows, {"median_abs_kernel_error": med([abs(e) for e in errors]),
                  "median_idle_share": med([c.idle_share for c in results])}


def device(allow_cpu: bool) -> tuple[str, bool]:
    """(the device's name, whether it is a GPU)."""
    import jax
    dev = jax.devices()[0]
    if dev.platform != "gpu" and not allow_cpu:
        raise SpecError("device", dev.platform, "this script needs a GPU (pip install 'jax[cuda12]'); "
                        "--allow-cpu runs the pipeline on the CPU as a smoke test")
    return dev.device_kind, dev.platform == "gpu"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", default="h200", help="the GPU's hardware preset or file")
    ap.add_argument("--quick", action="store_true", help="one model, batch 1, context 256")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop capturing after this long")
    ap.add_argument("--traces", default=str(ROOT / "out" / "gpu_traces"))
    ap.add_argument("--allow-cpu", action="store_true", help="smoke test without a GPU")
    ap.add_argument("--compare-only", action="store_true",
                    help="compare the runs already captured under --traces (no capture, any machine)")
    a = ap.parse_args(argv)
    models, batches, contexts = (MODELS[:1], (1,), (256,)) if a.quick else (MODELS, BATCHES, CONTEXTS)
    traces = Path(a.traces)
    command = "python " + " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    load_before = os.getloadavg()[0]
    if a.compare_only:
        captures = [capture_meta(f) for f in sorted(traces.glob("*/capture.json"))]
        if not captures:
            print(f"validate_gpu: --traces {traces}: no captured run (*/capture.json) there", file=sys.stderr)
            return 2
        captured = sorted({(c["model"], c["batch"]) for c in captures})
        machine, started = captures[0]["machine"], min(c["date"] for c in captures)
        load_before, a.steps = None, captures[0]["steps"]
    else:
        try:
            machine, on_gpu = device(a.allow_cpu)
        except SpecError as e:
            print(f"validate_gpu: {e}", file=sys.stderr)
            return 2
        t0, captured = time.monotonic(), []
        for m in models:
            for b in batches:
                left = a.budget_s - (time.monotonic() - t0)
                if left <= 0:
                    print(f"budget spent: {m} from batch {b} on not captured")
                    break
                capture_reference(m, traces, (b,), contexts, steps=a.steps, timeout_s=left)
                captured.append((load_model(m).name, b))

    results = [c for c in validate.validate(traces, hardware=a.hardware)
               if (c.model, c.batch) in captured and c.context in contexts]
    if not results:
        print(f"validate_gpu: --traces {traces}: no captured run of {', '.join(models)} at contexts "
              f"{', '.join(map(str, contexts))} there", file=sys.stderr)
        return 2
    smoke = any(c.platform != "gpu" for c in results)  # CPU traces: no GPU kernels were read
    out = traces if smoke or a.quick else RESULTS
    out_csv, out_json = out / "gpu_validation.csv", out / "gpu_validation.json"
    summaries = {"preset": validation_report.summary_of(results, [load_model(m).name for m in models],
                                                        TARGETS)}
    kernels, summaries["preset"]["kernels"] = kernel_rows("preset", results)
    meta = {"machine": machine, "date": started, "command": command, "hardware_file": a.hardware,
            "load_average_1min": {"start": load_before, "end": os.getloadavg()[0] if load_before is not None else None},
            "models": list(models), "batches": list(batches), "contexts": list(contexts), "steps": a.steps,
            "weights_dtype": "f32", "captured": [list(x) for x in captured],
            "note": ("smoke test on the CPU: not a GPU measurement" if smoke else
                     "nothing is fitted on these runs: the preset's figures (public ones and this "
                     "project's H200 micro-benchmarks)")}
    validation_report.write(out_csv, out_json, meta, validation_report.rows_of("preset", results) + kernels,
                            {"summary": summaries,
                             "runs": [{k: v for k, v in c.json().items() if k != "layers"} for c in results]})
    validation_report.print_summaries(summaries)
    k = summaries["preset"]["kernels"]
    print(f"  kernels: the model's step against the traced GPU busy time per step: median |error| "
          f"{k['median_abs_kernel_error']:.1%}; the GPU idle for {k['median_idle_share']:.0%} of a traced "
          f"step (median)")
    print(f"\nwrote {out_csv} and {out_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
