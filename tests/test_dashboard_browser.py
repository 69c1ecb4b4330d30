"""The dashboard in a real browser: headless Chromium (Debian package) driven by Playwright.

Starts `streamlit run dashboards/app.py` with the app's own settings (localhost only, no usage
statistics; the helpers of experiments/bench_dashboard_browser.py) under an audit hook that records
every socket the server opens, and checks, as a user sees them: each of the seven views with every
control used once, an upload in every uploader, every download button clicked in quick succession
and each file read back; the chart clicks (a ring x slots cell, a layer bar); and the defects a
browser session once found (downloads lost under rapid clicking, the batch field adding 8, 18, 28,
number fields that silently round, stale charts that did not say so, an infeasible configuration
wiping the page, raw bytes in errors, measured sources sharing a marker, an implausible upload
flattening the chart, error floods, a results upload breaking Design search, temp paths in
errors, colliding upload names). The last test: the server listened on loopback only and neither
it nor the page sent anything beyond this machine. Saves a screenshot of each view under
test-output/dashboard/.
"""
from __future__ import annotations

import importlib.util
import ipaddress
import io
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
# What Vega-Lite drew of a chart (its SVG): each mark's hover fields (its aria-label, "title: value; ..."), its
# role (bar, point, line mark, text mark ...), shape path and centre on the page; the axes' descriptions
# ("X-axis titled 'batch' for a log scale ..."); the texts written in the plot (not the axes' or legends')
MARKS = """key => {
  const svg = document.querySelector(`.st-key-${key} .vega-embed svg.marks`);
  if (!svg) return null;
  const fields = label => Object.fromEntries(label.split('; ').map(p => {
    const i = p.indexOf(': ');
    return [p.slice(0, i), p.slice(i + 2)];
  }));
  const guide = e => e.closest('[aria-roledescription="axis"], [aria-roledescription="legend"]');
  const marks = [...svg.querySelectorAll('[role="graphics-symbol"][aria-label]')].filter(e => !guide(e)).map(e => {
    const r = e.getBoundingClientRect();
    return {role: e.getAttribute('aria-roledescription'), d: e.getAttribute('d') || '', x: r.left + r.width / 2,
            y: r.top + r.height / 2, ...fields(e.getAttribute('aria-label'))};
  });
  const axes = [...svg.querySelectorAll('[aria-roledescription="axis"]')].map(e => e.getAttribute('aria-label'));
  const texts = [...svg.querySelectorAll('g.mark-text text')].filter(e => !guide(e)).map(e => e.textContent);
  // each axis's tick labels with their centre on the page; each legend's title and entries
  const ticks = [...svg.querySelectorAll('[aria-roledescription="axis"]')].map(e => ({
    axis: e.getAttribute('aria-label'), labels: [...e.querySelectorAll('g.role-axis-label text')].map(t => {
      const r = t.getBoundingClientRect();
      return {text: t.textContent, x: r.left + r.width / 2, y: r.top + r.height / 2};
    })}));
  const legends = [...svg.querySelectorAll('[aria-roledescription="legend"]')].map(e => ({
    label: e.getAttribute('aria-label') || '',
    entries: [...e.querySelectorAll('g.role-legend-label text')].map(t => t.textContent),
    title: [...e.querySelectorAll('g.role-legend-title text')].map(t => t.textContent).join(' ')}));
  return {marks, axes, texts, ticks, legends};
}"""
# What a chart of every view says its series are: a legend, or labels in the plot or on an axis. A lower panel
# (two charts stacked as one figure) reads the legend of the panel above it for the marks it shares with it.
LOWER_PANELS = {"cmp_ratio": "cmp_chart"}
# the charts drawn one under the other as one figure: they share their x range and their x positions
STACKED = (("cmp_chart", "cmp_ratio"), ("sv_chart", "sv_tpot_chart"), ("wi_prefetch_chart", "wi_prefetch_causes"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not Path(bb.CHROMIUM).exists():
        pytest.skip("chromium is not installed (CI installs the Debian package: apt-get install -y chromium)")
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    log, audit = OUT / "streamlit.log", tmp_path_factory.mktemp("audit") / "sockets.jsonl"
    info: dict = {}
    with bb.serve(log, info=info, audit_log=audit) as url:
        yield {"url": url, "log": log, "audit": audit, "pid": info["pid"],
               "listening": bb.listening(info["pid"])}


@pytest.fixture(scope="module")
def browser(server):
    with bb.browser() as b:
        yield b


@pytest.fixture()
def page(server, browser):
    """A fresh page on the Compare view; every request it makes is recorded."""
    p = bb.new_page(browser)
    p.requests = []
    p.on("request", lambda r: p.requests.append(r.url))
    p.goto(server["url"])
    bb.wait_chart(p, "cmp_chart")
    bb.wait_idle(p)
    yield p
    p.close()


# ----- helpers ------------------------------------------------------------------------------------

def errors(page) -> list[str]:
    return [e.inner_text() for e in page.query_selector_all(ERRORS)]


def assert_no_errors(page) -> None:
    assert not errors(page), errors(page)
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
    """A selectbox's option."""
    page.locator(f".st-key-{key}").click()
    page.keyboard.type(option)  # the list shows a window of its options: filter it to the one
    page.get_by_role("option", name=option, exact=True).click()
    settle(page)


def radio(page, key: str, option: str) -> None:
    bb.act(page, "radio", key, option)
    settle(page)


def toggle(page, key: str) -> None:
    bb.act(page, "toggle", key, None)
    settle(page)


def slide(page, key: str, presses: int = 1, thumb: int = 0) -> None:
    """A slider or select slider: its thumb moved with the arrow keys (as a keyboard user does)."""
    t = page.locator(f".st-key-{key} input[type=range]").nth(thumb)
    t.focus()
    t.press("ArrowRight" if presses > 0 else "ArrowLeft")
    for _ in range(abs(presses) - 1):
        t.press("ArrowRight" if presses > 0 else "ArrowLeft")
    settle(page)


def tab(page, key: str, name: str, chart: str | None = None) -> None:
    page.locator(f".st-key-{key}").get_by_role("tab", name=name).click()
    settle(page)
    if chart:
        bb.wait_chart(page, chart)


def expand(page, key: str) -> None:
    page.locator(f".st-key-{key} summary").first.click()
    settle(page)


def until(act, done, tries: int = 4) -> None:
    """`act()` again until `done(timeout_ms)` holds: a popover clicked while a rerun redraws it (late on a
    loaded machine) closes again, and an Escape that lands while a select inside it holds the focus
    closes only the select's list."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    for attempt in range(tries):
        act()
        try:
            return done(15_000)
        except PlaywrightTimeout:
            if attempt == tries - 1:
                raise


def open_menu(page, button, body) -> None:
    """Popover `button` clicked (the app idle first) until its `body` is mounted."""
    until(lambda: (bb.wait_idle(page), button.click()), lambda ms: body.first.wait_for(timeout=ms))


def close_menu(page, body) -> None:
    """Escape until popover `body` is gone."""
    until(lambda: page.keyboard.press("Escape"), lambda ms: body.first.wait_for(state="detached", timeout=ms))


def in_menu(page, key: str, action) -> None:
    """`action` on the widgets of popover `key` (mounted only while it is open): opened, used, closed."""
    open_menu(page, page.locator(f".st-key-{key} [data-testid='stPopoverButton']"),
              page.locator("[data-testid='stPopoverBody']"))
    action()
    close_menu(page, page.locator("[data-testid='stPopoverBody']"))


def click(page, key: str) -> None:
    page.locator(f".st-key-{key} button").first.click()
    settle(page)


def upload(page, key: str, *files: Path) -> None:
    page.locator(f".st-key-{key} input[type=file]").set_input_files([str(f) for f in files])
    settle(page)


def upload_measurements(page, tmp_path: Path, text: str, rows: int) -> None:
    """Compare's measurements CSV uploaded as bench.csv, and the chart redrawn with it."""
    csv = tmp_path / "bench.csv"
    csv.write_text(text)
    page.get_by_text("Load your own measurements (CSV)").click()  # a popover: the uploader is mounted when it opens
    upload(page, "cmp_upload", csv)
    page.get_by_text(f"Loaded {rows} measured point(s) from bench.csv").wait_for()
    bb.wait_idle(page)
    page.keyboard.press("Escape")  # closed: the upload stays (it is the widget's state, not the popover's)
    page.locator(".st-key-cmp_upload").wait_for(state="detached")
    # Vega draws the new points after the rerun ends: wait for them, not for a fixed time
    page.wait_for_function("""() => [...document.querySelectorAll('.st-key-cmp_chart svg.marks [aria-label]')]
      .some(e => e.getAttribute('aria-label').includes('series: your upload'))""", timeout=60_000, polling=50)


def table_shown(page, expander: str) -> bool:
    """The expander's table is drawn (it opens on demand)."""
    t = page.locator(f'.st-key-{expander} [data-testid="stDataFrame"]')
    t.first.wait_for()
    return t.count() == 1


def figure(page, key: str) -> dict:
    """A chart as drawn: {"series": {name: [marks]}, "axes": [descriptions], "texts": [...]} (see MARKS)."""
    got = page.evaluate(MARKS, key)
    assert got is not None, f"no chart {key}"
    out = {"series": {}, "axes": got["axes"], "texts": got["texts"], "ticks": got["ticks"], "legends": got["legends"]}
    for m in got["marks"]:
        out["series"].setdefault(m.get("series"), []).append(m)
    return out


def legend_entries(fig: dict) -> list[str]:
    """Every entry of every legend of a chart (a gradient legend counts by its title)."""
    return [e for lg in fig["legends"] for e in lg["entries"] or [lg["title"] or lg["label"]]]


def chart_keys(page) -> list[str]:
    """The keys of the charts the page shows."""
    return page.evaluate("""() => [...document.querySelectorAll('.vega-embed svg.marks')].map(svg => {
      const h = svg.closest('[class*="st-key-"]'); const m = h && h.className.match(/st-key-(\\S+)/);
      return m ? m[1] : null; }).filter(k => k)""")


def assert_legible(page) -> list[str]:
    """Every chart on the page says what its series are: a legend, or every series it draws named by a text in
    the plot or a label on an axis (a lane, a phase); a lower panel by the legend of the panel above for the
    marks it shares with it. Returns the charts checked."""
    keys = chart_keys(page)
    assert keys
    for key in keys:
        fig = figure(page, key)
        if legend_entries(fig):
            continue
        labels = set(fig["texts"]) | {t["text"] for a in fig["ticks"] for t in a["labels"]}
        shown = {name for name, marks in fig["series"].items() if name and any(m["role"] != "text mark" for m in marks)}
        unnamed = {name for name in shown if not any(label and label in name for label in labels)}
        if key in LOWER_PANELS:
            assert legend_entries(figure(page, LOWER_PANELS[key])), key
            unnamed = {name for name in unnamed if not all(m["role"] == "point" for m in fig["series"][name])}
        assert not unnamed, (key, unnamed, labels)
    return keys


def x_ticks(fig: dict) -> dict[str, float]:
    """The x axis's tick labels and their x centres on the page."""
    return {t["text"]: t["x"] for a in fig["ticks"] if a["axis"].startswith("X-axis") for t in a["labels"]}


def assert_stacked_panels_aligned(page) -> None:
    """Each pair of stacked panels on the page: the same x range (the axes' descriptions) and the same x positions
    (each tick label within 1.5 px of the one above it)."""
    keys = set(chart_keys(page))
    pairs = [pair for pair in STACKED if set(pair) <= keys]
    for up, down in pairs:
        a, b = figure(page, up), figure(page, down)
        xa = next(x for x in a["axes"] if x.startswith("X-axis"))
        xb = next(x for x in b["axes"] if x.startswith("X-axis"))
        assert xa.split(" titled")[1].split("'")[2:] == xb.split(" titled")[1].split("'")[2:], (xa, xb)  # range, scale
        ta, tb = x_ticks(a), x_ticks(b)
        assert ta.keys() == tb.keys() and all(abs(ta[k] - tb[k]) <= 1.5 for k in ta), (up, ta, tb)


def axis(fig: dict, which: str) -> str:
    """The scale type of the first axis `which` ('X' or 'Y') as the chart describes it: linear, log ..."""
    desc = next(a for a in fig["axes"] if a.startswith(f"{which}-axis"))
    return desc.split(" for a ")[1].split(" scale")[0]


def click_mark(page, key: str, series: str, dy: float = 0, **fields) -> dict:
    """Click the centre of a mark of `series` whose hover fields hold `fields`; returns its fields."""
    page.locator(f".st-key-{key}").scroll_into_view_if_needed()
    time.sleep(0.3)
    m = next(m for m in figure(page, key)["series"][series] if m["role"] != "text mark"
             and all(m.get(k) == str(v) for k, v in fields.items()))
    page.mouse.move(m["x"], m["y"] + dy)
    page.mouse.click(m["x"], m["y"] + dy)
    settle(page)
    return m


def changes(page, key: str, action) -> None:
    """`action` redraws chart `key` with other data (its fingerprint changes)."""
    before = bb.fingerprint(page, key)
    action()
    page.wait_for_function(f"b => ({bb.FINGERPRINT})({json.dumps(key)}) !== b", arg=before, polling="raf",
                           timeout=60_000)
    bb.wait_idle(page)
    assert_no_errors(page)


def value(page, key: str) -> str:
    return page.locator(f".st-key-{key} input").first.input_value()


def field_disabled(page, key: str) -> bool:
    return page.locator(f".st-key-{key} input").first.is_disabled()


def metric(page, label: str) -> str:
    return page.locator('[data-testid="stMetric"]').filter(has_text=label).locator(
        '[data-testid="stMetricValue"]').first.inner_text()


def downloads(page) -> dict[str, bytes]:
    """Every download button of the page clicked one after another, without waiting for the files, then
    each file read back: {file name: content}. The buttons sit in download menus (popovers, mounted when
    opened): each menu is opened, its buttons clicked, and closed again."""
    menus = page.locator('[data-testid="stPopover"]').filter(has_text="Download")
    assert menus.count() >= 1
    assert page.locator('[data-testid="stDownloadButton"]').count() == 0  # none drawn before a menu opens
    got, n = [], 0
    listener = lambda d: got.append(d)  # noqa: E731  (playwright takes a Python function)
    page.on("download", listener)
    for m in range(menus.count()):
        buttons = page.locator('[data-testid="stPopoverBody"] [data-testid="stDownloadButton"] button')
        open_menu(page, menus.nth(m).locator('[data-testid="stPopoverButton"]'), buttons)
        for i in range(buttons.count()):
            buttons.nth(i).click()
            n += 1
        close_menu(page, buttons)
    assert n >= 2
    deadline = time.monotonic() + 90
    while len(got) < n and time.monotonic() < deadline:
        page.wait_for_timeout(200)
    page.remove_listener("download", listener)
    assert len(got) == n, f"{len(got)} of {n} downloads arrived"
    files = {}
    for d in got:
        assert d.failure() is None, (d.suggested_filename, d.failure())
        data = Path(d.path()).read_bytes()
        assert data, d.suggested_filename
        files.setdefault(d.suggested_filename, data)
    return files


def read_back(files: dict[str, bytes]) -> dict:
    """Each CSV as a table, each JSON as data (a file that does not parse fails the test)."""
    import pandas as pd
    out = {}
    for name, data in files.items():
        out[name] = json.loads(data) if name.endswith(".json") else pd.read_csv(io.BytesIO(data))
        assert len(out[name]), name
    return out


def screenshot(page, name: str) -> None:
    """The whole view at 1400 px width (the app scrolls inside its own container: grow the viewport)."""
    h = page.evaluate("() => document.querySelector('[data-testid=\"stMain\"]').scrollHeight")
    page.set_viewport_size({"width": 1400, "height": min(max(h + 50, 1000), 12000)})
    time.sleep(0.5)
    bb.wait_idle(page)
    page.screenshot(path=str(OUT / f"{name}.png"), full_page=True)
    page.set_viewport_size({"width": 1400, "height": 1000})
    assert (OUT / f"{name}.png").stat().st_size > 10_000


def number(text: str) -> float:
    return float(re.sub(r"[^0-9.eE+-]", "", text.split()[0].replace(",", "")))


# ----- the seven views, every control --------------------------------------------------------------

def test_compare_every_control_upload_and_downloads(page, tmp_path):
    assert_no_errors(page)
    assert page.locator('[data-testid="stAppDeployButton"]').count() == 0  # no Deploy button
    screenshot(page, "compare")
    # the legend says which colour is which platform, what the line and the markers are
    entries = legend_entries(figure(page, "cmp_chart"))
    assert any(e.startswith("A: tpu-v7") for e in entries) and any(e.startswith("B: gb200") for e in entries)
    assert {"predicted", "published"} <= set(entries)
    assert set(assert_legible(page)) == {"cmp_chart", "cmp_ratio"}
    assert_stacked_panels_aligned(page)
    published = {m["d"] for name, marks in figure(page, "cmp_chart")["series"].items()
                 if name and "published" in name for m in marks}
    assert len(published) == 1  # one marker for every published point, whichever platform
    ratio = figure(page, "cmp_ratio")
    ratios = {name: marks for name, marks in ratio["series"].items() if name and "platform" in name}
    assert {name.rsplit("(", 1)[1] for name in ratios} == {"platform A)", "platform B)"}  # both published sets
    assert all(0.5 < float(m["predicted / measured"]) < 1.5 for marks in ratios.values() for m in marks)
    assert any("band" in t for t in ratio["texts"])
    changes(page, "cmp_chart", lambda: type_in(page, "cmp_batches", "1, 2, 4, 8"))
    changes(page, "cmp_chart", lambda: type_in(page, "cmp_context", 8192))
    assert "Not a reference for platform A" in page.inner_text("body")  # the published runs are at 4096
    type_in(page, "cmp_context", 4096)
    changes(page, "cmp_chart", lambda: radio(page, "cmp_spec", "both"))
    assert "predicted, spec decode" in legend_entries(figure(page, "cmp_chart"))  # dashed: named
    changes(page, "cmp_chart", lambda: toggle(page, "cmp_logy"))
    assert axis(figure(page, "cmp_chart"), "Y") == "log"
    assert_stacked_panels_aligned(page)
    # the published GB200 runs name their serving engine and KV cache format: another one is no reference
    # each platform's serving engine, KV cache and steps per call are in its popover (mounted when opened)
    assert page.locator(".st-key-cmp_B_serving").count() == 0
    in_menu(page, "cmp_B_kernels_menu", lambda: changes(page, "cmp_chart", lambda: pick(page, "cmp_B_serving", "generic")))
    assert "differs in serving engine (yours generic, measured vllm)" in page.inner_text("body")
    in_menu(page, "cmp_B_kernels_menu", lambda: changes(page, "cmp_chart", lambda: pick(page, "cmp_B_kv", "model's")))
    assert "generic engine, KV model's" in page.locator(".st-key-cmp_B_kernels_menu").inner_text()  # the label says
    in_menu(page, "cmp_A_kernels_menu", lambda: changes(page, "cmp_chart", lambda: pick(page, "cmp_A_kv", "fp8-kv")))
    assert "Not a reference for platform A" in page.inner_text("body")
    in_menu(page, "cmp_A_kernels_menu", lambda: changes(page, "cmp_chart", lambda: pick(page, "cmp_A_kv", "model's")))
    for tag, layout in (("A", {"devices": 64, "ep": 16, "tp": 16}), ("B", {"devices": 32, "ep": 32, "tp": 8})):
        # GB200's per-call cost is nil (a CUDA graph per step): there steps per call change only the command
        redraw = (lambda act: changes(page, "cmp_chart", act)) if tag == "A" else (lambda act: act())
        in_menu(page, f"cmp_{tag}_kernels_menu", lambda: (
            redraw(lambda: type_in(page, f"cmp_{tag}_steps_per_call", 2)),
            redraw(lambda: type_in(page, f"cmp_{tag}_spec_steps_per_call", 2))))
        assert page.inner_text("body").count("--steps-per-call 2") >= (1 if tag == "A" else 2)
        for field, v in layout.items():  # layouts that run: every change redraws the curves
            changes(page, "cmp_chart", lambda: type_in(page, f"cmp_{tag}_{field}", v))
        changes(page, "cmp_chart", lambda: radio(page, f"cmp_{tag}_engine", "multikernel" if tag == "A" else "megakernel"))
    changes(page, "cmp_chart", lambda: pick(page, "cmp_B_hw", "h100"))
    changes(page, "cmp_chart", lambda: pick(page, "cmp_A_hw", "tpu-v6e"))
    changes(page, "cmp_chart", lambda: pick(page, "cmp_model", "deepseek-v3"))
    upload_measurements(page, tmp_path, "model,hardware,engine,devices,tp,ep,steps_per_call,batch,tokens_per_s\n"
                        "deepseek-v3,tpu-v6e,multikernel,64,16,16,2,1,100\n", 1)
    assert_legible(page)
    assert_stacked_panels_aligned(page)  # the measured point at batch 1 only: the ratio panel keeps 1 to 8
    expand(page, "cmp_errors_exp")
    expand(page, "cmp_pred_exp")
    assert table_shown(page, "cmp_errors_exp") and table_shown(page, "cmp_pred_exp")
    assert_no_errors(page)
    files = read_back(downloads(page))
    errs = files["compare_errors.csv"]
    assert list(errs["measured_tokens_per_s"]) == [100] and errs["source"].item() == "your upload: bench.csv"
    assert files["compare_errors.json"]["rows"][0]["measured_tokens_per_s"] == 100
    assert set(files["compare_predicted.csv"]["batch"]) == {1, 2, 4, 8}


def test_whatif_every_control_tab_click_and_downloads(page):
    view(page, "What-if", "wi_breakdown")
    assert_no_errors(page)
    screenshot(page, "whatif")
    assert metric(page, "measured tokens/s") == "249"
    assert "↓" in page.locator('[data-testid="stMetricDelta"]').first.inner_text() or \
        page.locator('[data-testid="stMetricDelta"] svg').count()  # an arrow for the negative error
    for key, v in (("wi_batch", 2), ("wi_context", 8192), ("wi_steps", 1), ("wi_tp", 16), ("wi_ep", 16),
                   ("wi_devices", 64)):  # layouts that run: each change redraws the chart
        changes(page, "wi_breakdown", lambda: type_in(page, key, v))
    assert metric(page, "measured tokens/s") == "none"
    assert "Nearest measurement" in page.inner_text("body")
    changes(page, "wi_breakdown", lambda: click(page, "wi_meas_btn"))  # the nearest measurement's settings
    assert metric(page, "measured tokens/s") == "392" and value(page, "wi_ep") == "8"
    changes(page, "wi_breakdown", lambda: radio(page, "wi_engine", "multikernel"))
    for key in ("wi_prefetch", "wi_slots", "wi_vmem"):  # megakernel settings: off on the multi-kernel engine
        assert field_disabled(page, key)
    changes(page, "wi_breakdown", lambda: radio(page, "wi_engine", "megakernel"))
    assert not field_disabled(page, "wi_prefetch")
    changes(page, "wi_breakdown", lambda: type_in(page, "wi_prefetch", 16))
    changes(page, "wi_breakdown", lambda: type_in(page, "wi_slots", 4))
    type_in(page, "wi_vmem", 48)  # with the ring and slots fixed, a larger buffer changes no time: only the command
    assert "--vmem-mib 48" in page.inner_text("body")
    changes(page, "wi_breakdown", lambda: toggle(page, "wi_spec"))
    changes(page, "wi_breakdown", lambda: type_in(page, "wi_draft", 3))
    before = metric(page, "tokens/s (predicted)")
    slide(page, "wi_acc", -2)  # fewer tokens per step, the same step: only the tokens/s change
    page.wait_for_function("b => !document.body.innerText.includes(b)", arg=f"\n{before}\n")
    assert number(metric(page, "tokens/s (predicted)")) < number(before)
    for key, v in (("wi_tp", 2), ("wi_ep", 2), ("wi_devices", 2)):  # Kimi K3 does not fit there: stale meanwhile
        type_in(page, key, v)
    changes(page, "wi_breakdown", lambda: pick(page, "wi_model", "kimi-k3-mini"))
    changes(page, "wi_breakdown", lambda: pick(page, "wi_hw", "gb200"))  # a GPU serving engine's kernels
    changes(page, "wi_breakdown", lambda: radio(page, "wi_engine", "multikernel"))
    changes(page, "wi_breakdown", lambda: pick(page, "wi_serving", "vllm"))
    changes(page, "wi_breakdown", lambda: pick(page, "wi_kv", "fp8-kv"))
    changes(page, "wi_breakdown", lambda: pick(page, "wi_serving", "generic"))
    changes(page, "wi_breakdown", lambda: radio(page, "wi_engine", "megakernel"))
    changes(page, "wi_breakdown", lambda: pick(page, "wi_hw", "tpu-v6e"))
    for key in ("wi_prefetch", "wi_slots", "wi_vmem"):
        type_in(page, key, "")
    toggle(page, "wi_spec")
    assert_no_errors(page)
    tab(page, "wi_tab", "Ring x expert slots", "wi_heat_pick")
    assert_legible(page)
    for key in ("wi_sweep_measured", "wi_slots_measured"):   # the chip's depth and slot sweeps beside the model's
        bb.wait_chart(page, key)
        entries = legend_entries(figure(page, key))
        assert any(e.endswith(", measured") for e in entries) and any(e.endswith(", predicted") for e in entries)
    changes(page, "wi_heat_pick", lambda: radio(page, "wi_heat_z", "step time (ms)"))
    best = click_mark(page, "wi_heat_pick", "best")  # a click on the best cell puts its ring and slots in the fields
    page.wait_for_function("v => document.querySelector('.st-key-wi_slots input').value === v", arg=best["slots"])
    assert value(page, "wi_prefetch") == best["ring (MiB)"] and value(page, "wi_slots") == best["slots"]
    bb.wait_chart(page, "wi_heat_pick")
    (cur,) = [m for m in figure(page, "wi_heat_pick")["series"]["current"] if m["role"] == "point"]
    assert (cur["ring (MiB)"], cur["slots"]) == (best["ring (MiB)"], best["slots"])
    other = next(m for m in figure(page, "wi_heat_pick")["series"]["cells"] if m["slots"] != best["slots"])
    where = {"ring (MiB)": other["ring (MiB)"], "slots": other["slots"]}
    click_mark(page, "wi_heat_pick", "cells", dy=8, **where)  # any cell: its ring and slots in the fields
    page.wait_for_function("v => document.querySelector('.st-key-wi_slots input').value === v", arg=other["slots"])
    assert value(page, "wi_prefetch") == other["ring (MiB)"]
    assert_legible(page)
    tab(page, "wi_tab", "Prefetch depth", "wi_prefetch_chart")
    bb.wait_chart(page, "wi_prefetch_causes")
    causes = {name for name, marks in figure(page, "wi_prefetch_causes")["series"].items() if name}
    assert causes and not any("tokens" in c for c in causes)  # times by cause, not tokens/s
    assert max(float(m["ms"]) for marks in figure(page, "wi_prefetch_causes")["series"].values() for m in marks) < 100
    assert_legible(page)
    assert_stacked_panels_aligned(page)
    changes(page, "wi_prefetch_chart", lambda: toggle(page, "wi_pf_logx"))
    assert axis(figure(page, "wi_prefetch_chart"), "X") == axis(figure(page, "wi_prefetch_causes"), "X") == "log"
    assert_stacked_panels_aligned(page)
    tab(page, "wi_tab", "Timeline", "wi_timeline")
    assert_legible(page)
    drawn = figure(page, "wi_timeline")
    names = {m["what"].split(" (layer")[0] for marks in drawn["series"].values() for m in marks if m["role"] == "bar"}
    assert ("q_proj" in names or "attn_norm" in names) and set(drawn["texts"]) <= names  # op names, on the bars that fit
    key = page.locator("[class*='st-key-wi_layers_']").first.get_attribute("class").split("st-key-")[1].split()[0]
    changes(page, "wi_timeline", lambda: slide(page, key, 3, thumb=1))
    tab(page, "wi_tab", "Roofline", "wi_roofline")
    assert_legible(page)
    expand(page, "wi_layers_exp")
    assert table_shown(page, "wi_layers_exp")
    assert_no_errors(page)
    files = downloads(page)
    assert {"whatif_layers.csv", "whatif_prediction.csv", "whatif_prediction.json"} <= set(files)
    data = read_back(files)
    assert data["whatif_prediction.csv"]["tokens_per_s"].item() == pytest.approx(
        number(metric(page, "tokens/s (predicted)")), abs=0.5)
    for t in ("Step breakdown", "Ring x expert slots", "Prefetch depth", "Timeline"):
        tab(page, "wi_tab", t)
        data.update(read_back(downloads(page)))
    assert {"whatif_breakdown.csv", "whatif_ring_slots.json", "whatif_prefetch_sweep.csv", "whatif_events.csv"} <= set(data)
    assert "traceEvents" in data["whatif_timeline.trace.json"]  # Perfetto / Chrome trace JSON
    heat = data["whatif_ring_slots.csv"]
    assert heat["tokens_per_s"].max() == pytest.approx(
        max(r["tokens_per_s"] for r in data["whatif_ring_slots.json"]["rows"] if r["tokens_per_s"]))


def test_explain_every_control_bar_click_and_downloads(page):
    view(page, "What-if", "wi_breakdown")
    step = metric(page, "step time")
    view(page, "Explain", "ex_gantt")
    assert_no_errors(page)
    screenshot(page, "explain")
    assert f"step time: {step}" in page.inner_text("body")  # What-if's deployment, What-if's step
    assert set(assert_legible(page)) == {"ex_layers_pick", "ex_gantt"}
    assert page.get_by_text("perfmodel explain").count() >= 1
    changes(page, "ex_gantt", lambda: click_mark(page, "ex_layers_pick", "compute", dy=3, layer=4))
    assert value(page, "ex_layer") == "4"
    changes(page, "ex_gantt", lambda: type_in(page, "ex_layer", 2))
    changes(page, "ex_layers_pick", lambda: type_in(page, "ex_batch", 4))
    in_menu(page, "ex_more_menu", lambda: changes(page, "ex_layers_pick", lambda: type_in(page, "ex_steps", 1)))
    assert "1 steps/call" in page.locator(".st-key-ex_more_menu").inner_text()  # the popover names its values
    changes(page, "ex_layers_pick", lambda: click(page, "ex_use_wi_btn"))  # What-if's deployment again
    assert value(page, "ex_batch") == "1" and f"step time: {step}" in page.inner_text("body")
    changes(page, "ex_layers_pick", lambda: radio(page, "ex_engine", "multikernel"))
    changes(page, "ex_layers_pick", lambda: pick(page, "ex_hw", "gb200"))
    for key, v in (("ex_tp", 2), ("ex_ep", 2), ("ex_devices", 2)):  # Kimi K3 does not fit there: a message meanwhile
        type_in(page, key, v)
    changes(page, "ex_layers_pick", lambda: pick(page, "ex_model", "kimi-k3-mini"))
    expand(page, "ex_ops_exp")
    assert table_shown(page, "ex_ops_exp")
    assert_no_errors(page)
    data = read_back(downloads(page))
    out = data["explain_layer2_terms.json"]
    assert out["explain"]["layer"] == 2 and len(out["rows"]) == len(data["explain_layer2_terms.csv"])
    assert {"op", "term", "mechanism"} <= set(data["explain_layer2_terms.csv"].columns)


def test_design_search_every_control_upload_and_downloads(page, tmp_path):
    view(page, "Design search", "ds_pareto")
    assert_no_errors(page)
    screenshot(page, "design")
    assert assert_legible(page) == ["ds_pareto"]
    for key, option in (("ds_batch", "128"), ("ds_context", "16384"), ("ds_prefetch_mib", "48"),
                        ("ds_expert_slots", "8"), ("ds_vmem_mib", "96")):
        page.locator(f".st-key-{key} input").click()  # the field, not a chosen value's remove button
        page.get_by_role("option", name=option, exact=True).click()
        page.keyboard.press("Escape")
    page.locator(".st-key-ds_hw").click()
    page.get_by_role("option", name="tpu-v7", exact=True).click()
    page.locator(".st-key-ds_model").click()
    page.get_by_role("option", name="kimi-k3", exact=True).click()
    def fill(*fields):
        for key, v in fields:
            f = page.locator(f".st-key-{key} input")
            f.fill(str(v))
            f.press("Tab")

    fill(("ds_devices", 32), ("ds_tp", 32), ("ds_ep", 8))
    page.locator(".st-key-ds_engine").get_by_text("megakernel", exact=True).click()
    page.locator(".st-key-ds_kind").get_by_text("random", exact=True).click()

    def ranking():  # in a popover, closed again before the sweep runs: the form keeps what was typed
        fill(("ds_samples", 30), ("ds_seed", 1), ("ds_top", 5))
        page.locator(".st-key-ds_objective").click()
        page.get_by_role("option", name="step_s", exact=True).click()
    in_menu(page, "ds_rank_menu", ranking)
    changes(page, "ds_pareto", lambda: (page.get_by_role("button", name="Run sweep").click(), settle(page)))
    expand(page, "ds_file_exp")  # the sweep file, on demand (on a loaded machine its rerun may start late)
    page.wait_for_function("t => document.body.innerText.includes(t)", arg="samples = 30", timeout=30_000)
    expand(page, "ds_rows_exp")  # the rows, a sortable table, on demand
    radio(page, "ds_rows", "all")
    assert table_shown(page, "ds_rows_exp")
    assert_no_errors(page)
    data = read_back(downloads(page))
    rows = data["design_search.csv"]
    assert len(rows) == 30 and data["design_search.json"]["objective"] == "step_s"
    path = tmp_path / "rows.csv"
    rows.to_csv(path, index=False)
    radio(page, "ds_source", "Open a results file")
    upload(page, "ds_upload", path)
    bb.wait_chart(page, "ds_pareto")
    bb.wait_idle(page)
    assert_no_errors(page)  # an upload once broke the view until a reload
    pick(page, "ds_file_objective", "tokens_per_s")
    type_in(page, "ds_file_top", 3)
    assert_no_errors(page)
    view(page, "Compare", "cmp_chart")
    view(page, "Design search")
    assert_no_errors(page)


def annotated(page, text: str) -> None:
    """Wait until the Serving chart carries an annotation containing `text` (a target line's label)."""
    page.wait_for_function("""t => [...document.querySelectorAll('[class*="st-key-sv_"] svg.marks g.mark-text text')]
      .some(e => e.textContent.includes(t))""", arg=text, timeout=60_000, polling=100)


def test_serving_every_control_and_downloads(page):
    view(page, "Serving", "sv_chart")
    assert_no_errors(page)
    screenshot(page, "serving")
    ttft, tpot = figure(page, "sv_chart"), figure(page, "sv_tpot_chart")
    curves = {name for fig in (ttft, tpot) for name, marks in fig["series"].items()
              if any(m["role"] == "point" for m in marks)}
    assert curves == {"TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90"}
    assert {"p50", "p90"} <= set(legend_entries(ttft)) and {"p50", "p90"} <= set(tpot["texts"])  # named in both
    assert set(assert_legible(page)) == {"sv_chart", "sv_tpot_chart"}
    assert_stacked_panels_aligned(page)
    assert any(t.startswith("highest load meeting both") for t in ttft["texts"])
    assert "--serving-engine vllm --kv-cache fp8-kv" in page.inner_text("body")  # the published GB200 deployment
    assert 'perfmodel serve --model kimi-k3' in page.inner_text("body") and '--rate "$load"' in page.inner_text("body")
    # the targets and their percentile: the lines move, nothing is simulated again
    type_in(page, "sv_ttft", 0.12)
    annotated(page, "TTFT target 0.12 s (p90)")
    type_in(page, "sv_tpot", 15)
    annotated(page, "TPOT target 15 ms (p90)")
    radio(page, "sv_pct", "p50")
    annotated(page, "TPOT target 15 ms (p50)")
    for key, v in (("sv_requests", 60), ("sv_input", 512), ("sv_output", 128), ("sv_seed", 1)):  # in a popover
        in_menu(page, "sv_traffic_menu", lambda: changes(page, "sv_chart", lambda: type_in(page, key, v)))
    assert page.locator(".st-key-sv_traffic_menu").inner_text().startswith(
        "60 requests per load, 512 prompt / 128 output tokens, seed 1")
    changes(page, "sv_chart", lambda: type_in(page, "sv_loads", "0.5, 2, 8"))
    p50 = [m for m in figure(page, "sv_chart")["series"]["TTFT p50"] if m["role"] == "point"]
    assert [m["offered load (Poisson arrivals, requests/s)"] for m in p50] == ["0.5", "2", "8"]
    assert_stacked_panels_aligned(page)
    in_menu(page, "sv_kernels_menu", lambda: (changes(page, "sv_chart", lambda: pick(page, "sv_kv", "model's")),
                                              changes(page, "sv_chart", lambda: pick(page, "sv_serving", "generic"))))
    for key, v in (("sv_ep", 16), ("sv_tp", 8), ("sv_devices", 32)):  # layouts that run
        changes(page, "sv_chart", lambda: type_in(page, key, v))
    changes(page, "sv_chart", lambda: radio(page, "sv_arrivals", "concurrency (clients)"))
    assert value(page, "sv_loads") == "1, 2, 4, 8, 16, 32"
    changes(page, "sv_chart", lambda: pick(page, "sv_hw", "tpu-v7"))
    changes(page, "sv_chart", lambda: radio(page, "sv_engine", "megakernel"))
    pick(page, "sv_model", "kimi-k3-mini")  # 2 KDA heads: tp 8 cannot run, a message
    page.get_by_text("This deployment cannot serve").wait_for()
    changes(page, "sv_chart", lambda: type_in(page, "sv_tp", 2))
    expand(page, "sv_table_exp")
    assert table_shown(page, "sv_table_exp")
    assert_no_errors(page)
    files = read_back(downloads(page))
    curve = files["serving_curve.csv"]
    assert list(curve["load"]) == [1, 2, 4, 8, 16, 32] and (curve["ttft_p90_s"] >= curve["ttft_p50_s"]).all()
    meta = files["serving_curve.json"]
    assert meta["arrivals"] == "concurrency" and meta["targets"] == {"ttft_s": 0.12, "tpot_s": 0.015, "percentile": "p50"}
    assert [r["load"] for r in meta["rows"]] == [1, 2, 4, 8, 16, 32]


def test_validation_every_control_uploads_path_and_downloads(page, tmp_path):
    view(page, "Validation", "val_host_chart")
    assert_no_errors(page)
    screenshot(page, "validation")
    assert page.get_by_text("no trace validation yet").count() == 1
    assert {"y = x (exact)", "+-25% (per-layer target)"} <= set(figure(page, "val_host_chart")["series"])
    assert "y = x (exact)" in legend_entries(figure(page, "val_host_chart"))
    body = page.inner_text("body")
    assert "this machine" not in body and "{'start'" not in body and "/tmp/" not in body  # the file's machine, plainly
    in_menu(page, "val_prov_menu", lambda: page.get_by_text("load average (1 min):").wait_for())
    page.locator(".st-key-val_run").click()
    page.keyboard.press("ArrowDown")  # the next run
    page.keyboard.press("Enter")
    settle(page)
    expand(page, "val_host_bars_exp")
    bb.wait_chart(page, "val_host_layers")
    expand(page, "val_host_table_exp")
    assert table_shown(page, "val_host_table_exp")
    data = read_back(downloads(page))
    assert {"host_validation_runs.csv", "validation_val_host.csv", "validation_val_host.json"} <= set(data)
    assert data["validation_val_host.json"]["mape"] == pytest.approx(
        data["validation_val_host.csv"]["abs_error"].mean())
    expand(page, "val_gpu_exp")  # the H200 runs, on demand: another run picked, its layers drawn
    bb.wait_chart(page, "val_gpu_chart")
    assert page.get_by_text("Why the step error is").count() == 1  # the H200's step error comes with its why
    page.locator(".st-key-val_gpu_run").click()
    page.keyboard.press("ArrowDown")
    page.keyboard.press("Enter")
    settle(page)
    bb.wait_chart(page, "val_gpu_chart")
    assert_no_errors(page)
    expand(page, "val_profile_exp")  # the real megakernel's phase profile, on demand
    for kernel in ("final", "first"):
        bb.wait_chart(page, f"val_profile_{kernel}")
    assert_legible(page)
    expand(page, "val_tpu_exp")  # this project's megakernel on a TPU v5e: drawn from the committed JSON
    bb.wait_chart(page, "val_tpu_chart")
    page.get_by_text("tpu_megakernel.json").first.wait_for()
    expand(page, "val_trace_exp")  # your trace: its inputs on demand
    pick(page, "val_hw", "tpu-v7")
    pick(page, "val_model", "kimi-k3-host-small")
    for key, v in (("val_batch", 2), ("val_context", 64)):
        f = page.locator(f".st-key-{key} input")
        f.fill(str(v))
        f.press("Enter")
        settle(page)
    pick(page, "val_mode", "compiled")
    pb = tmp_path / "run.xplane.pb"
    pb.write_bytes(b"garbage")
    upload(page, "val_upload", pb)
    page.locator(ERRORS).first.wait_for()
    msg = " ".join(errors(page))
    assert "your upload: run.xplane.pb" in msg and "/tmp" not in msg  # the file's name, not the server's copy
    page.locator(".st-key-val_upload [data-testid='stFileChipDeleteBtn']").first.click()
    settle(page)
    type_in(page, "val_path", "/etc")
    page.locator(ERRORS).first.wait_for()
    msg = " ".join(errors(page))
    assert "trace path='/etc'" in msg and "outside the directories this dashboard was opened on" in msg
    assert "--trace-root" not in msg and str(ROOT) not in msg  # neither the server's flags nor its paths


def test_models_every_control_uploads_and_downloads(page, tmp_path):
    view(page, "Models & hardware")
    assert_no_errors(page)
    screenshot(page, "models")
    pick(page, "mh_model", "kimi-k3-mini")
    pick(page, "mh_hw_pick", "gb200")
    names = []
    for layers in (4, 8):  # two files named config.json: both stay, under names of their own
        f = tmp_path / str(layers) / "config.json"
        f.parent.mkdir()
        f.write_text(json.dumps({**HF_CONFIG, "num_hidden_layers": layers}))
        upload(page, "mh_model_upload", f)
        ok = page.locator('[data-testid="stAlertContentSuccess"]')
        ok.filter(has_text="config.json").wait_for()
        page.wait_for_timeout(500)  # the uploader's rerun replaces the previous message
        bb.wait_idle(page)
        names.append(ok.first.inner_text().split("as '")[1].split("'")[0])
    assert names[0] != names[1]
    hw = tmp_path / "my-chip.toml"
    hw.write_text((ROOT / "perfmodel/presets/hardware/tpu-v7.toml").read_text().replace('name = "tpu-v7"',
                                                                                        'name = "my-chip"'))
    upload(page, "mh_hw_upload", hw)
    page.locator('[data-testid="stAlertContentSuccess"]').filter(has_text="my-chip.toml").wait_for()
    assert_no_errors(page)
    data = read_back(downloads(page))
    assert {"model_presets.csv", "hardware_presets.csv", "hardware_gb200.csv", "model_kimi-k3-mini.json"} <= set(data)
    assert "kimi-k3" in set(data["model_presets.csv"]["model"])
    view(page, "What-if", "wi_breakdown")  # the uploads are choices there
    for key, v in (("wi_tp", 4), ("wi_ep", 4), ("wi_devices", 4)):  # a layout of the small upload
        type_in(page, key, v)
    changes(page, "wi_breakdown", lambda: pick(page, "wi_model", names[1]))
    assert "<path to your config.json or .toml>" in page.inner_text("body")  # the command names the file to give


# ----- defects a browser session found -----------------------------------------------------------

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
    assert "at most 0 MiB" not in msgs[0] and "not even one tile fits" in msgs[0]
    assert page.get_by_text("Nearest configurations that run").count() == 1
    assert figure(page, "wi_breakdown")["series"]  # the last good outputs stay
    tab(page, "wi_tab", "Prefetch depth")
    assert page.get_by_text("No prefetch depth fits").count() == 1  # the sweep stays: what fits
    page.get_by_role("button", name="Use this").first.click()
    settle(page)
    assert_no_errors(page)


def test_prefetch_sweep_and_vmem_mechanism(page):
    view(page, "What-if", "wi_breakdown")
    tab(page, "wi_tab", "Prefetch depth", "wi_prefetch_chart")
    assert "do not fit" not in " ".join(e.inner_text() for e in page.query_selector_all(
        '[data-testid="stAlertContentWarning"]'))  # nothing warns at the defaults
    assert {"current", "expert slots", "saturation"} <= set(figure(page, "wi_prefetch_chart")["series"])
    type_in(page, "wi_vmem", 1000000)
    page.get_by_text("500000 MiB it is").wait_for()
    assert "dma_concurrent_copies" in page.inner_text("body")  # the service that makes the bend
    (cur,) = [m for m in figure(page, "wi_prefetch_chart")["series"]["current"] if m["role"] == "point"]
    step = number(metric(page, "step time"))
    assert cur["prefetch (MiB)"] == "500000" and float(cur["step (ms)"]) == pytest.approx(step, rel=1e-3)
    # the axis is log: the toggle shown says so (on, and off limits), not the user's choice left off
    forced = page.locator(".st-key-wi_pf_logx_forced input")
    assert forced.is_checked() and forced.is_disabled() and page.locator(".st-key-wi_pf_logx").count() == 0
    assert axis(figure(page, "wi_prefetch_chart"), "X") == "log"


def test_ring_depth_of_part_of_a_tile_is_refused_beside_the_field(page):
    view(page, "What-if", "wi_breakdown")
    type_in(page, "wi_prefetch", 0.1)
    field_box = page.locator(".st-key-wi_prefetch").locator("xpath=..")
    assert "whole 4 MiB tiles" in field_box.inner_text() and "would run as 4 MiB" in field_box.inner_text()
    assert page.locator("[class*='st-key-stale_wi_bd']").count() == 1
    type_in(page, "wi_prefetch", "")
    assert_no_errors(page)


def test_headline_fits_a_small_window(page):
    """At 1280 x 720 every headline figure is whole (none cut to "3.872 ...")."""
    page.set_viewport_size({"width": 1280, "height": 720})
    view(page, "What-if", "wi_breakdown")
    values = page.locator('[data-testid="stMetricValue"]')
    values.nth(2).wait_for()  # the headline's three figures (drawn by the run that drew the chart: a late one)
    assert values.count() >= 3
    for i in range(values.count()):
        cut = values.nth(i).evaluate("e => [...e.querySelectorAll('*')].concat([e]).some(x => x.scrollWidth > "
                                     "x.clientWidth + 1)")
        assert not cut, values.nth(i).inner_text()
    assert "ms" in metric(page, "step time")
    page.set_viewport_size({"width": 1400, "height": 1000})


def test_measured_sources_log_axis_and_implausible_upload(page, tmp_path):
    def shapes() -> dict[str, str]:
        fig = figure(page, "cmp_chart")
        return {name: marks[0]["d"] for name, marks in fig["series"].items() if name and not name.endswith("predicted")}
    before = shapes()
    upload_measurements(page, tmp_path, "model,hardware,engine,devices,tp,ep,steps_per_call,batch,tokens_per_s\n"
                        "kimi-k3,tpu-v7,megakernel,32,32,8,64,16,1500\nkimi-k3,tpu-v7,megakernel,32,32,8,64,32,1e30\n", 2)
    fig = figure(page, "cmp_chart")
    measured = shapes()
    assert "your upload: bench.csv (platform A)" in measured
    assert "Inferact, 16x TPU v7, published (platform A)" in measured
    # a marker per kind of source, whatever else is plotted: the published ones keep theirs after an upload
    assert {k: v for k, v in measured.items() if "published" in k} == before
    assert measured["your upload: bench.csv (platform A)"] not in before.values()
    assert {"published", "your upload"} <= set(legend_entries(fig))
    assert max(float(m["aggregate decode tokens/s"]) for marks in fig["series"].values() for m in marks) < 1e5
    page.get_by_text("above 2x the chip's HBM roofline").first.wait_for(timeout=30_000)  # drawn after the chart
    assert "seed" not in page.inner_text("body").lower()


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
    assert [name for name in figure(page, "cmp_chart")["series"] if name.startswith("A:")]


# ----- local and offline (last: the other tests have used every view on this server) --------------

def test_upload_without_a_model_is_refused(page, tmp_path):
    csv = tmp_path / "nomodel.csv"
    csv.write_text("hardware,engine,devices,tp,ep,steps_per_call,batch,tokens_per_s\ntpu-v7,megakernel,32,32,8,64,16,1500\n")
    page.get_by_text("Load your own measurements (CSV)").click()
    upload(page, "cmp_upload", csv)
    page.get_by_text("has no model column").wait_for()
    bb.wait_idle(page)
    page.keyboard.press("Escape")
    assert not any("nomodel" in name for name in figure(page, "cmp_chart")["series"] if name)


def test_server_log_holds_no_warning(server, page):
    """After every view's sessions (a Design search results file left open and come back to among them): the
    server logged no widget-state warning and no traceback."""
    view(page, "Design search", "ds_pareto")
    view(page, "Compare", "cmp_chart")
    log = server["log"].read_text()
    assert "was created with a default value" not in log and "Traceback" not in log, log[-3000:]


def test_server_listens_on_loopback_and_nothing_leaves_the_machine(page, server):
    for name, chart in (("What-if", "wi_breakdown"), ("Explain", "ex_gantt"), ("Design search", "ds_pareto"),
                        ("Validation", "val_host_chart"), ("Models & hardware", None), ("Compare", "cmp_chart")):
        view(page, name, chart)
    hosts = {urlparse(u).hostname for u in page.requests if u.startswith(("http", "ws"))}
    assert hosts == {"localhost"}, hosts  # the page fetched nothing beyond this server
    assert server["listening"] and all(ipaddress.ip_address(a).is_loopback for a, _ in server["listening"]), \
        server["listening"]
    assert all(ipaddress.ip_address(a).is_loopback for a, _ in bb.listening(server["pid"]))
    seen = [json.loads(line) for line in server["audit"].read_text().splitlines()]
    assert any(e["event"] == "socket.bind" for e in seen)  # the hook saw the server's own sockets
    outside = [e for e in seen if not bb.local_address(e["event"], e["address"])]
    assert not outside, outside  # no connection, datagram or name lookup beyond this machine
