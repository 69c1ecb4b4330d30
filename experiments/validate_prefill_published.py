"""TTFT of published single-request prefills against the model (held-out checks, never fitted).

    python experiments/validate_prefill_published.py

Each row of perfmodel/data/published_ttft.csv (a dense model: Llama 3.3 70B fp8 on 2 H100 with
NVIDIA NIM; an MoE model: DeepSeek-R1-0528 AWQ on 8 H100 with vLLM) is predicted as one prompt
prefilled in one step on its hardware preset and layout (perfmodel.step.prefill.prefill), with
the checkpoint's weight formats. Prints predicted vs measured, the error, where the predicted
time goes (compute / collectives), and the median absolute error per model and overall; writes
experiments/results/prefill_published.csv and .json.
"""
from __future__ import annotations

import csv
import io
import json
import statistics
import sys
from pathlib import Path

from perfmodel.spec.arch import derive
from perfmodel.spec.deployment import Deployment
from perfmodel.spec.hardware import load_hardware
from perfmodel.step.prefill import prefill, prefill_prediction
from perfmodel.util.files import write_atomic, write_csv

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "perfmodel" / "data" / "published_ttft.csv"
RESULTS = ROOT / "experiments" / "results"


def rows() -> list[dict]:
    text = "".join(line for line in DATA.read_text().splitlines(keepends=True) if not line.startswith("#"))
    return list(csv.DictReader(io.StringIO(text)))


def model_of(r: dict):
    formats = dict(kv.split("=") for kv in r["formats"].split(";") if kv)
    return derive(r["model"], name=f"{r['model']}-{r['id'].split('-')[1]}", formats=formats)


def main() -> int:
    out = []
    for r in rows():
        model, hw = model_of(r), load_hardware(r["hardware"])
        d = Deployment(devices=int(r["devices"]), tp=int(r["tp"]), ep=int(r["ep"]) if r["ep"] else None,
                       engine=r["engine"])
        n = int(r["prompt_tokens"])
        predicted = prefill(model, hw, d, n).ttft_s
        waits = prefill_prediction(model, hw, d, n).breakdown_s
        measured = float(r["measured_ttft_s"])
        out.append({"id": r["id"], "model": r["model"], "kind": "moe" if model.moe else "dense",
                    "hardware": r["hardware"], "devices": d.devices, "tp": d.tp, "prompt_tokens": n,
                    "measured_ttft_s": measured, "predicted_ttft_s": predicted,
                    "error": predicted / measured - 1, "compute_s": waits["compute"],
                    "collective_s": waits["collective"], "software": r["software"], "source": r["source"]})
    print(f"{'id':18s} {'tokens':>6s} {'measured ms':>11s} {'predicted ms':>12s} {'error':>7s} "
          f"{'compute ms':>10s} {'collective ms':>13s}")
    for o in out:
        print(f"{o['id']:18s} {o['prompt_tokens']:6d} {1e3 * o['measured_ttft_s']:11.1f} "
              f"{1e3 * o['predicted_ttft_s']:12.1f} {o['error']:+7.1%} {1e3 * o['compute_s']:10.1f} "
              f"{1e3 * o['collective_s']:13.1f}")
    summary = {}
    for kind in ("dense", "moe"):
        errs = [abs(o["error"]) for o in out if o["kind"] == kind]
        summary[f"median_abs_error_{kind}"] = statistics.median(errs)
    summary["median_abs_error"] = statistics.median(abs(o["error"]) for o in out)
    print("\nmedian |error|: dense {median_abs_error_dense:.1%}, MoE {median_abs_error_moe:.1%}, "
          "all {median_abs_error:.1%}".format(**summary))
    RESULTS.mkdir(parents=True, exist_ok=True)
    command = "python experiments/validate_prefill_published.py"
    write_csv(RESULTS / "prefill_published.csv", [f"command: {command}", "held-out: never fitted"],
              list(out[0]), [list(o.values()) for o in out])
    write_atomic(RESULTS / "prefill_published.json",
                 json.dumps({"command": command, "summary": summary, "rows": out}, indent=1) + "\n")
    print(f"wrote {RESULTS / 'prefill_published.csv'} and .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
