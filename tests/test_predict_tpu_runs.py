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
    """The latest TP32-core run at batch 1 ran its format's tuned config: planned from that run in
    its own format, the prediction is validate_tpu's for it; another format at the same picks differs."""
    runs = json.loads(vt.DEFAULT_RESULTS.read_text())["runs"]
    base = ptr.template(runs, "k3-tp32-core", 1)
    mk, xla = ptr.predict(ptr.planned(base, base["format"], {}))
    assert ptr.planned(base, base["format"], {})["config"] == base["config"]
    _, _, p, _, t0, _ = vt.predict_megakernel(base, "tpu-v5e")
    assert mk == pytest.approx(vt.megakernel_step_s(base, "tpu-v5e", p.step_s, t0), rel=1e-9)
    assert 0 < mk < xla
    other = "int8" if base["format"] != "int8" else "mxfp4"
    assert ptr.predict(ptr.planned(base, other, {}))[0] != pytest.approx(mk, rel=1e-3)
    assert ptr.main(["--slices", "k3-tp32-core", "--formats", "mxfp4", "--batches", "1", "--depth", "2"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("k3-tp32-core mxfp4 b1 (depth 2, 4 slots, 32768-row banks, decode e2m1_words)")


@pytest.mark.parametrize("argv, field", [(["--slices", "k3-tp4"], "slices='k3-tp4'"),
                                         (["--batches", "3"], "batch=3"), (["--batches", "x"], "invalid literal")])
def test_bad_input_is_one_line_naming_it(argv, field, capsys):
    assert ptr.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("predict_tpu_runs: error:") and field in err and len(err.splitlines()) == 1


def test_a_config_over_the_vmem_is_named_not_predicted(capsys):
    """TP8-core int8 at its tuned config (two 32.5 MiB expert slots beside 48 MiB of ring) is over
    the v5e's VMEM: tpu_megakernel.py skips it, so no prediction is printed for it, only why."""
    assert ptr.main(["--slices", "k3-tp8-core", "--formats", "int8", "--batches", "1"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith("k3-tp8-core int8 b1: not run") and "vmem=" in out and "a step" not in out
    assert ptr.main(["--slices", "k3-tp8-core", "--formats", "int4", "--batches", "1"]) == 0
    assert "a step" in capsys.readouterr().out
