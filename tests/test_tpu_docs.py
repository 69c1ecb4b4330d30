"""The figures docs/tpu.md quotes from the committed TPU v5e runs
(experiments/results/tpu_megakernel.json) are the ones the file holds, so prose cannot drift
from a re-run."""
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tpu_status_quotes_the_committed_runs():
    text = " ".join((ROOT / "docs" / "tpu.md").read_text().split())   # line breaks as spaces
    runs = json.loads((ROOT / "experiments/results/tpu_megakernel.json").read_text())["runs"]
    mk = {r["batch"]: r for r in runs if r["kind"] == "megakernel" and not r.get("sweep")}
    xla = {r["batch"]: r["step_s"] for r in runs if r["kind"] == "xla"}
    k3 = next(r for r in runs if r["kind"] == "check" and r["slice"] == "k3-tp32-core")
    quoted = [f"{k3['logit_error']:.4f} of the logits' spread",
              *(f"{xla[b] / mk[b]['step_s']:.2f}x" for b in (1, 2, 4, 8)),
              f"{(mk[1]['lower_s'] + mk[1]['compile_s']):.1f} s at batch 1",
              f"{(mk[8]['lower_s'] + mk[8]['compile_s']):.1f} s at batch 8"]
    missing = [q for q in quoted if q not in text]
    assert not missing, f"docs/tpu.md does not quote the committed runs: {missing}"
