"""The dashboard in a real browser: headless Chromium (Debian package) driven by Playwright.

Starts `streamlit run dashboards/app.py` on a free localhost port (the helpers of
experiments/bench_dashboard_browser.py) and checks, as a user sees them, the defects a browser
session once found: downloads lost under rapid clicking, the batch picker adding 8, 18, 28 ...,
number fields that silently round or clear, stale charts that did not say so, an infeasible
configuration wiping the page, raw bytes in errors, measured sources sharing a marker, an
implausible upload flattening the chart, error floods, unexplained prefetch and VMEM curves,
unlabelled validation coverage, temp paths in errors, colliding upload names, params 0.0 and
usage statistics fetched from the network. Saves a screenshot of each view at 1400 px width
under test-output/dashboard/.
"""
from __future__ import annotations

import importlib.util
import json
import re
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "test-output" / "dashboard"
_spec = importlib.util.spec_from_file_location("bench_dashboard_browser",
                                               ROOT / "experiments" / "bench_dashboard_browser.py")
bb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bb)

pytestmark = pytest.mark.browser
ERRORS = '[data-testid="stAlertContentError"]'
HF_CONFIG = {"num_hidden_layers": 4, "hidden_size": 1024, "vocab_size": 32000, "num_attention_heads": 16,
             "num_key_value_heads": 4, "intermediate_size": 4096, "_name_or_path": "tiny-llama"}


@pytest.fixture(scope="module")
def server():
    if not Path(bb.CHROMIUM).exists():
        pytest.skip("chromium is not installed (CI installs the Debian package: apt-get install -y chromium)")
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    log = OUT / "streamlit.log"
    with bb.serve(log) as url:
        yield url, log


@pytest.fixture(scope="module")
def browser(server):
    with bb.browser() as b:
        yield b


@pytest.fixture()
def page(server, browser):
    """A fresh page on the Compare view; every request it makes is recorded."""
    url, _ = server
    p = bb.new_page(browser)
    p.requests = []
    p.on("request", lambda r: p.requests.append(r.url))
    p.goto(url)
    bb.wait_chart(p, "cmp_chart")
    bb.wait_idle(p)
    yield p
    p.close()


def errors(page) -> list[str]:
    return [e.inner_text() for e in page.query_selector_all(ERRORS)]


def assert_no_errors(page) -> None:
    assert not errors(page)
    assert not page.query_selector_all('[data-testid="stException"]')
    assert "Traceback" not in page.inner_text("body")


def view(page, name: str, chart: str | None = None) -> None:
    bb.show_view(page, name)
    if chart:
        bb.wait_chart(page, chart)
    bb.wait_idle(page)


def settle(page) -> None:
    """Wait for the rerun an input started (give it time to start on a loaded machine, then to end)."""
    time.sleep(0.6)
    bb.wait_idle(page)


def type_in(page, key: str, value) -> None:
    bb.act(page, "text", key, value)
    settle(page)


def pick(page, key: str, option: str) -> None:
    page.locator(f".st-key-{key}").click()
    page.get_by_role("option", name=option, exact=True).click()
    settle(page)


def figure(page, key: str) -> dict:
    """The chart's traces (name, type, x, y, marker) and axis types, as plotly.js holds them."""
    return page.evaluate("""key => {
      const gd = document.querySelector(`.st-key-${key} .js-plotly-plot`);
      const arr = a => a ? Array.from(a) : [];
      return {traces: gd._fullData.map(t => ({name: t.name, type: t.type, x: arr(t.x), y: arr(t.y),
                                             color: t.marker && t.marker.color, symbol: t.marker && t.marker.symbol,
                                             size: t.marker && t.marker.size})),
              yaxis: gd._fullLayout.yaxis.type, annotations: (gd._fullLayout.annotations || []).map(a => a.text)};
    }""", key)


def screenshot(page, name: str) -> None:
    """The whole view at 1400 px width (the app scrolls inside its own container: grow the viewport)."""
    h = page.evaluate("() => document.querySelector('[data-testid=\"stMain\"]').scrollHeight")
    page.set_viewport_size({"width": 1400, "height": min(max(h + 50, 1000), 12000)})
    time.sleep(0.5)
    bb.wait_idle(page)
    page.screenshot(path=str(OUT / f"{name}.png"), full_page=True)
    page.set_viewport_size({"width": 1400, "height": 1000})


