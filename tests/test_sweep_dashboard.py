"""The dashboard's Design search view: Pareto plot, sortable table, reproducing command."""
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("streamlit")
from streamlit.testing.v1 import AppTest  # noqa: E402

from perfmodel.search import design  # noqa: E402
from perfmodel.search.sweep import run_design  # noqa: E402
from test_dashboard import chart, commands, series  # noqa: E402

APP = Path(__file__).resolve().parents[1] / "dashboards" / "app.py"


def open_view(**state):
    at = AppTest.from_file(str(APP), default_timeout=300)
    at.session_state["view"] = "Design search"
    for k, v in state.items():
        at.session_state[k] = v
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def test_design_search_view_shows_the_front_and_the_command():
    at = open_view(ds_model="kimi-k3-mini", ds_devices=2, ds_tp=2, ds_ep=2, ds_batch=[1, 8, 64],
                   ds_prefetch_mib=[2, 8], ds_vmem_mib=[16, 64], ds_expert_slots=[1, 4], ds_context=[4096])
    assert not at.error and not at.dataframe  # the rows open on demand
    assert not at.code  # the sweep file opens on demand
    at.session_state["ds_rows_exp"] = at.session_state["ds_file_exp"] = True
    at.run()
    text = next(c.value for c in at.code if c.language == "toml")
    cmd = next(c for c in commands(at) if c.startswith("perfmodel sweep"))
    assert "--design design.toml" in cmd and "--objective tokens_per_s_per_chip" in cmd
    # the file on the page gives the same front as the plot
    s = run_design(design.from_dict(tomllib.loads(text)), jobs=1, progress=False)
    assert s["points"] == 3 * 2 * 2 * 2
    front = series(chart(at, "ds_pareto"))["Pareto front"]
    assert [r["tokens_per_s_per_chip"] for r in front] == [r["tokens_per_s_per_chip"] for r in s["pareto"]] and s["pareto"]
    table = at.dataframe[0].value
    assert sorted(table["point"]) == sorted(r["point"] for r in s["pareto"])
    at.radio(key="ds_rows").set_value("all").run()
    assert len(at.dataframe[0].value) == s["points"]


def test_a_design_where_nothing_fits_says_so():
    at = open_view(ds_model="kimi-k3", ds_devices=8, ds_tp=8, ds_ep=8, ds_batch=[1], ds_prefetch_mib=[8],
                   ds_expert_slots=[], ds_vmem_mib=[64], ds_context=[4096])
    assert any("No configuration" in w.value for w in at.warning)
    assert any("memory" in cap.value and "does not fit" in cap.value for cap in at.caption)


@pytest.mark.parametrize("suffix", ["parquet", "csv"])
def test_a_results_file_gives_the_sweeps_front_and_top(tmp_path, suffix):
    import sys
    sys.path.insert(0, str(APP.parent))
    from pmdash import design as view

    from perfmodel.util.errors import SpecError
    d = design.from_dict({"base": {"model": "kimi-k3-mini", "devices": 2},
                          "grid": {"batch": [1, 4, 16, 64], "vmem_mib": [0.25, 16], "prefetch_mib": [1, 4]}})
    path = tmp_path / f"rows.{suffix}"
    s = run_design(d, out=str(path), top=3, objective="step_s", jobs=1, keep_rows=True, progress=False)
    got = view.read_results(path.read_bytes(), path.name, 3, "step_s")
    assert got["points"] == s["points"] == 16 and got["filtered"] == s["filtered"] and got["ok"] == s["ok"]
    assert [r["point"] for r in got["top"]] == [r["point"] for r in s["top"]]
    assert [r["point"] for r in got["pareto"]] == [r["point"] for r in s["pareto"]]
    assert [r["step_s"] for r in got["pareto"]] == [r["step_s"] for r in s["pareto"]]
    bad = tmp_path / "other.csv"
    bad.write_text("a,b\n1,2\n")
    with pytest.raises(SpecError, match="not perfmodel sweep output"):
        view.read_results(bad.read_bytes(), bad.name, 3, "step_s")


def test_opening_a_results_file_survives_the_next_rerun(tmp_path):
    """An uploaded results file stays usable when the page reruns (the inputs kept across views once
    tried to re-assign the uploader's state and broke the view)."""
    d = design.from_dict({"base": {"model": "kimi-k3-mini", "devices": 2}, "grid": {"batch": [1, 4, 16]}})
    path = tmp_path / "rows.csv"
    run_design(d, out=str(path), jobs=1, progress=False)
    at = open_view(ds_source="Open a results file")
    at.file_uploader(key="ds_upload").set_value(("rows.csv", path.read_bytes(), "text/csv")).run()
    assert not at.exception and not at.error
    at.selectbox(key="ds_file_objective").set_value("step_s").run()
    at.sidebar.radio(key="view").set_value("Compare").run()
    at.sidebar.radio(key="view").set_value("Design search").run()
    assert not at.exception, [e.value for e in at.exception]
    assert not at.error, [e.value for e in at.error]
