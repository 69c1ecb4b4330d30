"""The Streamlit dashboard, driven headless with streamlit.testing.v1.AppTest.

Every view and widget: a value change must change the outputs the way it should, bad input must
show a message in the page (st.error) and never an exception, and the CLI command shown next to
a number must reproduce it.
"""
from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("streamlit")
from streamlit.testing.v1 import AppTest  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "dashboards" / "app.py"
sys.path.insert(0, str(APP.parent))

from pmdash import common, measured, validation, whatif  # noqa: E402

from perfmodel.fit.measurements import seed_measurements  # noqa: E402

TIMEOUT = 120


def published_label(tag: str, hardware: str) -> str:
    """Compare's label of a platform at the published table's deployment (the table's first row of that chip)."""
    m = next(m for m in seed_measurements() if m.hardware == hardware)
    engine = f"{m.serving_engine} kernels" if m.serving_engine else m.engine
    return (f"{tag}: {hardware} {engine} ({m.devices} dev, tp {m.tp}, ep {m.ep}"
            + (f", KV {m.kv_cache}" if m.kv_cache else "") + ")")


TPU_V7, GB200 = published_label("A", "tpu-v7"), published_label("B", "gb200")


# the expanders that draw their tables only when opened (lazy): the tests open them
TABLE_EXPANDERS = ("cmp_errors_exp", "cmp_pred_exp", "wi_layers_exp", "ex_ops_exp", "ds_rows_exp",
                   "val_host_table_exp", "val_trace_exp", "val_runs_exp",
                   "val_profile_exp")  # the sections drawn on demand


def open_view(view: str = "Compare", errors_ok: bool = False, tab: str | None = None, **state) -> AppTest:
    """The app on one view (and What-if tab), its on-demand sections open, `state` set before the first run."""
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT)
    at.session_state["view"] = view
    for k in TABLE_EXPANDERS:
        at.session_state[k] = True
    if tab:
        at.session_state["wi_tab"] = tab
    for k, v in state.items():
        at.session_state[k] = v
    at.run()
    assert_clean(at, errors_ok)
    return at


def assert_clean(at: AppTest, errors_ok: bool = False) -> None:
    assert not at.exception, [e.value for e in at.exception]
    if not errors_ok:
        assert not at.error, [e.value for e in at.error]


def errors(at: AppTest) -> list[str]:
    return [e.value for e in at.error]


def assert_message(at: AppTest, needle: str) -> None:
    """No exception, and an error element in the page that contains `needle`."""
    assert_clean(at, errors_ok=True)
    assert any(needle in e for e in errors(at)), errors(at)


def charts(at: AppTest) -> dict[str, dict]:
    """Vega-Lite charts on the page by key (the spec's name), as their specs."""
    return {spec["name"]: spec for spec in (json.loads(el.proto.spec) for el in at.get("vega_lite_chart"))}


def chart(at: AppTest, key: str) -> dict:
    found = charts(at)
    assert key in found, f"no chart with key {key}; have {list(found)}"
    return found[key]


def layers(spec: dict) -> list[dict]:
    """A spec's unit layers (nested layers flattened)."""
    return [u for lay in spec.get("layer", []) for u in (layers(lay) if "layer" in lay else [lay])]


def mark_type(lay: dict) -> str:
    return lay["mark"] if isinstance(lay["mark"], str) else lay["mark"]["type"]


def series(spec: dict, *marks: str) -> dict[str, list[dict]]:
    """The rows a chart draws by series (its legend entry), of every layer or of the layers of these marks."""
    out: dict[str, list[dict]] = {}
    for lay in layers(spec):
        if not marks or mark_type(lay) in marks:
            for r in lay["data"]["values"]:
                out.setdefault(r["series"], []).append(r)
    return out


def scale(spec: dict, channel: str) -> dict:
    """The scale of `channel` (x, y, color, shape, ...) as the first layer that sets one gives it."""
    return next(lay["encoding"][channel]["scale"] for lay in layers(spec)
                if lay["encoding"].get(channel, {}).get("scale"))


def legend(spec: dict, channel: str) -> dict:
    """Series name -> the value a scale maps it to (its colour, its shape)."""
    sc = scale(spec, channel)
    return dict(zip(sc["domain"], sc["range"]))


def schema_errors(spec: dict) -> list[str]:
    """What the Vega-Lite schema (altair's copy) finds wrong with a spec."""
    import jsonschema
    from altair.vegalite.v6 import schema as vl
    validator = jsonschema.Draft7Validator(json.loads((Path(vl.__file__).parent / "vega-lite-schema.json").read_text()))
    return [e.message for e in validator.iter_errors(spec)]


def typed(at: AppTest, key: str, value) -> AppTest:
    """Type a value into a text field (None: clear it) and rerun."""
    text = "" if value is None else (f"{value:g}" if isinstance(value, float) else str(value))
    return at.text_input(key=key).input(text).run()


def use_deployment(at: AppTest, prefix: str, hw: str, engine: str, **layout) -> AppTest:
    """A view's hardware, engine and layout fields (PREFIX_hw, PREFIX_engine, PREFIX_devices ...) set in turn."""
    at.selectbox(key=f"{prefix}_hw").set_value(hw).run()
    at.radio(key=f"{prefix}_engine").set_value(engine).run()
    for field, v in layout.items():
        typed(at, f"{prefix}_{field}", v)
    return at


def metric(at: AppTest, label: str) -> str:
    return next(m.value for m in at.metric if m.label == label)


def headline(at: AppTest, label: str) -> str:
    """A figure of a headline line ("label: **value** · ...": Compare's errors, Explain's and Serving's figures)."""
    return next(m.group(1) for md in at.markdown for m in [re.search(re.escape(label) + r": \*\*(.+?)\*\*", md.value)] if m)


def number(text: str) -> float:
    return float(re.sub(r"[^0-9.+-e]", "", text.replace(",", "")).split()[0])


# st.dataframe carries no key in the element tree: tables are found by their columns.
TABLES = {"wi_layers": ["layer", "kind", "time_s", "compute_s"], "cmp_pred": ["platform", "hardware", "engine", "spec_decode", "batch", "predicted_tokens_per_s"],
          "cmp_errors": ["platform", "spec_decode", "batch", "measured_tokens_per_s"],
          "val_host_table": ["layer", "kind", "predicted_us", "measured_us"],  # any per-layer comparison
          "mh_models": ["model", "layers"], "mh_hw": ["hardware", "kind"],
          "mh_hw_fields": ["field", "value", "source"], "mh_model_fields": ["field", "value"]}


def commands(at: AppTest) -> list[str]:
    """The commands the page shows (inline code in markdown) and its code blocks, in page order per kind."""
    return [m.group(1) for md in at.markdown if not is_table(md.value)
            for m in re.finditer(r"`([^`]+)`", md.value)] + [c.value for c in at.code]


def is_table(markdown: str) -> bool:
    return markdown.startswith("| ") and "\n|---|" in markdown


def markdown_table(markdown: str):
    """A markdown table (pmdash.common.static_table) as a DataFrame, the columns of numbers as numbers."""
    import pandas as pd
    cells = lambda line: [re.sub(r"\\(.)", r"\1", c.strip()) for c in re.split(r"(?<!\\)\|", line)[1:-1]]  # noqa: E731
    head, _, *rows = markdown.split("\n")
    df = pd.DataFrame([cells(r) for r in rows], columns=cells(head))
    for col in df:
        with contextlib.suppress(ValueError, TypeError):
            df[col] = pd.to_numeric(df[col])
    return df


def tables(at: AppTest) -> list:
    """Every table on the page (interactive st.dataframe, static markdown tables) as a DataFrame."""
    return [d.value for d in at.dataframe] + [markdown_table(md.value) for md in at.markdown if is_table(md.value)]


def table(at: AppTest, key: str):
    cols = TABLES[key]
    found = [d for d in tables(at) if list(d.columns)[:len(cols)] == cols
             and (key != "mh_model_fields" or list(d.columns) == cols)]
    assert found, f"no table {key}"
    return found[0]


def run_cli(cmd: str) -> dict:
    from perfmodel.cli import main as cli
    args = shlex.split(cmd.splitlines()[0])
    assert args[0] == "perfmodel"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli.main(args[1:]) == 0
    return json.loads(buf.getvalue())


# ----- app shell ------------------------------------------------------------------------------

def test_every_view_renders_without_error():
    at = open_view("Compare")
    for view in ("What-if", "Explain", "Design search", "Serving", "Validation", "Models & hardware", "Compare"):
        at.sidebar.radio(key="view").set_value(view).run()
        assert_clean(at)
        assert at.header[0].value
        for key, spec in charts(at).items():  # what the browser draws is a valid Vega-Lite spec
            assert not schema_errors(spec), (view, key, schema_errors(spec)[:3])


def test_every_chart_is_valid_vega_lite():
    """The charts behind the tabs and the on-demand ones too (the default views: the test above)."""
    at = open_view("What-if")
    for name in WHATIF_TABS:
        tab(at, name)
        for key, spec in charts(at).items():
            assert not schema_errors(spec), (name, key, schema_errors(spec)[:3])


def test_a_page_waits_for_the_compiled_loops_with_a_message(monkeypatch):
    """A fresh server warms the compiled loops in a thread; a page that comes first says so and waits."""
    import threading
    told = threading.Event()
    slow = threading.Thread(target=told.wait, args=(60,))  # still building until the page has said so
    monkeypatch.setattr(common, "LOOPS", slow)
    shown, info = [], common.st.info
    monkeypatch.setattr(common.st, "info", lambda text, **kw: (shown.append(text), told.set(), info(text, **kw))[2])
    slow.start()
    at = open_view("Models & hardware")
    assert not slow.is_alive()  # the page waited for it
    assert any("Preparing the simulator's compiled loops" in t for t in shown)
    assert at.header[0].value == "Models and hardware"
    shown.clear()
    at.run()  # ready: no message
    assert not any("compiled loops" in t for t in shown)


def test_inputs_survive_switching_views():
    at = open_view("What-if")
    typed(at, "wi_batch", 8)
    typed(at, "wi_prefetch", 16.0)
    before = whatif_state(at)
    at.sidebar.radio(key="view").set_value("Compare").run()
    at.radio(key="cmp_spec").set_value("on").run()
    at.sidebar.radio(key="view").set_value("Models & hardware").run()
    at.sidebar.radio(key="view").set_value("What-if").run()
    assert_clean(at)
    assert at.text_input(key="wi_batch").value == "8" and at.text_input(key="wi_prefetch").value == "16"
    assert whatif_state(at) == before
    at.sidebar.radio(key="view").set_value("Compare").run()
    assert at.radio(key="cmp_spec").value == "on"


# ----- Compare -----------------------------------------------------------------------------------

