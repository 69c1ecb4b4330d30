"""The figures docs/tpu.md quotes from the committed TPU v5e runs
(experiments/results/tpu_megakernel.json) are the ones the file holds, so prose cannot drift
from a re-run."""
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_tpu_status_quotes_the_committed_runs():
    text = " ".join((ROOT / "docs" / "tpu.md").read_text().split())   # line breaks as spaces
    runs = json.loads((ROOT / "experiments/results/tpu_megakernel.json").read_text())["runs"]
    mk = {(r["format"], r["batch"]): r for r in runs if r["kind"] == "megakernel" and not r.get("sweep")}
    xla = {(r["format"], r["batch"]): r["step_s"] for r in runs if r["kind"] == "xla"}
    checks = {r["format"]: r for r in runs if r["kind"] == "check" and r["slice"] == "k3-tp32-core"}
    sweep = {(r["config"]["depth"], r["config"]["expert_slots"]): r["step_s"] for r in runs
             if r["kind"] == "megakernel" and r.get("sweep") and r["config"]["bank_rows"] == 8192}
    us = lambda s: f"{s * 1e6:.1f}"  # noqa: E731
    quoted = [*(f"{checks[f]['logit_error']:.4f} of the logits' spread" for f in ("mxfp4", "int8")),
              *(f"{xla[k] / mk[k]['step_s']:.2f}x" for k in
                (("mxfp4", 1), ("mxfp4", 2), ("mxfp4", 4), ("mxfp4", 8), ("int8", 1))),
              f"{(mk['mxfp4', 1]['lower_s'] + mk['mxfp4', 1]['compile_s']):.1f} s at batch 1",
              f"{(mk['mxfp4', 8]['lower_s'] + mk['mxfp4', 8]['compile_s']):.1f} s at batch 8",
              f"{us(mk['int8', 1]['step_s'])} us a step against MXFP4's {us(mk['mxfp4', 1]['step_s'])} us",
              ", ".join(us(sweep[d, 2]) for d in (1, 2, 4, 8, 16)) + f", {us(sweep[32, 2])} us a step",
              ", ".join(us(sweep[8, k]) for k in (1, 2)) + f", {us(sweep[8, 4])} us"]
    missing = [q for q in quoted if q not in text]
    assert not missing, f"docs/tpu.md does not quote the committed runs: {missing}"


def test_readme_quotes_the_committed_stream_shares():
    text = " ".join((ROOT / "README.md").read_text().split())
    res = json.loads((ROOT / "experiments/results/tpu_megakernel.json").read_text())
    share = {r["format"]: r["plan_bytes_per_s"] / res["stream_bytes_per_s"] for r in res["runs"]
             if r["kind"] == "megakernel" and not r.get("sweep") and r["batch"] == 1}
    assert f"int8 experts it moves {share['int8']:.0%}".replace("%", " %") in text
    assert f"MXFP4 experts {share['mxfp4']:.0%}".replace("%", " %") in text
