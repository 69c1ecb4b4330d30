"""experiments/trace_gaps.py: the stretches of a kept trace's phases no marker covers (no TPU)."""
import sys
from pathlib import Path

import pytest

pytest.importorskip("jax")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
import trace_gaps  # noqa: E402

TRACE = ROOT / "tests" / "data" / "tpu_v5e_k3_b1.xplane.pb.gz"   # a TP32-core step of 2026-12-06


def test_a_phases_unmarked_stretches_are_what_its_markers_leave():
    rows = trace_gaps.step_gaps(trace_gaps.markers(TRACE))
    assert [r["phase"] for r in rows] == ["embed"] + [f"layer {n} {p}" for n in (1, 2, 3, 4)
                                                      for p in ("attention", "ffn")] + ["head"]
    for r in rows:
        assert all(d > 0 and r["start_us"] <= s and s + d <= r["start_us"] + r["us"] + 1e-6 for s, d in r["gaps"])
        assert sum(d for _, d in r["gaps"]) <= r["us"] + 1e-6
    by = {r["phase"]: r for r in rows}
    # router and experts (the shared one inside) cover the MoE layer's FFN but 0.8 us
    assert sum(d for _, d in by["layer 2 ffn"]["gaps"]) < 1.0 < by["layer 2 ffn"]["us"]
    assert by["layer 1 attention"]["gaps"] == [(by["layer 1 attention"]["start_us"], by["layer 1 attention"]["us"])]


def test_a_step_the_trace_lacks_is_one_line_naming_it(capsys):
    assert trace_gaps.main([str(TRACE), "--step", "99"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("trace_gaps: error:") and "step=99" in err and len(err.splitlines()) == 1
    assert trace_gaps.main([str(TRACE), "--min-us", "1"]) == 0
    assert "layer 4 attention" in capsys.readouterr().out


def test_a_truncated_gzip_is_one_line_naming_the_file(tmp_path, capsys):
    bad = tmp_path / "cut.xplane.pb.gz"
    bad.write_bytes(TRACE.read_bytes()[:1000])
    assert trace_gaps.main([str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("trace_gaps: error: trace=") and "cut.xplane.pb.gz" in err and len(err.splitlines()) == 1