def test_compare_default_shows_published_points_with_errors_and_cli():
    at = open_view("Compare")
    names = set(series(chart(at, "cmp_chart")))
    assert f"{TPU_V7} predicted" in names and f"{GB200} predicted" in names
    assert "Inferact, 16x TPU v7, published (platform A)" in names
    assert "Inferact, 16x GB200 (vLLM), published (platform B)" in names
    pred = table(at, "cmp_pred")
    assert sorted(pred["batch"].unique()) == [1, 2, 4, 8, 16, 32, 64]
    err = table(at, "cmp_errors")
    assert len(err) == 8  # the seed table's 4 batches x 2 platforms, no spec decode
    assert set(err["measured_tokens_per_s"]) >= {249, 392, 515, 865, 127, 227, 373, 636}
    assert (err["error"].abs() < 1.0).all()
    assert set(err["role"]) == {"held-out"}  # the presets hold no value fitted to a decode step
    assert headline(at, "Mean absolute error over the points shown").endswith("%")
    # the captions name the published deployments as the table holds them
    gb = next(m for m in seed_measurements() if m.hardware == "gb200")
    head = at.caption[0].value
    assert f"gb200 {gb.serving_engine} kernels, {gb.devices} devices, tp {gb.tp}, ep {gb.ep}" in head
    assert f"KV cache {gb.kv_cache}" in head
    # the CLI commands shown reproduce the predicted curves
    for hw, plat in (("tpu-v7", TPU_V7), ("gb200", GB200)):
        cmd = next(c for c in commands(at) if f"--hardware {hw}" in c and "predict" in c)
        out = run_cli(cmd)
        cli_tps = {r["batch"]: r["tokens_per_s"] for r in out["results"]}
        page = pred[pred["platform"] == plat].set_index("batch")["predicted_tokens_per_s"]
        for b, v in cli_tps.items():
            assert page[b] == pytest.approx(v, rel=1e-9)
    assert f"--serving-engine {gb.serving_engine} --kv-cache {gb.kv_cache}" in " ".join(c for c in commands(at))


@pytest.mark.parametrize("key,value,why", [("cmp_B_serving", "generic", "serving engine (yours generic, measured vllm)"),
                                           ("cmp_B_kv", "model's", "KV cache (yours bf16, measured fp8-kv)")])
def test_compare_a_setting_the_published_runs_differ_in_drops_their_points(key, value, why):
    """The published GB200 rows carry their serving engine and KV cache format: a platform that differs in
    either is not compared with them, and the page says in what."""
    at = open_view("Compare")
    at.selectbox(key=key).set_value(value).run()
    assert_clean(at)
    err = table(at, "cmp_errors")
    assert set(err["platform"]) == {TPU_V7}
    assert any("Not a reference for platform B" in c.value and why in c.value for c in at.caption)
    assert not any(b.startswith("Inferact, 16x GB200") for b in series(chart(at, "cmp_chart")))


def test_compare_speculative_decoding_toggle():
    at = open_view("Compare")
    off = table(at, "cmp_pred")
    at.radio(key="cmp_spec").set_value("on").run()
    assert_clean(at)
    on = table(at, "cmp_pred")
    assert on["spec_decode"].all()
    err = table(at, "cmp_errors")
    assert sorted(err["measured_tokens_per_s"]) == [452, 709]  # the DSpark pair
    for plat in (TPU_V7, GB200):
        b1_off = off[(off.platform == plat) & (off.batch == 1)]["predicted_tokens_per_s"].item()
        b1_on = on[(on.platform == plat) & (on.batch == 1)]["predicted_tokens_per_s"].item()
        assert b1_on > 2 * b1_off  # 6 accepted tokens per step for a slightly longer step
    assert any("--draft-rows 7 --acceptance-length 6" in c for c in commands(at))
    at.radio(key="cmp_spec").set_value("both").run()
    names = set(series(chart(at, "cmp_chart")))
    assert f"{TPU_V7} predicted" in names and f"{TPU_V7} predicted + spec decode" in names
    assert len(table(at, "cmp_errors")) == 10


def test_compare_upload_names_its_serving_engine_and_kv_cache():
    """An uploaded row is the reference for platform B only with B's serving engine and KV cache format."""
    at = open_view("Compare")
    csv = (b"model,hardware,engine,devices,tp,ep,batch,tokens_per_s,serving_engine,kv_cache,source\n"
           b"kimi-k3,gb200,multikernel,16,16,1,16,900,vllm,fp8-kv,my vllm run\n"
           b"kimi-k3,gb200,multikernel,16,16,1,32,1500,,,my generic run\n")
    at.file_uploader(key="cmp_upload").set_value(("gb.csv", csv, "text/csv")).run()
    assert_clean(at)
    err = table(at, "cmp_errors")
    mine = err[err["source"] == "your upload: gb.csv"]
    assert list(mine["reference"]) == ["my vllm run"] and list(mine["platform"]) == [GB200]
    note = next(c.value for c in at.caption if "Not a reference for platform B: your upload: gb.csv" in c.value)
    # the row states neither: the defaults it is compared at are assumptions, not measurements
    assert "serving engine (yours vllm; not stated, assumed generic)" in note
    assert "KV cache (yours fp8-kv; not stated, assumed bf16)" in note


def test_compare_batches_and_platform_widgets():
    at = open_view("Compare")
    typed(at, "cmp_batches", ", ".join(map(str, [1, 3, 48])))
    assert_clean(at)
    assert sorted(table(at, "cmp_pred")["batch"].unique()) == [1, 3, 48]
    assert "--batch 1,3,48" in " ".join(c for c in commands(at))
    # platform B as a second TPU v7 megakernel: the GB200 measured points disappear
    use_deployment(at, "cmp_B", "tpu-v7", "megakernel", devices=32, tp=32, ep=8)
    assert_clean(at)
    err = table(at, "cmp_errors")
    assert {p.split(": ", 1)[1] for p in err["platform"]} == {TPU_V7.split(": ", 1)[1]}
    # the multikernel engine on the same chips is slower at batch 1
    at.radio(key="cmp_B_engine").set_value("multikernel").run()
    pred = table(at, "cmp_pred")
    mk = pred[(pred.engine == "multikernel") & (pred.batch == 1)]["predicted_tokens_per_s"].item()
    mega = pred[(pred.engine == "megakernel") & (pred.batch == 1)]["predicted_tokens_per_s"].item()
    assert mega > mk
    typed(at, "cmp_batches", "")
    assert_message(at, "Batch sizes: enter at least one")
    assert any("Stale" in c.value for c in at.caption)  # the last chart stays, greyed, with the reason


def test_compare_batch_text_is_parsed_strictly():
    """Typing 8 gives batch 8 only (a multiselect once added 8, 18, 28, ...); bad lists keep the chart stale."""
    at = open_view("Compare")
    typed(at, "cmp_batches", "8")
    assert_clean(at)
    assert sorted(table(at, "cmp_pred")["batch"].unique()) == [8]
    for text, why in (("1, 2, x", "'x' is not a number"), ("4.5", "not a whole number"), ("0", "out of range"),
                      ("1e9", "out of range")):
        typed(at, "cmp_batches", text)
        assert_message(at, why)
        assert any("Stale" in c.value for c in at.caption)
        assert sorted(table(at, "cmp_pred")["batch"].unique()) == [8]  # the last valid inputs, greyed


@pytest.mark.parametrize("text,why", [("1e9", "out of range"), ("", "enter a number"), ("4.5", "not a whole number"),
                                      ("abc", "not a number")])
def test_number_fields_are_strict(text, why):
    at = open_view("What-if")
    before = whatif_state(at)
    typed(at, "wi_batch", text)
    assert_message(at, f"Batch (sequences): ")
    assert any(why in e for e in errors(at)), errors(at)
    assert sum("Stale" in c.value for c in at.caption) >= 2  # the headline and the open tab say they are stale
    assert whatif_state(at) == before
    typed(at, "wi_batch", "1e0")  # 1e0 is the whole number 1
    assert_clean(at)
    assert not any("Stale" in c.value for c in at.caption)


def test_compare_one_error_box_per_cause_and_nearest_layouts():
    at = open_view("Compare")
    at.selectbox(key="cmp_A_hw").set_value("tpu-v6e").run()  # Kimi K3 does not fit 32 v6e cores
    assert_clean(at, errors_ok=True)
    assert len(errors(at)) == 1 and "batch 1, 2, 4, 8, 16, 32, 64" in errors(at)[0]
    assert any(b.label.startswith("devices 64") for b in at.button)
    at.selectbox(key="cmp_A_hw").set_value("tpu-v7").run()
    at.selectbox(key="cmp_model").set_value("kimi-k3-host-small").run()  # 2 KDA heads: tp 32 and 16 cannot run
    assert_clean(at, errors_ok=True)
    assert len(errors(at)) == 2  # one per platform, not one per batch
    near = [b for b in at.button if b.key.startswith("cmp_near_A")]
    assert near and near[0].label.startswith("TP ")
    near[0].click().run()
    assert_clean(at, errors_ok=True)
    assert len(errors(at)) == 1 and (table(at, "cmp_pred")["platform"].str.startswith("A:")).any()


def test_compare_sources_markers_log_axis_and_implausible_upload():
    at = open_view("Compare")
    before = chart(at, "cmp_chart")
    csv = (b"model,hardware,engine,devices,tp,ep,steps_per_call,batch,tokens_per_s\n"
           b"kimi-k3,tpu-v7,megakernel,32,32,8,64,16,1500\nkimi-k3,tpu-v7,megakernel,32,32,8,64,32,1e30\n")
    at.file_uploader(key="cmp_upload").set_value(("bench.csv", csv, "text/csv")).run()
    assert_clean(at)
    main = chart(at, "cmp_chart")
    measured_series = series(main, "point")  # hollow markers: the measured points (the curves are lines)
    ratios = series(chart(at, "cmp_ratio"), "point")  # the predicted / measured panel: one series per source
    assert len(ratios) == 3 and all(0.5 < r["ratio"] < 2 for rows in ratios.values() for r in rows)
    assert set(measured_series) == set(ratios) == {"Inferact, 16x TPU v7, published (platform A)",
                                                   "Inferact, 16x GB200 (vLLM), published (platform B)",
                                                   "your upload: bench.csv (platform A)"}
    # a marker per kind of source, whatever else is plotted: published o before and after the upload
    assert legend(before, "shape") == {"published": "circle"}
    assert legend(main, "shape") == {"published": "circle", "your upload": "triangle-up"}
    assert {r["kind"] for r in measured_series["your upload: bench.csv (platform A)"]} == {"your upload"}
    # a colour per platform: A blue, B red, named in the legend
    assert legend(main, "color") == {TPU_V7: "#1f77b4", GB200: "#d62728"}
    assert max(r["tokens_per_s"] for rows in series(main).values() for r in rows) < 1e5  # the 1e30 row is not plotted
    assert any("above 2x the chip's HBM roofline" in w.value and "1e+30" in w.value for w in at.warning)
    err = table(at, "cmp_errors")
    assert err[err["batch"] == 32]["check"].item().startswith("implausible")
    page_text = " ".join(str(v) for v in err.to_numpy().ravel())
    assert "seed" not in page_text.lower()
    at.toggle(key="cmp_logy").set_value(True).run()
    assert scale(chart(at, "cmp_chart"), "y")["type"] == "log"