def test_every_view_renders_clean_and_fetches_nothing_external(page, server):
    assert_no_errors(page)
    screenshot(page, "compare")
    for name, chart in (("What-if", "wi_roofline"), ("Validation", "val_host_chart"), ("Models & hardware", None)):
        view(page, name, chart)
        assert_no_errors(page)
        screenshot(page, name.split()[0].lower().replace("-", ""))
    hosts = {urlparse(u).hostname for u in page.requests if u.startswith("http")}
    assert hosts == {"127.0.0.1"}, hosts  # usage statistics off: no fetch beyond this server
    for f in ("compare", "whatif", "validation", "models"):
        assert (OUT / f"{f}.png").stat().st_size > 10_000


def test_downloads_survive_rapid_clicking(page, server):
    _, log = server
    view(page, "What-if", "wi_roofline")
    buttons = page.locator('[data-testid="stDownloadButton"] button')
    n = buttons.count()
    assert n >= 8
    got = []
    page.on("download", lambda d: got.append(d))
    for i in range(n):  # one after another, without waiting for the files
        buttons.nth(i).click()
    deadline = time.monotonic() + 90
    while len(got) < n and time.monotonic() < deadline:
        page.wait_for_timeout(200)
    assert len(got) == n, f"{len(got)} of {n} downloads arrived"
    for d in got:
        assert d.failure() is None, (d.suggested_filename, d.failure())
        assert Path(d.path()).stat().st_size > 0, d.suggested_filename
    assert "not found" not in log.read_text()


def test_batch_sizes_are_exactly_what_is_typed(page):
    type_in(page, "cmp_batches", "8")
    assert_no_errors(page)
    pred = [t for t in figure(page, "cmp_chart")["traces"] if t["name"].endswith("predicted")]
    assert pred and all(t["x"] == [8] for t in pred)


def test_number_fields_refuse_bad_text_and_grey_the_stale_chart(page):
    view(page, "What-if", "wi_breakdown")
    for text, why in (("1e9", "out of range"), ("", "enter a number"), ("4.5", "not a whole number")):
        type_in(page, "wi_batch", text)
        field_box = page.locator(".st-key-wi_batch").locator("xpath=..")
        assert why in field_box.inner_text()  # the message sits beside the field
        stale = page.locator("[class*='st-key-stale_wi_bd']")
        assert stale.count() == 1
        assert float(stale.evaluate("e => getComputedStyle(e).opacity")) < 0.5
        assert "Stale" in page.inner_text("body")
    type_in(page, "wi_batch", "1")
    assert_no_errors(page)
    assert page.locator("[class*='st-key-stale_']").count() == 0


def test_infeasible_configuration_keeps_the_page(page):
    view(page, "What-if", "wi_breakdown")
    for k, v in (("wi_prefetch", 64), ("wi_slots", 16), ("wi_vmem", 0.5)):
        type_in(page, k, v)
    msgs = errors(page)
    assert len(msgs) == 1 and "cannot run" in msgs[0] and "MiB" in msgs[0]
    assert not re.search(r"\d{6,} B", msgs[0])  # no raw byte counts
    assert page.get_by_text("Nearest configurations that run").count() == 1
    assert page.get_by_text("Step time vs prefetch depth").count() == 1  # the sweep stays: what fits
    for key in ("wi_breakdown", "wi_timeline", "wi_roofline"):
        assert figure(page, key)["traces"]
    page.get_by_role("button", name="Use this").first.click()
    settle(page)
    assert_no_errors(page)


def test_prefetch_sweep_and_vmem_mechanism(page):
    view(page, "What-if", "wi_prefetch_chart")
    assert "do not fit" not in " ".join(e.inner_text() for e in page.query_selector_all(
        '[data-testid="stAlertContentWarning"]'))  # nothing warns at the defaults
    names = [t["name"] for t in figure(page, "wi_prefetch_chart")["traces"]]
    assert {"current", "expert slots", "saturation"} <= set(names)
    type_in(page, "wi_vmem", 1000000)
    page.get_by_text("500000 MiB it is").wait_for()
    assert "dma_sharing" in page.inner_text("body")
    cur = next(t for t in figure(page, "wi_prefetch_chart")["traces"] if t["name"] == "current")
    step = float(page.locator('[data-testid="stMetric"]').filter(has_text="step time").locator(
        '[data-testid="stMetricValue"]').inner_text().split()[0])
    assert cur["x"] == [500000] and cur["y"][0] == pytest.approx(step, rel=1e-3)


