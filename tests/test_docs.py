"""experiments/docs.py: figure blocks are rewritten from their renderer, a stale one fails the check,
an unknown one is an error naming it."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))
import docs  # noqa: E402


@pytest.fixture
def page(tmp_path, monkeypatch):
    p = tmp_path / "page.md"
    monkeypatch.setattr(docs, "PAGES", [p])
    monkeypatch.setattr(docs, "ROOT", tmp_path)
    monkeypatch.setattr(docs, "FIGURES", {"answer": lambda: "| x |\n|---:|\n| 42 |\n"})
    return p


def run(*args):
    old = sys.argv
    sys.argv = ["docs.py", *args]
    try:
        return docs.main()
    finally:
        sys.argv = old


def test_stale_figure_fails_the_check_and_is_rewritten(page, capsys):
    page.write_text("intro\n<!-- figure answer -->\n| x |\n|---:|\n| 41 |\n<!-- /figure -->\nafter\n")
    assert run("--check") == 1 and "-| 41 |" in capsys.readouterr().out
    assert run() == 0
    assert page.read_text() == "intro\n<!-- figure answer -->\n| x |\n|---:|\n| 42 |\n<!-- /figure -->\nafter\n"
    assert run("--check") == 0


def test_unknown_figure_is_named(page):
    page.write_text("<!-- figure nope -->\n<!-- /figure -->\n")
    with pytest.raises(SystemExit, match="unknown figure 'nope'"):
        run("--check")


def test_md_table_and_ms():
    assert docs.md_table(["a", "b"], [["x", 1]]) == "| a | b |\n|---|---:|\n| x | 1 |\n"
    assert docs.ms(-1e-7) == "0.00" and docs.ms(0.00123) == "1.23"


def test_pct_param_value_and_ids_pattern():
    assert docs.pct(0.1234) == "12.3 %" and docs.pct(-0.0004, signed=True) == "0.0 %"
    assert docs.pct(0.0004, signed=True) == "0.0 %" and docs.pct(-0.05, signed=True) == "-5.0 %"
    assert docs.param_value("dot_gemv_bandwidth_bytes_per_s", 4.5e10) == "45.0 GB/s"
    assert docs.param_value("host_convert_values_per_s", 8.75e8) == "0.875 G values/s"
    assert docs.param_value("dot_gemm_row_s_per_byte", 1.369e-12) == "1.37 ps/B"
    assert docs.param_value("dot_fixed_s", 1.52e-5) == "15.2 us"
    assert docs.param_value("host_absorb_fixed_s", 7.45e-20) == "0 us (fitted 7.5e-20)"
    assert docs.ids_pattern(["host-stack-copy-f32-6x1x8", "host-stack-copy-f32-6x16x8"]) == "host-stack-copy-f32-* (2)"
    assert docs.ids_pattern(["host-dot-f32-r1", "host-dot-chain-f32-r1"]) == "host-dot-* (2)"
    assert docs.ids_pattern(["host-argmax-f32-1x32768"]) == "host-argmax-f32-1x32768"


def test_every_component_group_names_its_functions():
    from perfmodel.cost import components
    from perfmodel.fit.microbench import GROUPS
    assert set(docs.COMPONENT_FUNCTIONS) == set(GROUPS)
    assert all(callable(getattr(components, f.strip())) for fs in docs.COMPONENT_FUNCTIONS.values()
               for f in fs.split(","))


@pytest.fixture
def host_results(tmp_path, monkeypatch):
    """A validation run of two steps of one model, the committed host hardware file beside it."""
    import csv
    import json
    from perfmodel.spec.deployment import Deployment
    from perfmodel.spec.hardware import load_hardware
    from perfmodel.step.predict import predict
    from perfmodel.spec.loaders import load_model
    from perfmodel.validate.host import host_hardware, own_structure
    (tmp_path / "host-cpu.toml").write_text((docs.RESULTS / "host-cpu.toml").read_text())
    monkeypatch.setattr(docs, "RESULTS", tmp_path)
    monkeypatch.setattr(docs, "ROOT", tmp_path)
    spec = load_model("kimi-k3-host-small")
    hw = own_structure(load_hardware(str(tmp_path / "host-cpu.toml")), spec.name)
    now = {mode: predict(spec, host_hardware(hw, mode), Deployment(devices=1, tp=1, engine="multikernel",
                                                                   batch=1, context=256)).step_s
           for mode in ("compiled", "op_by_op")}
    measured = {"compiled": now["compiled"] / 0.8, "op_by_op": now["op_by_op"] / 1.1}  # errors -20 %, +10 %

    def write(date: str, recorded: dict[str, float]):
        with open(tmp_path / "host_validation.csv", "w", newline="") as f:
            f.write(f"# date: {date}\n")
            w = csv.writer(f)
            w.writerow(["variant", "model", "mode", "batch", "context", "layer", "kind", "predicted_s",
                        "measured_s", "rel_error"])
            for mode in ("compiled", "op_by_op"):
                w.writerow(["file", spec.name, mode, 1, 256, "step", "step", recorded[mode], measured[mode],
                            recorded[mode] / measured[mode] - 1])
                w.writerow(["file", spec.name, mode, 1, 256, 1, "kda+dense", 1e-4, 2e-4, -0.5])
        s = {"runs": 2, "median_abs_step_error": 0.15, "median_abs_layer_error": 0.5,
             "median_abs_gap_error": 0.3, "max_unattributed_share": 0.0,
             "gaps": [{"measured_gap_s": -1e-4}]}
        s["per_model"] = {spec.name: dict(s)}
        s["targets"] = {k: {"target": t, "value": s[k], "met": s[k] <= t} for k, t in
                        (("median_abs_step_error", 0.15), ("median_abs_layer_error", 0.25),
                         ("median_abs_gap_error", 0.25))}
        meta = {"date": "2026-12-01T14:08:30+00:00", "machine": "a CPU", "command": "python x.py",
                "weights_dtype": "f32", "steps": 3, "load_average_1min": {"start": 1.0, "end": 2.0}}
        (tmp_path / "host_validation.json").write_text(json.dumps({"meta": meta, "summary": {"file": s}}))
    return write, now


def test_host_validation_figure(host_results):
    write, now = host_results
    write("2026-12-01T14:08:30+00:00", now)
    fig = docs.fig_host_validation()
    assert "| hardware file as measured | all, 2 | 15.0 % | -5.0 % | 1 of 2 | 50.0 % | 30.0 % |" in fig
    assert "<= 15 % (met)" in fig and "<= 25 % (missed)" in fig and "negative at 1 of 1 points" in fig
    assert "load average 1.00 at the start and 2.00 at the end" in fig
    assert "The run's 2 step predictions" in fig and "Stale" not in fig
    assert docs.fig_host_steps().splitlines()[2] == "| small | 256 | compiled | -20.0 % |"
    assert "| kda+dense | -50.0 % (1) | -50.0 % (1) |" in docs.fig_host_layer_kinds()


def test_host_validation_figure_flags_changed_predictions_and_mixed_runs(host_results):
    write, now = host_results
    write("2026-12-01T14:08:30+00:00", {**now, "op_by_op": now["op_by_op"] * 1.02})
    assert "**Stale:** 1 of the run's 2 step predictions" in docs.fig_host_validation()
    write("2026-12-02T09:00:00+00:00", now)
    with pytest.raises(SystemExit, match="are of two runs"):
        docs.fig_host_validation()