def test_compare_impossible_layout_shows_message():
    at = open_view("Compare")
    typed(at, "cmp_A_devices", 31)
    assert_clean(at, errors_ok=True)
    msgs = errors(at)
    assert len(msgs) == 1 and "must divide devices (31)" in msgs[0] and "batch 1, 2, 4" in msgs[0]
    assert set(table(at, "cmp_pred")["platform"]) == {GB200}  # the other platform still plotted


def test_compare_user_measurements_upload():
    at = open_view("Compare")
    csv = (b"# my run\nmodel,hardware,engine,devices,batch,tokens_per_s,source\n"
           b"kimi-k3,tpu-v7,megakernel,32,16,1500,my bench\n")
    at.file_uploader(key="cmp_upload").set_value(("mine.csv", csv, "text/csv")).run()
    assert_clean(at)
    # no tp, ep or steps per call: the defaults (tp = ep = devices, 1 step per call), assumed, not platform A's
    assert not (table(at, "cmp_errors")["source"] == "your upload: mine.csv").any()
    note = next(c.value for c in at.caption if "your upload: mine.csv" in c.value)
    assert "Not a reference for platform A" in note and "EP (yours 8; not stated, assumed 32)" in note
    assert "steps per call (yours 64; not stated, assumed 1)" in note
    csv = (b"# my run\nmodel,hardware,engine,devices,tp,ep,steps_per_call,batch,tokens_per_s,source\n"
           b"kimi-k3,tpu-v7,megakernel,32,32,8,64,16,1500,my bench\n")
    at.file_uploader(key="cmp_upload").set_value(("mine.csv", csv, "text/csv")).run()
    err = table(at, "cmp_errors")
    mine = err[err["source"] == "your upload: mine.csv"]
    assert len(mine) == 1 and mine["batch"].item() == 16 and mine["reference"].item() == "my bench"
    # a foreign file and a CSV with the wrong columns: a message, no exception
    at.file_uploader(key="cmp_upload").set_value(("photo.png", b"\x89PNG\r\n\x1a\n\x00\x00", "image/png")).run()
    assert_message(at, "expected a .csv")
    at.file_uploader(key="cmp_upload").set_value(("bad.csv", b"a,b\n1,2\n", "text/csv")).run()
    assert_message(at, "missing column(s) model, hardware, engine, batch, tokens_per_s")
    at.file_uploader(key="cmp_upload").set_value(
        ("bad2.csv", b"model,hardware,engine,batch,tokens_per_s\nkimi-k3,tpu-v7,megakernel,two,5\n", "text/csv")).run()
    assert any("column batch" in e for e in errors(at))


def test_compare_upload_without_a_model_is_refused():
    """A measurements file that names no model would be the reference for every model: refused, with why."""
    at = open_view("Compare")
    csv = b"hardware,engine,devices,tp,ep,steps_per_call,batch,tokens_per_s\ntpu-v7,megakernel,32,32,8,64,16,1500\n"
    at.file_uploader(key="cmp_upload").set_value(("nomodel.csv", csv, "text/csv")).run()
    assert_message(at, "has no model column")
    assert not any("nomodel.csv" in name for name in series(chart(at, "cmp_chart")))
    assert not (table(at, "cmp_errors")["source"] == "your upload: nomodel.csv").any()
    csv = b"model,hardware,engine,batch,tokens_per_s\n,tpu-v7,megakernel,16,1500\n"  # a row without one
    at.file_uploader(key="cmp_upload").set_value(("blank.csv", csv, "text/csv")).run()
    assert_message(at, "row 1: no model")


def test_compare_sources_and_their_provenance_one_click_away():
    """Each measured source in the sources popover: its marker, its points and where it comes from; and what is
    not there yet (no committed measurement of this project's own runs on an accelerator)."""
    at = open_view("Compare")
    text = "\n".join(m.value for m in at.markdown)
    assert "**Inferact, 16x TPU v7, published** (circle marker: published" in text
    assert "does not state: the context, the ring depth" in text
    assert f"**{measured.HOST_ORIGIN}** (square marker: measured by this project" in text and "- machine: " in text
    assert any("No measurement of this project's own runs on an accelerator is committed yet" in c.value
               for c in at.caption)


def test_compare_draws_a_committed_measurement_file_with_its_provenance(monkeypatch, tmp_path):
    """A committed results file (experiments/results/measured_*.csv) is a source of its own: drawn beside the
    predictions with the marker of this project's measurements, its chip, JAX version, date and command listed."""
    (tmp_path / "measured_tpu-v7.csv").write_text(
        "# chip: TPU v7 (test)\n# jax: 0.9.9\n# date: 2027-01-02T03:04:05+00:00\n"
        "# command: python experiments/tpu_megakernel.py --whole-step\n"
        "model,hardware,engine,devices,tp,ep,steps_per_call,batch,tokens_per_s\n"
        "kimi-k3,tpu-v7,megakernel,32,32,8,64,16,900\n")
    monkeypatch.setattr(measured, "RESULTS_DIR", tmp_path)
    at = open_view("Compare")
    name = "TPU v7, measured (measured_tpu-v7.csv) (platform A)"
    pts = series(chart(at, "cmp_chart"), "point")
    assert [r["batch"] for r in pts[name]] == [16] and {r["kind"] for r in pts[name]} == {measured.OURS}
    assert legend(chart(at, "cmp_chart"), "shape")[measured.OURS] == "square"
    text = "\n".join(m.value for m in at.markdown)
    assert "- jax: 0.9.9" in text and "python experiments/tpu_megakernel.py --whole-step" in text
    assert any("Committed measurement files" in c.value for c in at.caption)


def x_domain(spec: dict) -> list[float]:
    return scale(spec, "x")["domain"]


def test_stacked_panels_share_their_x_range():
    """A chart of two panels (Compare's predicted / measured, Serving's TPOT, the prefetch sweep's causes) is two
    charts: each lower panel has the x range of the one above it, whatever its own layers draw."""
    at = open_view("Compare")
    assert x_domain(chart(at, "cmp_chart")) == x_domain(chart(at, "cmp_ratio"))
    lo, hi = x_domain(chart(at, "cmp_ratio"))
    assert lo < 1 and hi > 64  # every batch typed, not only the measured ones (1 to 8)
    at = open_view("Serving")
    assert x_domain(chart(at, "sv_chart")) == x_domain(chart(at, "sv_tpot_chart"))
    at = open_view("What-if", tab="Prefetch depth")
    for log in (False, True):
        at.toggle(key="wi_pf_logx").set_value(log).run()
        up, down = chart(at, "wi_prefetch_chart"), chart(at, "wi_prefetch_causes")
        assert scale(up, "x") == scale(down, "x") and scale(up, "x")["type"] == ("log" if log else "linear")


def test_compare_legend_names_platforms_curves_and_markers():
    """The legend says what colour, line style and marker mean, each on a channel of its own."""
    at = open_view("Compare")
    at.radio(key="cmp_spec").set_value("both").run()
    main = chart(at, "cmp_chart")
    line = next(lay for lay in layers(main) if mark_type(lay) == "line")
    assert line["encoding"]["color"]["field"] == "platform" and line["encoding"]["strokeDash"]["field"] == "curve"
    assert legend(main, "strokeDash") == {"predicted": [1, 0], "predicted, spec decode": [6, 4]}
    assert legend(main, "color") == {TPU_V7: "#1f77b4", GB200: "#d62728"}
    assert all(lay["encoding"].get(ch, {}).get("legend", {}) is not None for lay in layers(main)
               for ch in ("color", "shape", "strokeDash"))  # a layer's legend None would drop the merged one
    # another platform B: A keeps blue, the published points keep their circle
    use_deployment(at, "cmp_B", "tpu-v7", "megakernel", devices=32, tp=32, ep=8)
    main = chart(at, "cmp_chart")
    assert list(legend(main, "color").values()) == ["#1f77b4", "#d62728"]
    assert legend(main, "shape") == {"published": "circle"}


def test_compare_host_validation_points(monkeypatch, tmp_path):
    """Host step rows (op by op, hardware file as written) are measured points of the hostbench hardware."""
    hw_file = tmp_path / "host-cpu.toml"
    hw_file.write_text((ROOT / "perfmodel/presets/hardware/tpu-v7.toml").read_text().replace(
        'name = "tpu-v7"', 'name = "host-cpu"'))
    csv = tmp_path / "host_validation.csv"
    head = "variant,model,mode,batch,context,layer,kind,predicted_s,measured_s"
    csv.write_text("\n".join([
        "# machine: test", head,
        "file,kimi-k3-host-small,op_by_op,1,256,step,step,0.001,0.002",
        "file,kimi-k3-host-small,op_by_op,4,256,step,step,0.001,0.004",
        "file,kimi-k3-host-small,compiled,1,256,step,step,0.001,0.001",   # another mode: not a point
        "matched,kimi-k3-host-small,op_by_op,1,256,step,step,0.001,0.003",  # another variant: not a point
        "file,kimi-k3-host-small,op_by_op,1,256,1,kda,0.0001,0.0002"]) + "\n")
    monkeypatch.setattr(common, "HOST_HW_FILE", hw_file)
    monkeypatch.setattr(measured, "HOST_VALIDATION_CSV", csv)
    at = open_view("Compare")
    assert not at.info  # no "missing host results" note
    at.selectbox(key="cmp_model").set_value("kimi-k3-host-small").run()
    at.selectbox(key="cmp_A_hw").set_value(common.HOST_HW).run()
    at.radio(key="cmp_A_engine").set_value("multikernel").run()
    for k in ("devices", "tp", "ep", "steps_per_call"):
        typed(at, f"cmp_A_{k}", 1)
    typed(at, "cmp_context", 4096)
    assert_clean(at, errors_ok=True)  # platform B (gb200, tp 16) cannot run this small model: a message
    assert len(table(at, "cmp_pred")) == 7
    assert not [d for d in tables(at) if "measured_tokens_per_s" in d.columns]  # context 4096: none
    typed(at, "cmp_context", 256)
    err = table(at, "cmp_errors")
    assert sorted(err["measured_tokens_per_s"]) == pytest.approx([500.0, 1000.0])  # batch / step time
    assert set(err["source"]) == {measured.HOST_ORIGIN}
    assert any(f"--hardware {hw_file}" in c and "--context 256" in c for c in commands(at))


def test_measurements_normalise_rejects_bad_values():
    import pandas as pd
    from perfmodel.util.errors import SpecError
    with pytest.raises(SpecError, match="engine"):
        measured.normalise(pd.DataFrame({"model": ["m"], "hardware": ["x"], "engine": ["vllm"], "batch": [1],
                                         "tokens_per_s": [3.0]}), "t")
    with pytest.raises(SpecError, match="tokens_per_s > 0"):
        measured.normalise(pd.DataFrame({"model": ["m"], "hardware": ["x"], "engine": ["megakernel"], "batch": [1],
                                         "tokens_per_s": [0.0]}), "t")
    with pytest.raises(SpecError, match="no model column"):
        measured.normalise(pd.DataFrame({"hardware": ["x"], "engine": ["megakernel"], "batch": [1],
                                         "tokens_per_s": [1.0]}), "t")
    assert len(measured.published_table()) == 10