def test_measured_sources_log_axis_and_implausible_upload(page, tmp_path):
    csv = tmp_path / "bench.csv"
    csv.write_text("hardware,engine,devices,batch,tokens_per_s\ntpu-v7,megakernel,32,16,1500\n"
                   "tpu-v7,megakernel,32,32,1e30\n")
    page.get_by_text("Load your own measurements (CSV)").click()
    page.locator(".st-key-cmp_upload input[type=file]").set_input_files(str(csv))
    page.get_by_text("Loaded 2 measured point(s) from bench.csv").wait_for()
    bb.wait_idle(page)
    # plotly draws the new trace after the rerun ends: wait for it, not for a fixed time
    page.wait_for_function("""() => {
      const gd = document.querySelector('.st-key-cmp_chart .js-plotly-plot');
      return gd && gd._fullData && gd._fullData.some(t => (t.name || '').startsWith('your upload'));
    }""", timeout=60_000, polling=50)
    fig = figure(page, "cmp_chart")
    measured = {t["name"]: t for t in fig["traces"] if t["type"] == "scatter" and not t["name"].endswith("predicted")}
    assert "your upload: bench.csv (platform A)" in measured
    assert "Inferact, 16x TPU v7, published (platform A)" in measured
    assert len({t["symbol"] for t in measured.values()}) == len(measured)
    assert max(max(t["y"]) for t in fig["traces"]) < 1e5
    page.get_by_text("above 2x the chip's HBM roofline").first.wait_for(timeout=30_000)  # drawn after the chart
    assert "seed" not in page.inner_text("body").lower()
    page.locator(".st-key-cmp_logy label").click()
    settle(page)
    assert figure(page, "cmp_chart")["yaxis"] == "log"


def test_compare_refused_layouts_one_box_per_cause(page):
    pick(page, "cmp_A_hw", "h100")
    pick(page, "cmp_A_hw", "tpu-v6e")
    page.locator(ERRORS).first.wait_for()
    bb.wait_idle(page)
    assert len(errors(page)) == 1  # one per cause, not one per batch
    pick(page, "cmp_A_hw", "tpu-v7")
    pick(page, "cmp_model", "kimi-k3-host-small")
    page.locator(ERRORS).nth(1).wait_for()
    bb.wait_idle(page)
    assert len(errors(page)) == 2  # platform A and B: tp does not divide the 2 heads
    assert page.locator(".st-key-cmp_near_A_0 button").count() == 1
    page.locator(".st-key-cmp_near_A_0 button").click()
    settle(page)
    assert [t for t in figure(page, "cmp_chart")["traces"] if t["name"].startswith("A:")]


def test_validation_coverage_legend_and_upload_names(page, tmp_path):
    view(page, "Validation", "val_host_chart")
    assert page.get_by_text("no trace validation yet").count() == 1
    traces = figure(page, "val_host_chart")["traces"]
    bars = [t for t in traces if t["type"] == "bar"]
    assert all(isinstance(t["color"], str) for t in bars)  # one colour per trace: the legend swatch is the bar
    assert len({t["color"] for t in bars}) == len(bars)
    assert next(t for t in traces if t["name"] == "predicted")["size"] >= 12
    pb = tmp_path / "run.xplane.pb"
    pb.write_bytes(b"garbage")
    page.locator(".st-key-val_upload input[type=file]").set_input_files(str(pb))
    page.locator(ERRORS).first.wait_for()
    bb.wait_idle(page)
    msg = " ".join(errors(page))
    assert "your upload: run.xplane.pb" in msg and "/tmp" not in msg


def test_models_uploads_get_unique_names(page, tmp_path):
    view(page, "Models & hardware")
    names = []
    for layers in (4, 8):
        f = tmp_path / str(layers) / "config.json"
        f.parent.mkdir()
        f.write_text(json.dumps({**HF_CONFIG, "num_hidden_layers": layers}))
        page.locator(".st-key-mh_model_upload input[type=file]").set_input_files(str(f))
        ok = page.locator('[data-testid="stAlertContentSuccess"]')
        ok.filter(has_text="config.json").wait_for()
        page.wait_for_timeout(500)  # the uploader's rerun replaces the previous message
        bb.wait_idle(page)
        names.append(ok.first.inner_text().split("as '")[1].split("'")[0])
    assert names[0] != names[1]  # the second config.json does not replace the first (both stay choices:
    # tests/test_dashboard.py checks the option lists)
