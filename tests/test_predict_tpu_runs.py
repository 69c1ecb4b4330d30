"""experiments/predict_tpu_runs.py: a planned run predicted before a device call measures it, on the
committed runs' picks (no TPU)."""
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
import predict_tpu_runs as ptr  # noqa: E402
import validate_tpu as vt  # noqa: E402


def test_a_planned_run_at_a_measured_config_is_predicted_as_validate_tpu_predicts_that_run(capsys):
    """The tuned TP32-core MXFP4 config at batch 1 is what call o measured: planned from that run,
    the prediction is validate_tpu's for it; another format at the same picks differs."""
    runs = json.loads(vt.DEFAULT_RESULTS.read_text())["runs"]
    base = ptr.template(runs, "k3-tp32-core", 1)
    mk, xla = ptr.predict(ptr.planned(base, "mxfp4", {}))
    assert ptr.planned(base, "mxfp4", {})["config"] == base["config"]
    _, _, p, _, t0, _ = vt.predict_megakernel(base, "tpu-v5e")
    assert mk == pytest.approx(vt.megakernel_step_s(base, "tpu-v5e", p.step_s, t0), rel=1e-9)
    assert 0 < mk < xla
    assert ptr.predict(ptr.planned(base, "int8", {}))[0] != pytest.approx(mk, rel=1e-3)
    assert ptr.main(["--slices", "k3-tp32-core", "--formats", "mxfp4", "--batches", "1", "--depth", "2"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("k3-tp32-core mxfp4 b1 (depth 2, 4 slots, 32768-row banks, decode e2m1_words)")


@pytest.mark.parametrize("argv, field", [(["--slices", "k3-tp4"], "slices='k3-tp4'"),
                                         (["--batches", "3"], "batch=3"), (["--batches", "x"], "invalid literal")])
def test_bad_input_is_one_line_naming_it(argv, field, capsys):
    assert ptr.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("predict_tpu_runs: error:") and field in err and len(err.splitlines()) == 1