# ----- What-if -----------------------------------------------------------------------------------

def whatif_state(at: AppTest) -> dict:
    return {"tps": number(metric(at, "tokens/s (predicted)")), "step_ms": number(metric(at, "step time")),
            "bound": headline(at, "bound")}


WHATIF_TABS = {"Step breakdown": ("wi_breakdown",),
               "Ring x expert slots": ("wi_heat_pick", "wi_sweep_measured", "wi_slots_measured"),
               "Prefetch depth": ("wi_prefetch_chart", "wi_prefetch_causes"), "Timeline": ("wi_timeline",),
               "Roofline": ("wi_roofline",)}


def tab(at: AppTest, name: str) -> AppTest:
    at.session_state["wi_tab"] = name
    return at.run()


def test_whatif_tabs_draw_one_chart_each_and_cli_reproduces():
    at = open_view("What-if")
    assert list(charts(at)) == ["wi_breakdown"]  # only the open tab is drawn
    assert set(series(chart(at, "wi_breakdown"))) >= {common.CAUSE_LABELS["weight_streaming"],
                                                      common.CAUSE_LABELS["collective"]}
    s = whatif_state(at)
    cmd = next(c for c in commands(at) if c.startswith("perfmodel predict"))
    assert "--steps-per-call 64" in cmd  # the published TPU runs' steps per call
    out = run_cli(cmd)
    assert out["results"][0]["tokens_per_s"] == pytest.approx(s["tps"], abs=0.5)  # the page shows it rounded
    for name, keys in WHATIF_TABS.items():
        tab(at, name)
        assert_clean(at)
        assert sorted(charts(at)) == sorted(keys), (name, list(charts(at)))
        assert all(series(chart(at, key)) for key in keys)
        assert whatif_state(at) == s
    tab(at, "Timeline")
    lanes = set(series(chart(at, "wi_timeline"), "bar"))
    assert lanes == {"DMA engine", "compute unit", "links"}
    assert any(c.startswith("perfmodel trace") for c in commands(at))
    tab(at, "Prefetch depth")
    assert any("saturates at" in c.value for c in at.caption)
    assert "--vary prefetch_mib=" in next(c for c in commands(at) if c.startswith("perfmodel sweep"))


def test_whatif_gain_is_the_megakernels_in_either_engine():
    at = open_view("What-if")
    mega = next(c.value for c in at.caption if c.value.startswith("Megakernel gain"))
    at.radio(key="wi_engine").set_value("multikernel").run()
    multi = next(c.value for c in at.caption if c.value.startswith("Megakernel gain"))
    assert mega == multi and "multi-kernel step - megakernel step" in mega  # not "prefetch gain"
    assert not any("Prefetch gain" in c.value for c in at.caption)


def test_whatif_ring_slots_map_marks_current_default_best_and_applies_a_click():
    at = open_view("What-if", tab="Ring x expert slots")
    fig = chart(at, "wi_heat_pick")
    assert {"on-chip limit", "current", "default", "best"} <= set(series(fig))
    from pmdash import whatif
    m_ref, h_ref = common.model_ref("kimi-k3"), common.hardware_ref("tpu-v7")
    key = common.dep_key(32, 32, 8, "megakernel", steps_per_call=64)
    g = whatif.heat_grid(m_ref, h_ref, key, None)
    cells = series(fig, "rect")["cells"]  # cells beyond the on-chip buffer are blank: not drawn
    assert 0 < len(cells) == np.isfinite(g["step_s"]).sum() < g["step_s"].size
    for name in ("current", "best"):  # the marks sit on their cells, named by ring and slots
        (mark,) = [r for r in series(fig, "point")[name]]
        i, j = g[name]
        assert (mark["ring"], mark["slots"]) == (f"{g['depths'][j]:g}", str(g["slots"][i]))
    i, j = g["current"]
    assert g["tokens_per_s"][i, j] == pytest.approx(number(metric(at, "tokens/s (predicted)")), abs=0.5)
    bi, bj = g["best"]
    assert g["step_s"][bi, bj] <= np.nanmin(g["step_s"]) + 1e-15
    assert f"with {g['slots'][bi]} expert slots" in next(c.value for c in at.caption if c.value.startswith("**Best"))
    # the best cell's ring and slots give its tokens/s (a click on it types them: the browser test)
    typed(at, "wi_prefetch", g["depths"][bj])
    typed(at, "wi_slots", g["slots"][bi])
    assert number(metric(at, "tokens/s (predicted)")) == pytest.approx(g["tokens_per_s"][bi, bj], abs=0.5)


def test_whatif_widgets_change_outputs():
    at = open_view("What-if")
    base = whatif_state(at)
    typed(at, "wi_batch", 8)
    assert_clean(at)
    b8 = whatif_state(at)
    assert b8["tps"] > base["tps"] and b8["step_ms"] > base["step_ms"]
    typed(at, "wi_batch", 1)
    at.radio(key="wi_engine").set_value("multikernel").run()
    assert_clean(at)
    mk = whatif_state(at)
    assert mk["step_ms"] > base["step_ms"]
    tab(at, "Prefetch depth")
    assert any("megakernel setting" in i.value for i in at.info)  # no prefetch sweep for multikernel
    at.radio(key="wi_engine").set_value("megakernel").run()
    typed(at, "wi_context", 262144)
    assert_clean(at)
    assert whatif_state(at)["step_ms"] > base["step_ms"]  # more KV cache to read
    typed(at, "wi_context", 4096)
    typed(at, "wi_prefetch", 4.0)
    assert_clean(at)
    shallow = whatif_state(at)
    assert shallow["step_ms"] > base["step_ms"]  # a one-tile ring exposes the weight stream
    assert any("--prefetch-mib 4" in c for c in commands(at))
    typed(at, "wi_prefetch", None)
    typed(at, "wi_vmem", 16.0)
    assert_clean(at)
    small = whatif_state(at)
    assert small["step_ms"] > base["step_ms"]
    sweep = series(chart(at, "wi_prefetch_chart"))["step time"]
    assert max(r["prefetch_mib"] for r in sweep) <= 16
    cmd = next(c for c in commands(at) if "perfmodel predict" in c and "--vmem-mib 16" in c)
    out = run_cli(cmd)
    assert out["results"][0]["tokens_per_s"] == pytest.approx(small["tps"], abs=0.5)  # the page shows it rounded
    typed(at, "wi_vmem", None)
    typed(at, "wi_slots", 2)
    assert_clean(at)
    assert whatif_state(at)["step_ms"] != base["step_ms"]
    assert any("--expert-slots 2" in c for c in commands(at))
    typed(at, "wi_slots", None)
    assert whatif_state(at) == base


def test_whatif_speculative_decoding_and_acceptance_length():
    at = open_view("What-if")
    base = whatif_state(at)
    at.toggle(key="wi_spec").set_value(True).run()
    assert_clean(at)
    tau6 = whatif_state(at)
    assert tau6["tps"] > 2 * base["tps"]  # 6 tokens per (slightly longer) step
    at.slider(key="wi_acc").set_value(3.0).run()
    tau3 = whatif_state(at)
    assert tau3["tps"] == pytest.approx(tau6["tps"] / 2, abs=0.5)  # same step, half the tokens (shown rounded)
    assert any("--draft-rows 7 --acceptance-length 3" in c for c in commands(at))
    assert "drafter" in series(chart(at, "wi_breakdown"))


def test_whatif_impossible_configurations_show_the_excess():
    at = open_view("What-if")
    typed(at, "wi_prefetch", 200.0)
    assert_clean(at, errors_ok=True)
    assert len(errors(at)) == 1 and "prefetch=200 MiB" in errors(at)[0] and "exceeds" in errors(at)[0]
    typed(at, "wi_prefetch", None)
    typed(at, "wi_slots", 500)
    assert_clean(at, errors_ok=True)
    assert "expert_slots=500" in errors(at)[0]
    typed(at, "wi_slots", None)
    typed(at, "wi_tp", 7)
    assert_clean(at, errors_ok=True)
    assert "tp=7" in errors(at)[0]
    typed(at, "wi_tp", 32)
    typed(at, "wi_devices", 2)  # 2.8 T parameters on 2 devices
    assert_clean(at, errors_ok=True)
    assert any("does not fit" in e or "must divide" in e for e in errors(at))


def test_whatif_infeasible_keeps_the_page_and_shows_what_fits():
    """Prefetch 64 MiB, 16 slots, VMEM 0.5 MiB: one error box in MiB, the nearest configurations that run
    (verified), the last good outputs greyed, the sweep still there."""
    at = open_view("What-if")
    assert not at.warning  # nothing at the defaults says a depth does not fit
    for k, v in (("wi_prefetch", 64), ("wi_slots", 16), ("wi_vmem", 0.5)):
        typed(at, k, v)
    assert_clean(at, errors_ok=True)
    assert len(errors(at)) == 1
    msg = errors(at)[0]
    assert "MiB" in msg and "VMEM per core: 0.5 MiB" in msg and not re.search(r"\d{6,} B", msg)
    assert "at most 0 MiB" not in msg and "not even one tile fits" in msg
    assert any(m.value.startswith("**Nearest configurations that run") for m in at.markdown)
    use = [b for b in at.button if b.key.startswith("wi_near_")]
    assert use
    assert series(chart(at, "wi_breakdown"))
    assert sum("Stale" in c.value for c in at.caption) >= 2
    tab(at, "Prefetch depth")
    assert any("No prefetch depth fits" in w.value for w in at.warning)  # the sweep section says what fits
    use[0].click().run()  # apply the suggestion: it runs
    assert_clean(at)
    assert not any("Stale" in c.value for c in at.caption)


def test_whatif_prefetch_sweep_explains_itself():
    at = open_view("What-if", tab="Prefetch depth")
    fig = chart(at, "wi_prefetch_chart")
    assert {"current", "expert slots", "saturation"} <= set(series(fig))
    causes = set(series(chart(at, "wi_prefetch_causes"), "bar"))
    assert common.CAUSE_LABELS["expert_fetch"] in causes and common.CAUSE_LABELS["collective"] in causes
    step = next(lay for lay in layers(fig) if lay["data"]["values"][0]["series"] == "step time")
    hover = {t["title"] for t in step["encoding"]["tooltip"]}
    assert {"ring banks", "expert slots"} <= hover
    slots = [r["expert_slots"] for r in series(fig)["expert slots"]]
    assert slots[0] > slots[-1]  # the ring takes the VMEM the expert buffers need
    assert any("expert slots**" in c.value for c in at.caption)  # the best depth's slots are named
    at.toggle(key="wi_pf_logx").set_value(True).run()
    assert all(scale(chart(at, k), "x")["type"] == "log" for k in ("wi_prefetch_chart", "wi_prefetch_causes"))  # both


