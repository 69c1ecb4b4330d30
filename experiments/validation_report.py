"""What the validation scripts (validate_host.py, validate_gpu.py) write and print: one CSV row per
step and per layer of every compared run, a JSON of summaries, and the summary lines."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from perfmodel.util.files import write_atomic, write_csv
from perfmodel.validate import host as validate

COLUMNS = ["variant", "model", "mode", "batch", "context", "layer", "kind", "predicted_s", "measured_s",
           "measured_min_s", "measured_max_s", "rel_error", "model_ops", "traced_ops", "hbm_efficiency",
           "unattributed_share"]


def summary_of(results, models: list[str], targets: dict[str, float]) -> dict:
    """perfmodel.validate.host.summary of all runs, per model, and each target met or not."""
    s = validate.summary(results)
    s["per_model"] = {m: validate.summary([c for c in results if c.model == m]) for m in models}
    s["targets"] = {k: {"target": v, "value": s[k], "met": s[k] <= v} for k, v in targets.items()}
    return s


def rows_of(variant: str, results) -> list[list]:
    """CSV rows of perfmodel.validate.host Comparisons: the step, then each layer."""
    rows = []
    for c in results:
        base = [variant, c.model, c.mode, c.batch, c.context]
        rows.append(base + ["step", "step", c.predicted_step_s, c.measured_step_s, "", "", c.step_error,
                            sum(r.predicted_ops for r in c.layers), sum(r.measured_ops for r in c.layers),
                            c.hbm_efficiency, c.unattributed_share])
        rows += [base + [r.layer, r.kind, r.predicted_s, r.measured_s, r.measured_min_s, r.measured_max_s,
                         r.rel_error, r.predicted_ops, r.measured_ops, c.hbm_efficiency, ""] for r in c.layers]
    return rows


def write(out_csv: Path, out_json: Path, meta: dict, rows: list[list], document: dict) -> None:
    """The CSV (with the run's metadata as comment lines) and the JSON ({"meta": ..., **document}),
    each written whole or not at all."""
    write_csv(out_csv, [f"{k}: {meta[k]}" for k in ("machine", "date", "command", "hardware_file",
                                                     "load_average_1min", "note")], COLUMNS, rows)
    write_atomic(out_json, json.dumps({"meta": meta, **document}, indent=1) + "\n", parents=True)


def print_summaries(summaries: dict[str, dict]) -> None:
    for variant, s in summaries.items():
        print(f"\n[{variant}] {s['runs']} runs")
        for m, ms in s["per_model"].items():
            print(f"  {m}: median |step error| {ms['median_abs_step_error']:.1%}, median |layer "
                  f"error| {ms['median_abs_layer_error']:.1%}, median |gap error| "
                  f"{ms['median_abs_gap_error']:.1%}")
        for k, t in s["targets"].items():
            print(f"  {k}: {t['value']:.1%} (target <= {t['target']:.0%}) "
                  f"{'met' if t['met'] else 'MISSED'}")
        per_dispatch = [abs(g["per_dispatch_gap_error"]) for g in s["gaps"] if "per_dispatch_gap_error" in g]
        if per_dispatch:
            print(f"  diagnostic: gap at one dispatch per phase, cost by argument count: median |error| "
                  f"{statistics.median(per_dispatch):.1%}")
        print(f"  max unattributed share of traced op time: {s['max_unattributed_share']:.2%}")
