"""Host validation of prefill: trace the reference's prefill of whole prompts on this CPU and
compare with the model, per layer and per step (the decode check's attribution and host engine).

    python experiments/validate_prefill_host.py [--quick] [--traces out/prefill_traces] [--steps 3]

1. The hardware file: experiments/results/host-cpu.toml (written by `perfmodel hostbench` in
   experiments/validate_host.py; nothing here is fitted).
2. For kimi-k3-host-small and kimi-k3-host-large, batch 1 and 4, prompts of 128 and 512
   tokens: traces of `perfmodel_kernels.prefill.prefill_step` (one compiled program; mode prefill of
   perfmodel_jax.capture), its structure counted in its compiled HLO (thunks with loops
   expanded, the loops' bytes).
3. Predictions of one prefill step with the multi-kernel engine on one CPU device
   (perfmodel.validate.host, mode prefill). Median absolute errors, step and per layer.
Writes experiments/results/prefill_host_validation.csv (one row per layer and per step) and .json.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
from pathlib import Path

from perfmodel.util.files import write_atomic, write_csv
from perfmodel.validate import host as validate
from perfmodel_jax.capture import capture_reference
from perfmodel_jax.hostbench import cpu_model

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"
MODELS = ("kimi-k3-host-small", "kimi-k3-host-large")
BATCHES = (1, 4)
PROMPTS = (128, 512)


def main() -> int:
    import json
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the small model, batch 1, 128 tokens (a smoke test)")
    ap.add_argument("--traces", default=str(ROOT / "out" / "prefill_traces"))
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--skip-capture", action="store_true", help="reuse the traces already there")
    a = ap.parse_args()
    models, batches, prompts = (MODELS[:1], BATCHES[:1], PROMPTS[:1]) if a.quick else (MODELS, BATCHES, PROMPTS)
    hw = str(RESULTS / "host-cpu.toml")
    load = [os.getloadavg()[0]]
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if not a.skip_capture:
        for m in models:
            capture_reference(m, a.traces, batches, prompts, modes=("prefill",), steps=a.steps)
    results = [c for c in validate.validate(a.traces, hardware=hw) if c.mode == "prefill"
               and c.batch in batches and c.context in prompts]
    load.append(os.getloadavg()[0])
    rows = []
    print(f"{'run':42s} {'predicted ms':>12s} {'measured ms':>11s} {'error':>7s} {'layer MAPE':>10s}")
    for c in sorted(results, key=lambda c: (c.model, c.batch, c.context)):
        print(f"{c.run:42s} {1e3 * c.predicted_step_s:12.2f} {1e3 * c.measured_step_s:11.2f} "
              f"{c.step_error:+7.1%} {c.layer_mape:10.1%}")
        rows.append([c.run, c.model, c.batch, c.context, "step", "", c.predicted_step_s, c.measured_step_s, c.step_error])
        rows += [[c.run, c.model, c.batch, c.context, l.layer, l.kind, l.predicted_s, l.measured_s, l.rel_error]
                 for l in c.layers]
    layer_errs = [abs(l.rel_error) for c in results for l in c.layers if l.measured_s > 0]
    summary = {"runs": len(results), "median_abs_step_error": statistics.median(abs(c.step_error) for c in results),
               "median_abs_layer_error": statistics.median(layer_errs),
               "median_signed_step_error": statistics.median(c.step_error for c in results)}
    by_kind: dict[str, list[float]] = {}
    for c in results:
        for l in c.layers:
            if l.measured_s > 0:
                by_kind.setdefault(l.kind, []).append(l.rel_error)
    summary["median_signed_layer_error_by_kind"] = {k: statistics.median(v) for k, v in sorted(by_kind.items())}
    print(f"\nmedian |step error| {summary['median_abs_step_error']:.1%} (signed {summary['median_signed_step_error']:+.1%}), "
          f"median |layer error| {summary['median_abs_layer_error']:.1%}; signed by layer kind: "
          + ", ".join(f"{k} {v:+.1%}" for k, v in summary["median_signed_layer_error_by_kind"].items())
          + f"; load average {load[0]:.2f} -> {load[1]:.2f}")
    command = "python " + " ".join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]])
    meta = {"machine": cpu_model(), "date": started, "command": command, "hardware_file": "experiments/results/host-cpu.toml",
            "load_average_1min": {"start": load[0], "end": load[1]}, "models": list(models), "batches": list(batches),
            "prompts": list(prompts), "steps": a.steps, "note": "nothing is fitted on these runs"}
    out = RESULTS if not a.quick else Path(a.traces)
    write_csv(out / "prefill_host_validation.csv", [f"{k}: {v}" for k, v in meta.items()],
              ["run", "model", "batch", "prompt", "layer", "kind", "predicted_s", "measured_s", "error"], rows)
    write_atomic(out / "prefill_host_validation.json", json.dumps(
        {**meta, "summary": summary, "results": [c.json() for c in results]}, indent=1) + "\n", parents=True)
    print(f"wrote {out / 'prefill_host_validation.csv'} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