def test_prefetch_bend_is_named_by_its_cause():
    from pmdash import whatif
    from perfmodel.spec.hardware import load_hardware
    row = lambda mib, step, fetch, slots: {"prefetch_mib": mib, "step_s": step, "expert_slots": slots, "banks": mib // 4,
                                          "expert_fetch_s": fetch, "weight_streaming_s": 0.0}
    rows = [row(16, 4e-3, 1e-3, 8), row(32, 3e-3, 0.5e-3, 6), row(56, 3.5e-3, 1e-3, 2)]
    text = whatif.bend_explanation(rows, {"prefetch_mib": 32}, 56, load_hardware("tpu-v7"))
    assert "Deeper than 32 MiB" in text and "expert" in text and "2 at 56 MiB" in text
    assert whatif.bend_explanation(rows[:2], {"prefetch_mib": 32}, 32, load_hardware("tpu-v7")) is None


def test_whatif_more_vmem_slower_is_explained_and_consistent():
    """VMEM 1,000,000 MiB: the default ring (half of it) is slower than 64 MiB; the page names the mechanism and
    the headline is the sweep's 'current' point."""
    at = open_view("What-if", tab="Prefetch depth")
    base = whatif_state(at)
    typed(at, "wi_vmem", 1_000_000)
    assert_clean(at)
    big = whatif_state(at)
    assert big["tps"] < base["tps"]
    # the cause that grows and the DMA engine's service that makes it (tpu-v7: at most 5 copies at once,
    # so the collectives' remote copies queue behind the ring's far-ahead tiles)
    assert any("Deeper than" in i.value and "dma_concurrent_copies" in i.value and "collectives" in i.value
               for i in at.info)
    forced = at.toggle(key="wi_pf_logx_forced")  # the axis is log whatever the choice: the toggle shown says so
    assert forced.value is True and forced.disabled and "wi_pf_logx" not in [t.key for t in at.toggle]
    fig = chart(at, "wi_prefetch_chart")
    (cur,) = series(fig, "point")["current"]
    assert cur["prefetch_mib"] == pytest.approx(500_000) and cur["step_ms"] == pytest.approx(big["step_ms"], rel=1e-3)
    assert scale(chart(at, "wi_prefetch_causes"), "x")["type"] == "log"


def test_whatif_measured_only_when_every_setting_matches():
    at = open_view("What-if")
    assert metric(at, "measured tokens/s") == "249"
    measured_note = next(c.value for c in at.caption if c.value.startswith("Measured: 249 tokens/s, Inferact, 16x TPU v7"))
    assert "Not stated by the measurement, assumed" in measured_note and "prefetch depth 32 MiB" in measured_note
    assert "measured 32" not in " ".join(c.value for c in at.caption)
    delta = next(m.delta for m in at.metric if m.label == "measured tokens/s")
    assert delta.startswith("-") or delta.startswith("+")  # the badge's arrow follows the sign
    typed(at, "wi_batch", 2)
    assert metric(at, "measured tokens/s") == "392"
    # what the published table states is "measured"; what it does not (context, ring, VMEM) is "assumed"
    for field, value, differs in (("wi_ep", 16, "EP (yours 16, measured 8)"), ("wi_tp", 16, "TP (yours 16, measured 32)"),
                                  ("wi_context", 8192, "context (yours 8192 tokens; not stated, assumed 4096 tokens)"),
                                  ("wi_prefetch", 16.0, "prefetch depth (yours 16 MiB; not stated, assumed 32 MiB)"),
                                  ("wi_vmem", 48.0, "VMEM (yours 48 MiB; not stated, assumed 64 MiB)"),
                                  ("wi_steps", 1, "steps per call (yours 1, measured 64)")):
        before = at.text_input(key=field).value
        typed(at, field, value)
        assert_clean(at)
        assert metric(at, "measured tokens/s") == "none", field
        note = next(c.value for c in at.caption if c.value.startswith("Nearest measurement"))
        assert "392 tokens/s at batch 2" in note and differs in note, note
        at.text_input(key=field).input(before).run()
    typed(at, "wi_batch", 3)
    assert metric(at, "measured tokens/s") == "none"
    typed(at, "wi_ep", 16)
    at.button(key="wi_meas_btn").click().run()  # the nearest measurement's settings
    assert metric(at, "measured tokens/s") in ("249", "392", "515")
    assert at.text_input(key="wi_ep").value == "8"


def test_whatif_roofline_units_and_layer_timeline():
    at = open_view("What-if", tab="Roofline")
    roof = chart(at, "wi_roofline")
    assert "TFLOP/s" in layers(roof)[0]["encoding"]["y"]["title"]
    colors = [c for name, c in legend(roof, "color").items() if name.endswith("layers") and name in series(roof, "point")]
    assert len(set(colors)) == len(colors) >= 2
    assert table(at, "wi_layers")["layer"].tolist() == list(range(95))


def test_whatif_timeline_opens_on_a_few_layers_with_op_names():
    at = open_view("What-if", tab="Timeline")
    part = chart(at, "wi_timeline")
    bars = [r for rows in series(part, "bar").values() for r in rows]
    assert {int(r["what"].split("(layer ")[1].split(")")[0]) for r in bars} == {1, 2, 3, 4}
    assert {"q_proj", "gate_up", "attn_all_reduce"} <= gantt_labels(part)  # op names on the bars
    assert len(bars) < 200  # a weight stream's tile copies merged
    at.select_slider(key="wi_layers_95").set_value((0, 94)).run()
    assert_clean(at)
    whole = series(chart(at, "wi_timeline"), "bar")
    assert sum(len(rows) for rows in whole.values()) <= 3 * 95  # one bar per layer and lane, not every event
    assert any("layer spans" in c.value for c in at.caption)


def test_whatif_serving_engine_and_kv_cache():
    """The GB200 baseline as published (16 GPUs, TP16, vLLM with an fp8 KV cache, batch 1): the
    measurement is the reference only with both selected; the command shown reproduces the page."""
    at = open_view("What-if")
    use_deployment(at, "wi", "gb200", "multikernel", devices=16, tp=16, ep=1, steps=1)
    assert_clean(at)
    assert at.selectbox(key="wi_serving").disabled is False
    assert metric(at, "measured tokens/s") == "none"
    note = next(c.value for c in at.caption if c.value.startswith("Nearest measurement"))
    assert "serving engine" in note and "KV cache" in note, note
    at.selectbox(key="wi_serving").set_value("vllm").run()
    at.selectbox(key="wi_kv").set_value("fp8-kv").run()
    assert_clean(at)
    assert metric(at, "measured tokens/s") == "127"
    s = whatif_state(at)
    cmd = next(c for c in commands(at) if c.startswith("perfmodel predict"))
    assert "--serving-engine vllm" in cmd and "--kv-cache fp8-kv" in cmd
    assert run_cli(cmd)["results"][0]["tokens_per_s"] == pytest.approx(s["tps"], abs=0.5)
    at.radio(key="wi_engine").set_value("megakernel").run()  # no serving engine on the megakernel
    assert_clean(at, errors_ok=True)
    assert at.selectbox(key="wi_serving").disabled is True and at.selectbox(key="wi_serving").value == "generic"


def test_whatif_other_hardware_and_model():
    at = open_view("What-if")
    at.selectbox(key="wi_hw").set_value("gb200").run()
    typed(at, "wi_devices", 16)
    typed(at, "wi_tp", 16)
    typed(at, "wi_ep", 16)
    assert_clean(at)
    at.selectbox(key="wi_model").set_value("kimi-k3-mini").run()
    assert_clean(at, errors_ok=True)
    assert at.metric or at.error  # either a prediction or a message naming the bad layout


def test_whatif_prefetch_causes_are_times():
    """The time-by-cause panel draws the step's causes (its breakdown), never another column in seconds such as
    tokens_per_s; at each depth they add up to the step."""
    at = open_view("What-if", tab="Prefetch depth")
    bars = series(chart(at, "wi_prefetch_causes"), "bar")
    assert bars and set(bars) <= set(common.CAUSE_LABELS.values())
    step = {r["prefetch_mib"]: r["step_ms"] for r in series(chart(at, "wi_prefetch_chart"))["step time"]}
    for depth, ms in step.items():
        assert sum(r["ms"] for rows in bars.values() for r in rows if r["prefetch_mib"] == depth) == pytest.approx(ms)


def test_whatif_ring_fields_are_off_on_the_multikernel_engine():
    """The ring, the expert slots and the on-chip buffer change nothing on the multi-kernel engine: disabled there,
    left out of the deployment and the command."""
    at = open_view("What-if")
    typed(at, "wi_prefetch", 16)
    at.radio(key="wi_engine").set_value("multikernel").run()
    assert_clean(at)
    assert all(at.text_input(key=k).disabled for k in ("wi_prefetch", "wi_slots", "wi_vmem"))
    cmd = next(c for c in commands(at) if c.startswith("perfmodel predict"))
    assert "--prefetch-mib" not in cmd
    at.radio(key="wi_engine").set_value("megakernel").run()
    assert not at.text_input(key="wi_prefetch").disabled and at.text_input(key="wi_prefetch").value == "16"
    assert any("--prefetch-mib 16" in c for c in commands(at))


@pytest.mark.parametrize("depth", ["0.1", "6"])
def test_whatif_ring_depth_is_whole_tiles(depth):
    """A depth that is not a whole number of ring tiles would run as fewer whole tiles: said beside the field."""
    at = open_view("What-if")
    typed(at, "wi_prefetch", depth)
    assert_message(at, "the ring holds whole 4 MiB tiles")
    assert any("would run as 4 MiB" in e for e in errors(at))
    assert any("Stale" in c.value for c in at.caption)
    typed(at, "wi_prefetch", 8)
    assert_clean(at)


# ----- Explain -----------------------------------------------------------------------------------

def test_explain_layers_gantt_terms_and_command():
    at = open_view("Explain")
    parts = series(chart(at, "ex_layers_pick"), "bar")
    assert {"compute", "DMA stall", "collectives"} <= set(parts)
    layer_us = number(headline(at, "layer 1 (kda+dense) in the step"))
    total = sum(r["us"] for rows in parts.values() for r in rows if r["layer"] == 1)  # layer 1's parts add up to it
    assert total == pytest.approx(layer_us, abs=0.01)
    lanes = set(series(chart(at, "ex_gantt"), "bar"))
    assert lanes <= {"DMA engine", "compute unit", "links"} and "compute unit" in lanes
    assert "q_proj" in gantt_labels(chart(at, "ex_gantt"))
    terms = [d for d in tables(at) if "mechanism" in d.columns][0]
    assert len(terms) and (terms["us (alone)"] > 0).any() and terms["mechanism"].str.len().gt(0).all()
    cmd = next(c for c in commands(at) if c.startswith("perfmodel explain"))
    assert "--layer 1" in cmd
    out = run_cli(cmd)
    assert out["layer_time_s"] * 1e6 == pytest.approx(layer_us, abs=0.01)
    assert len(out["ops"]) == len(table_with(at, "waited on"))
    typed(at, "ex_layer", 4)
    assert_clean(at)
    assert headline(at, "layer 4 (mla+moe) in the step").endswith(" us")
    assert "routed_experts" in gantt_labels(chart(at, "ex_gantt"))
    typed(at, "ex_layer", 999)
    assert_message(at, "out of range")
    typed(at, "ex_tp", 7)
    assert_message(at, "cannot run")


def test_explain_equals_whatif_for_the_same_inputs():
    """Explain and What-if share one deployment form: the same inputs give the same step and tokens/s (the
    published TPU runs' 64 steps per call included), typed in each or copied with a button."""
    at = open_view("What-if")
    wi = whatif_state(at)
    at.sidebar.radio(key="view").set_value("Explain").run()
    assert_clean(at)
    assert number(headline(at, "step time")) == wi["step_ms"] and number(headline(at, "tokens/s")) == wi["tps"]
    for prefix in ("ex", "wi"):  # the same settings typed in both views
        at.sidebar.radio(key="view").set_value({"ex": "Explain", "wi": "What-if"}[prefix]).run()
        for name, v in (("steps", 1), ("context", 8192), ("batch", 4), ("prefetch", 16), ("slots", 4)):
            typed(at, f"{prefix}_{name}", v)
        assert_clean(at)
    wi = whatif_state(at)
    at.sidebar.radio(key="view").set_value("Explain").run()
    assert number(headline(at, "step time")) == wi["step_ms"] and number(headline(at, "tokens/s")) == wi["tps"]
    assert "--steps-per-call" not in next(c for c in commands(at) if c.startswith("perfmodel explain"))
    at.sidebar.radio(key="view").set_value("What-if").run()  # another deployment there, copied over
    at.toggle(key="wi_spec").set_value(True).run()
    typed(at, "wi_vmem", 48)
    wi = whatif_state(at)
    at.sidebar.radio(key="view").set_value("Explain").run()
    at.button(key="ex_use_wi_btn").click().run()
    assert_clean(at)
    assert number(headline(at, "step time")) == wi["step_ms"] and number(headline(at, "tokens/s")) == wi["tps"]
    cmd = next(c for c in commands(at) if c.startswith("perfmodel explain"))
    assert "--vmem-mib 48" in cmd and "--draft-rows 7" in cmd
    out = run_cli(cmd)
    assert out["step_s"] * 1e3 == pytest.approx(wi["step_ms"], abs=5e-4)


def test_explain_terms_are_compact_with_sources_on_demand():
    """A line a term (no source text in the table): each source a numbered reference, its text on demand."""
    at = open_view("Explain")
    terms = [d for d in tables(at) if "mechanism" in d.columns][0]
    assert terms["source"].str.match(r"^\[\d+\] ").all()
    assert all(len(str(v)) <= 100 for v in terms.to_numpy().ravel())
    assert not any(m.value.startswith("1. ") for m in at.markdown)  # the sources open on demand
    at.session_state["ex_sources_exp"] = True
    at.run()
    listed = next(m.value for m in at.markdown if m.value.startswith("1. ")).split("\n")
    assert len(listed) == terms["source"].nunique() and max(len(x) for x in listed) > 100


def gantt_labels(spec: dict) -> set[str]:
    """The op names of a Gantt chart's bars (each bar's label); those with room are written on the bars."""
    names = {r["label"] for rows in series(spec, "bar").values() for r in rows}
    written = {r["label"] for rows in series(spec, "text").values() for r in rows}
    assert written and written <= names
    return names


def table_with(at: AppTest, column: str):
    return next(d for d in tables(at) if column in d.columns)


# ----- Serving -----------------------------------------------------------------------------------

def serving_rows(at: AppTest):
    import pandas as pd
    return pd.DataFrame(next(d for d in tables(at) if list(d.columns)[:3] == ["load", "ttft_p50_s", "ttft_p90_s"]))


def marked_load(at: AppTest) -> list[float]:
    """The load of the vertical lines that mark the highest load meeting both targets (on both panels)."""
    found = {r["load"] for key in ("sv_chart", "sv_tpot_chart")
             for r in series(chart(at, key), "rule").get("highest load meeting both", [])}
    return sorted(found)


def target_lines(at: AppTest) -> list[float]:
    """The y of the target lines, TTFT (s) and TPOT (ms)."""
    return sorted(r["y"] for key in ("sv_chart", "sv_tpot_chart") for name, rows in series(chart(at, key), "rule").items()
                  if name.endswith("target") for r in rows)


def test_serving_default_curve_targets_highest_load_and_cli():
    at = open_view("Serving", sv_table_exp=True)
    curves = {name for key in ("sv_chart", "sv_tpot_chart") for name in series(chart(at, key), "line")}
    assert curves == {"TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90"}
    rows = serving_rows(at)
    assert list(rows["load"]) == [0.5, 1, 2, 4, 8]
    assert (rows["ttft_p90_s"] >= rows["ttft_p50_s"]).all() and (rows["tpot_p90_s"] >= rows["tpot_p50_s"]).all()
    assert rows["tpot_p90_s"].iloc[-1] > rows["tpot_p90_s"].iloc[0]  # more load, longer steps
    # the target lines, at the inputs (TTFT 1 s, TPOT 30 ms)
    assert target_lines(at) == [1.0, 30.0]
    ok = rows[(rows["ttft_p90_s"] <= 1.0) & (rows["tpot_p90_s"] <= 0.030)]
    assert list(rows["meets_targets"]) == [r in set(ok["load"]) for r in rows["load"]]
    top = ok["load"].max()
    assert marked_load(at) == [top] and headline(at, "highest load meeting both targets") == f"{top:g} requests/s"
    # the published GB200 deployment by default, and the command reproduces the marked load
    cmd = next(c for c in commands(at) if c.startswith("perfmodel serve"))
    gb = next(m for m in seed_measurements() if m.hardware == "gb200")
    assert f"--devices {gb.devices} --tp {gb.tp} --ep {gb.ep}" in cmd and f"--kv-cache {gb.kv_cache}" in cmd
    loop = next(c for c in commands(at) if c.startswith("for load in"))
    assert f"--rate {top:g} " in cmd and loop.startswith("for load in 0.5 1 2 4 8; do perfmodel serve")
    out = run_cli(cmd)
    row = rows[rows["load"] == top].iloc[0]
    for k in ("ttft", "tpot", "e2e"):
        for q in ("p50", "p90", "p99"):
            assert out[f"{k}_s"][q] == pytest.approx(row[f"{k}_{q}_s"], rel=1e-9)
    assert out["throughput_tokens_per_s"] == pytest.approx(row["throughput_tokens_per_s"], rel=1e-9)


def test_serving_targets_redraw_without_simulating_again(monkeypatch):
    from pmdash import serving
    at = open_view("Serving", sv_table_exp=True)
    rows = serving_rows(at)
    calls = []
    real = serving.load_curves
    monkeypatch.setattr(serving, "load_curves", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    typed(at, "sv_ttft", 0.1)
    at.radio(key="sv_pct").set_value("p50").run()
    assert_clean(at)
    assert not calls  # the targets and the percentile only redraw: the curve is cached
    ok = rows[(rows["ttft_p50_s"] <= 0.1) & (rows["tpot_p50_s"] <= 0.030)]
    assert marked_load(at) == ([ok["load"].max()] if len(ok) else [])
    typed(at, "sv_tpot", 0.001)  # nobody streams tokens that fast
    assert headline(at, "highest load meeting both targets") == "none" and marked_load(at) == []
    typed(at, "sv_requests", 50)  # another workload: simulated
    assert calls and len(serving_rows(at)) == 5


def test_serving_concurrency_other_layout_and_bad_inputs():
    at = open_view("Serving")
    at.radio(key="sv_arrivals").set_value("concurrency (clients)").run()
    assert_clean(at)
    assert at.text_input(key="sv_loads").value == "1, 2, 4, 8, 16, 32"  # a client count, not a rate
    assert "concurrent clients" in layers(chart(at, "sv_tpot_chart"))[0]["encoding"]["x"]["title"]
    assert any("--concurrency" in c for c in commands(at))
    typed(at, "sv_loads", "1, 2.5")
    assert_message(at, "Loads: '2.5' is not a whole number")
    assert any("Stale" in c.value for c in at.caption)
    typed(at, "sv_loads", "1, 4")
    for key, value in (("sv_input", 512), ("sv_output", 64), ("sv_seed", 3)):
        typed(at, key, value)
        assert_clean(at)
        assert f"--{key[3:].replace('input', 'input-len').replace('output', 'output-len')} {value}" in commands(at)[0]
    at.selectbox(key="sv_serving").set_value("generic").run()
    at.selectbox(key="sv_kv").set_value("model's").run()
    assert_clean(at)
    assert "--serving-engine" not in commands(at)[0] and "--kv-cache" not in commands(at)[0]
    typed(at, "sv_ep", 3)  # 3 groups cannot split 16 GPUs
    assert_message(at, "cannot serve")
    typed(at, "sv_ep", 16)
    use_deployment(at, "sv", "tpu-v7", "megakernel", devices=32, tp=32, ep=8)
    assert_clean(at)
    assert at.selectbox(key="sv_serving").value == "generic"  # a serving engine is a GPU multi-kernel engine
    assert "--hardware tpu-v7 --devices 32 --tp 32 --ep 8 --engine megakernel" in commands(at)[0]
    at.selectbox(key="sv_model").set_value("kimi-k3-mini").run()  # 2 KDA heads: tp 32 cannot run
    assert_message(at, "must divide kda heads (2)")
    typed(at, "sv_tp", 2)
    assert_clean(at)
    assert "--model kimi-k3-mini" in commands(at)[0]


# ----- Validation -------------------------------------------------------------------------------

def test_validation_your_trace_opens_on_demand():
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT)
    at.session_state["view"] = "Validation"
    at.run()
    assert_clean(at)
    assert not at.get("file_uploader") and "val_path" not in [t.key for t in at.text_input]
    at.session_state["val_trace_exp"] = True
    at.run()
    assert at.get("file_uploader") and at.text_input(key="val_path").value == ""


def test_validation_without_host_results_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr(validation, "HOST_VALIDATION_CSV", tmp_path / "host_validation.csv")
    at = open_view("Validation")
    assert any("No host validation results yet" in i.value for i in at.info)


def test_validation_bundled_results_mape_and_worst_layers(monkeypatch, tmp_path):
    csv = tmp_path / "host_validation.csv"
    rows = ["layer,kind,predicted_us,measured_us"] + [f"{i},kda,{100 + i},{100}" for i in range(10)]
    rows.append("10,mla,50,100")  # the worst layer: -50 %
    csv.write_text("\n".join(rows) + "\n")
    monkeypatch.setattr(validation, "HOST_VALIDATION_CSV", csv)
    at = open_view("Validation")
    mape = number(metric(at, "MAPE over layers"))
    expected = (sum(i / 100 for i in range(10)) + 0.5) / 11 * 100
    assert mape == pytest.approx(expected, abs=0.1)
    df = table(at, "val_host_table")
    assert len(df) == 11
    fig = chart(at, "val_host_chart")
    traces, colors = series(fig), legend(fig, "color")
    assert {"y = x (exact)", "+-25% (per-layer target)", "kda", "5 worst layers"} <= set(traces)
    worst = [r["predicted_us"] for r in series(fig, "point")["5 worst layers"]]
    assert colors["5 worst layers"] == "#d62728" and min(worst) == pytest.approx(50)  # layer 10, -50 %
    assert 100 not in worst  # layer 0 (+0 %) is not among the worst
    assert all(isinstance(colors[name], str) for name in series(fig, "point"))
    assert any("largest absolute error" in c.value and "inside the +-25% band" in c.value for c in at.caption)
    at.session_state["val_host_bars_exp"] = True  # the per-layer bars, on demand
    at.run()
    bars = chart(at, "val_host_layers")
    normal, red = series(bars, "bar")["measured"], series(bars, "bar")["measured, 5 worst layers"]
    assert legend(bars, "color")["measured, 5 worst layers"] == "#d62728"
    assert 10 in [r["layer"] for r in red] and 10 not in [r["layer"] for r in normal]


def test_validation_host_csv_schema_runs_and_step_rows(monkeypatch, tmp_path):
    """The layout experiments/validate_host.py writes: # header, per-run step rows and layer rows."""
    csv = tmp_path / "host_validation.csv"
    head = "variant,model,mode,batch,context,layer,kind,predicted_s,measured_s,measured_min_s,measured_max_s,rel_error"
    rows = ["# machine: test cpu", "# command: python experiments/validate_host.py", head]
    for mode, scale in (("compiled", 1.0), ("op_by_op", 2.0)):
        rows.append(f"file,kimi-k3-host-small,{mode},1,64,step,step,{0.004 * scale},{0.005 * scale},,,")
        rows += [f"file,kimi-k3-host-small,{mode},1,64,{i},kda,{0.001 * scale},{0.001 * scale * (1 + i / 10)},,,"
                 for i in range(4)]
    csv.write_text("\n".join(rows) + "\n")
    monkeypatch.setattr(validation, "HOST_VALIDATION_CSV", csv)
    at = open_view("Validation")
    assert any(c.value.startswith("Measured on test cpu") for c in at.caption)  # the file's machine, not "this one"
    assert metric(at, "step error") == "-20.0%"
    assert number(metric(at, "layers")) == 4  # the step row is not a layer
    runs = [d for d in tables(at) if "layer_mape" in d.columns][0]
    assert len(runs) == 2 and list(runs["mode"]) == ["compiled", "op_by_op"]
    at.selectbox(key="val_run").set_value(at.selectbox(key="val_run").options[1]).run()
    assert_clean(at)
    assert metric(at, "measured step") == "10.000 ms"


def test_validation_bundled_gpu_runs_on_demand():
    """The H200 results (experiments/results/gpu_validation.csv) in their own section, drawn when
    opened: its runs, one run's layers (kernel time) and its wall step; the coverage note names it."""
    import csv as csvlib
    at = open_view("Validation")
    assert "val_gpu_chart" not in charts(at)  # closed: not drawn
    assert any("NVIDIA H200" in i.value and "as `h200`" in i.value for i in at.info)
    at.session_state["val_gpu_exp"] = True
    at.run()
    assert_clean(at)
    assert "val_gpu_chart" in charts(at)
    lines = [line for line in validation.GPU_VALIDATION_CSV.read_text().splitlines() if not line.startswith("#")]
    rows = list(csvlib.DictReader(lines))
    run = at.selectbox(key="val_gpu_run").value.split(" / ")
    step = next(r for r in rows if [r[k] for k in validation.RUN_KEYS] == run and r["layer"] == "step")
    shown = [m.value for m in at.metric if m.label == "measured step"]
    assert f"{float(step['measured_s']) * 1e3:.3f} ms" in shown  # the wall step of the run picked
    assert any(cap.value.startswith("Measured on NVIDIA H200") for cap in at.caption)


@pytest.fixture(scope="module")
def captured_traces(tmp_path_factory):
    """One real host capture of the reference step (perfmodel capture; about 20 s on 2 cores)."""
    pytest.importorskip("jax")
    from perfmodel_jax.capture import capture_reference
    out = tmp_path_factory.mktemp("traces")
    runs = capture_reference("kimi-k3-host-small", out, batches=(1,), contexts=(64,), modes=("compiled",), steps=2)
    return out, runs[0]


@pytest.mark.slow
def test_validation_real_trace_path_and_directory_upload(captured_traces, monkeypatch):
    out, run = captured_traces
    monkeypatch.setenv(common.TRACE_ROOT_ENV, str(out))  # as `perfmodel dashboard --trace-root OUT`
    at = open_view("Validation")
    at.selectbox(key="val_hw").set_value("tpu-v7").run()  # any preset: the plumbing is under test
    at.text_input(key="val_path").input(str(run)).run()
    assert_clean(at)
    assert number(metric(at, "layers")) >= 3
    assert metric(at, "MAPE over layers").endswith("%")
    cmd = next(c for c in commands(at) if c.startswith("perfmodel validate"))
    assert f"--trace {run}" in cmd and "--hardware tpu-v7" in cmd
    page_layers = table(at, "val_host_table")
    # the same directory uploaded file by file (relative names, as a directory upload sends them)
    files = [(str(f.relative_to(out)), f.read_bytes(), "application/octet-stream")
             for f in sorted(out.rglob("*")) if f.is_file()]
    at.text_input(key="val_path").input("").run()
    at.file_uploader(key="val_upload").set_value(files).run()
    assert_clean(at)
    up_layers = table(at, "val_host_table")
    assert list(up_layers["layer"]) == list(page_layers["layer"])
    assert list(up_layers["predicted_us"]) == pytest.approx(list(page_layers["predicted_us"]))


def test_validation_bad_inputs(monkeypatch, tmp_path):
    monkeypatch.setenv(common.TRACE_ROOT_ENV, str(tmp_path))  # the trace root this dashboard was opened on
    csv = tmp_path / "host_validation.csv"
    csv.write_text("foo,bar\n1,2\n")
    monkeypatch.setattr(validation, "HOST_VALIDATION_CSV", csv)
    at = open_view("Validation", errors_ok=True)
    assert any("unexpected layout" in e for e in errors(at))
    at.text_input(key="val_path").input(str(tmp_path / "nope")).run()
    assert_message(at, "does not exist")
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    at.text_input(key="val_path").input(str(other)).run()
    assert any("expected a .xplane.pb" in e for e in errors(at))
    at.text_input(key="val_path").input(str(tmp_path)).run()  # a directory without any trace
    assert_message(at, "Cannot use this trace")
    at.text_input(key="val_path").input("").run()
    at.file_uploader(key="val_upload").set_value(("cat.jpg", b"\xff\xd8\xff", "image/jpeg")).run()
    assert_message(at, "not a profiler trace")
    at.file_uploader(key="val_upload").set_value(("run.xplane.pb", b"garbage", "application/octet-stream")).run()
    assert_message(at, "Cannot use this trace")


def test_validation_path_is_confined_to_the_opened_directories(monkeypatch, tmp_path):
    root, outside = tmp_path / "traces", tmp_path / "elsewhere"
    root.mkdir()
    outside.mkdir()
    (root / "link").symlink_to(outside)
    monkeypatch.setenv(common.TRACE_ROOT_ENV, str(root))
    at = open_view("Validation")
    for path in ("/etc", str(outside), str(root / "link"), str(root / ".." / "elsewhere"), "../../etc"):
        at.text_input(key="val_path").input(path).run()
        assert_message(at, "is outside the directories this dashboard was opened on")
        assert any(f"trace path={path}" in e or path in e for e in errors(at)), errors(at)  # the error names it
        # not the server's own paths nor its command-line flags: a browser's user can act on neither
        assert not any(str(root) in e.replace(path, "") or "--trace-root" in e for e in errors(at)), errors(at)
    at.text_input(key="val_path").input(str(root)).run()  # inside: parsed (no run there)
    assert not any("outside the directories" in e for e in errors(at))
    assert common.confined_path(str(root)) == root.resolve()


def test_validation_says_which_platforms_have_trace_validation(monkeypatch, tmp_path):
    at = open_view("Validation")
    text = at.info[0].value
    assert "gb200, tpu-v7: no trace validation yet" in text and "host CPU" in text


def test_validation_names_the_machines_and_says_why_the_gpu_step_is_off():
    """Results measured elsewhere are named by the machine their file names (never "this machine"); the provenance
    reads as lines (no Python dict, no temporary path); the H200's large step error comes with what its traces say."""
    at = open_view("Validation", val_gpu_exp=True)
    assert_clean(at)
    text = " ".join([i.value for i in at.info] + [c.value for c in at.caption] + [m.value for m in at.markdown])
    assert "this machine" not in text and "{'start'" not in text and "/tmp/" not in text
    host = measured.header(validation.HOST_VALIDATION_CSV)["machine"]
    assert f"the host CPU ({host}" in at.info[0].value
    assert any(m.value.startswith("- machine: ") and "- load average (1 min): " in m.value for m in at.markdown)
    why = next(i.value for i in at.info if i.value.startswith("**Why the step error is"))
    assert "idle" in why and "kernels" in why and "docs/validation.md" in why


def test_validation_tpu_runs_from_the_committed_json(monkeypatch, tmp_path):
    """This project's megakernel and the XLA reference on a TPU: drawn from the committed JSON (tokens/s = batch /
    step across batches, measured beside predicted, with the error), its source and provenance named, what is not
    measured yet said; said to be missing when the file is not there."""
    t = measured.tpu_results()
    assert t is not None and not t["rows"].empty  # the committed v5e results
    dense = t["rows"][t["rows"]["slice"].str.endswith("-dense")]   # a slice without MoE: no experts named
    assert not dense.empty and set(dense["format"]) == {"none (dense)"}
    at = open_view("Validation", val_tpu_exp=True)
    assert_clean(at)
    captions = " ".join(c.value for c in at.caption)
    assert measured.TPU_RUNS_JSON.name in captions and f"TPU {t['meta']['chip']}" in captions
    got = series(chart(at, "val_tpu_chart"), "point")
    main = t["rows"][~t["rows"]["sweep"]]
    run = main["slice"] + " " + main["format"]
    drawn = run.value_counts().index[0]   # the most measured slice and format, the first choice
    for e, g in main[run == drawn].groupby("engine"):   # the latest run of each batch
        assert len(got[f"{e}, measured"]) == g["batch"].nunique()
        pts = dict(sorted((r["batch"], r["tokens_per_s"]) for r in got[f"{e}, measured"]))
        assert pts == pytest.approx(dict(zip(g["batch"], g["batch"] / g["measured_step_s"])))
    assert any("- libtpu: " in m.value and "- command: " in m.value for m in at.markdown)  # the provenance popover
    warn = " ".join(w.value for w in at.warning)
    assert "Not measured yet" in warn
    assert ("no ring depth x expert slot sweep" in warn) == (not t["rows"]["sweep"].any())
    assert ("no in-kernel trace" in warn) == (not t["summary"].get("traced_runs"))
    monkeypatch.setattr(measured, "TPU_RUNS_JSON", tmp_path / "tpu_megakernel.json")
    at = open_view("Validation", val_tpu_exp=True)
    assert any("No TPU run of this project's megakernel is committed yet" in i.value for i in at.info)


def test_compare_and_whatif_name_the_tpu_runs():
    """Compare, with a platform on TPU v5e, names this project's measured series there; What-if's ring x slots
    map draws the committed sweeps beside the model's curves, measured points and predicted line per family
    (one knob varied, the others held: validate_tpu's)."""
    t = measured.tpu_results()
    at = open_view("Compare")
    at.selectbox(key="cmp_A_hw").set_value("tpu-v5e").run()
    note = next(c.value for c in at.caption if c.value.startswith("This project's runs on tpu-v5e"))
    latest = measured.tpu_latest(t["rows"])
    b, v = next(zip(latest["batch"], latest["measured_tokens_per_s"]))
    assert measured.TPU_RUNS_JSON.name in note and f"{v:,.0f} at batch {b}" in note
    assert note.count(" at batch ") == len(latest)   # each point once: its latest run (the current kernel)
    at = open_view("What-if", tab="Ring x expert slots")
    for knob, key, field in (("depth", "wi_sweep_measured", "depth"), ("expert_slots", "wi_slots_measured", "slots")):
        fams = [w for w in t["sweeps"] if w["knob"] == knob]
        assert fams
        got, lines = series(chart(at, key), "point"), series(chart(at, key), "line")
        assert len(got) == len(lines) == len(fams)
        for w in fams:
            label = whatif.sweep_label(w)
            assert [r[field] for r in got[f"{label}, measured"]] == w["values"]
            assert [r["tokens_per_s"] for r in lines[f"{label}, predicted"]] == \
                pytest.approx([w["batch"] / s for s in w["predicted_s"]])
    assert any("squares: measured by this project" in c.value for c in at.caption)


def test_validation_shows_the_real_megakernels_phase_profile():
    """The bundled phase profile, per kernel: each per-layer phase measured (bars) and predicted (ticks),
    every phase in a table with its error, the attention by part, the stated gains, and a command that
    prints the same numbers."""
    at = open_view("Validation")
    assert "one published phase-by-phase profile of a real megakernel" in at.info[0].value
    (cmd,) = [x for x in commands(at) if "--profile" in x]
    out = run_cli(cmd + " --json")["phase_profile"]
    for name, k in out["kernels"].items():
        drawn = series(chart(at, f"val_profile_{name}"))
        layer_phases = [r for r in k["phases"] if r["per"] == "layer" and r["phase"] != "layer"]
        for kind in ("measured", "predicted"):
            assert [r["phase"] for r in drawn[kind]] == [r["phase"] for r in layer_phases]
            assert [r["us"] for r in drawn[kind]] == pytest.approx([r[f"{kind}_us"] for r in layer_phases])
        assert headline(at, "phases within tolerance").count(" of ") == 1
    rows = [t for t in tables(at) if "within" in t.columns]
    assert [list(t["phase"]) for t in rows] == [[r["phase"] for r in k["phases"]] for k in out["kernels"].values()]
    captions = [x.value for x in at.caption]
    for k in out["kernels"].values():  # the attention by part, as the command prints it
        assert f"Attention by part (a diagnostic): leaving out its compute alone saves " \
               f"{k['attention_parts_us']['compute']:.2f} us" in " ".join(captions)
    (check,) = [t for t in tables(at) if "change" in t.columns]
    assert check["measured us"][0] == out["checks"][0]["measured_us"]
    assert check["predicted us"][0] == pytest.approx(out["checks"][0]["predicted_us"], rel=1e-2)


def test_validation_upload_error_names_the_file_not_a_temp_path():
    at = open_view("Validation")
    at.file_uploader(key="val_upload").set_value(("run.xplane.pb", b"garbage", "application/octet-stream")).run()
    assert_message(at, "your upload: run.xplane.pb")
    assert not any("/tmp" in e for e in errors(at)), errors(at)


def test_per_layer_table_units():
    import pandas as pd
    df = validation.per_layer_table(pd.DataFrame({"layer": [1, 2], "predicted_s": [1e-6, 2e-6],
                                                  "measured_s": [2e-6, 2e-6]}))
    assert list(df["predicted_us"]) == pytest.approx([1, 2]) and list(df["error"]) == pytest.approx([-0.5, 0])


# ----- Models & hardware ------------------------------------------------------------------------

HF_CONFIG = {"num_hidden_layers": 4, "hidden_size": 1024, "vocab_size": 32000, "num_attention_heads": 16,
             "num_key_value_heads": 4, "intermediate_size": 4096, "_name_or_path": "tiny-llama"}


def test_models_view_presets_and_sources():
    at = open_view("Models & hardware", mh_model_sources_exp=True, mh_hw_sources_exp=True)
    models = table(at, "mh_models")
    assert "kimi-k3" in set(models["model"]) and "sources" not in models  # a line a preset; sources in the details
    hw = table(at, "mh_hw")
    assert {"tpu-v7", "gb200"} <= set(hw["hardware"]) and "efficiency" not in hw
    fields = table(at, "mh_hw_fields")
    ref = fields.set_index("field").loc["hbm_bandwidth_bytes_per_s", "source"]  # "[n]": the n-th source below
    listed = next(m.value for m in at.markdown if m.value.startswith("1. ") and "shapes:" not in m.value)
    n = int(ref.strip("[]"))
    assert listed.split("\n")[n - 1].startswith(f"{n}. Inferact")
    assert any("shapes:" in m.value for m in at.markdown if m.value.startswith("1. "))  # the model's sources
    assert fields.set_index("field").loc["hbm_bandwidth_bytes_per_s", "value"].endswith("TB/s")
    at.selectbox(key="mh_hw_pick").set_value("gb200").run()
    assert table(at, "mh_hw_fields").set_index("field").loc["onchip_kind", "value"] != "VMEM"
    at.selectbox(key="mh_model").set_value("deepseek-v3").run()
    assert_clean(at)
    assert "256" in table(at, "mh_model_fields").set_index("field").loc["moe.experts", "value"]


def test_models_upload_config_json_used_in_whatif():
    at = open_view("Models & hardware")
    at.file_uploader(key="mh_model_upload").set_value(
        ("config.json", json.dumps(HF_CONFIG).encode(), "application/json")).run()
    assert_clean(at)
    assert "your upload: config.json (tiny-llama)" in at.success[0].value
    at.sidebar.radio(key="view").set_value("What-if").run()
    at.selectbox(key="wi_model").set_value("your upload: config.json (tiny-llama)").run()
    assert_clean(at, errors_ok=True)
    assert "must divide gqa heads (16)" in errors(at)[0]
    typed(at, "wi_devices", 4)
    typed(at, "wi_tp", 4)
    assert_clean(at)
    assert number(metric(at, "tokens/s (predicted)")) > 1000
    assert any("<path to your config.json or .toml>" in c for c in commands(at))


def test_models_uploads_get_unique_names_units_and_real_parameter_counts():
    at = open_view("Models & hardware")
    other = {**HF_CONFIG, "_name_or_path": "tiny-llama", "num_hidden_layers": 8}
    names = []
    for cfg in (HF_CONFIG, other):
        at.file_uploader(key="mh_model_upload").set_value(
            ("config.json", json.dumps(cfg).encode(), "application/json")).run()
        assert_clean(at)
        names.append(at.success[0].value.split("as '")[1].split("'")[0])
    assert names[0] != names[1] and set(names) <= set(at.selectbox(key="mh_model").options)
    models = table(at, "mh_models")
    small = models.set_index("model").loc["llama-3.2-1b"]
    assert small["parameters"].endswith(" B") and not small["parameters"].startswith("0")
    hw = table(at, "mh_hw").set_index("hardware").loc["tpu-v7"]
    assert hw["HBM bandwidth"].endswith("TB/s") and hw["on-chip per core"] == "64 MiB VMEM"
    at.selectbox(key="mh_model").set_value(names[1]).run()
    fields = table(at, "mh_model_fields").set_index("field")["value"]
    assert not any(v.startswith("0.000") for v in fields)


def test_models_upload_hardware_toml_and_bad_files():
    at = open_view("Models & hardware")
    text = (ROOT / "perfmodel/presets/hardware/tpu-v7.toml").read_text().replace(
        'name = "tpu-v7"', 'name = "tpu-v7-big-vmem"').replace("onchip_bytes = 67108864", "onchip_bytes = 134217728")
    at.file_uploader(key="mh_hw_upload").set_value(("big.toml", text.encode(), "text/plain")).run()
    assert_clean(at)
    assert "your upload: big.toml (tpu-v7-big-vmem)" in at.success[0].value
    assert "your upload: big.toml (tpu-v7-big-vmem)" in at.selectbox(key="mh_hw_pick").options
    bad = [("mh_model_upload", "config.json", b'{"hidden_size": 1}', "required key is missing"),
           ("mh_model_upload", "config.json", b"{not json", "not valid JSON"),
           ("mh_model_upload", "config.json", b"\xff\xfe\x00\x9c", "not a text file"),
           ("mh_model_upload", "model.yaml", b"a: 1", "expected a Hugging Face config.json"),
           ("mh_hw_upload", "hw.toml", b'name = "x"\nkind=', "not valid TOML"),
           ("mh_hw_upload", "hw.toml", text.replace("dma_sharing", "#").encode(), "missing"),
           ("mh_hw_upload", "hw.json", b"{}", "expected a hardware .toml")]
    for key, name, data, why in bad:
        at.file_uploader(key=key).set_value((name, data, "application/octet-stream")).run()
        assert_clean(at, errors_ok=True)
        assert any(why in e for e in errors(at)), (name, why, errors(at))
        at.file_uploader(key=key).set_value(None).run()


def test_unexpected_exception_is_a_message_not_a_traceback(monkeypatch):
    from pmdash import models
    def boom():
        raise RuntimeError("kaboom")
    monkeypatch.setattr(models, "preset_tables", boom)
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT)
    at.session_state["view"] = "Models & hardware"
    at.run()
    assert not at.exception
    assert "kaboom" in errors(at)[0] and "RuntimeError" in errors(at)[0]


def test_download_payloads():
    import pandas as pd
    df = pd.DataFrame({"batch": [1, 2], "tokens_per_s": [249.0, 392.0]})
    out = json.loads(common.table_json(df, {"model": "kimi-k3"}))
    assert out["model"] == "kimi-k3" and out["rows"][1] == {"batch": 2, "tokens_per_s": 392.0}
    key = common.dep_key(32, 32, 8, "megakernel")
    trace = json.loads(common.chrome_trace_json(common.model_ref("kimi-k3"), common.hardware_ref("tpu-v7"),
                                                key, None))
    assert len(trace["traceEvents"]) > 1000
