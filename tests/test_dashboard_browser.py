"""The dashboard in a real browser: headless Chromium (Debian package) driven by Playwright.

Starts `streamlit run dashboards/app.py` on a free localhost port, loads the Compare and What-if
views, waits (bounded) for the Plotly charts, asserts that the page shows no error element and no
exception, and saves screenshots under test-output/dashboard/ (gitignored).
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "dashboards" / "app.py"
OUT = ROOT / "test-output" / "dashboard"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROME_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ERROR_SELECTORS = ['[data-testid="stException"]', '[data-testid="stAlertContentError"]']

pytestmark = pytest.mark.browser


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    if not Path(CHROMIUM).exists():
        pytest.skip("chromium is not installed (CI installs the Debian package: apt-get install -y chromium)")
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    port = free_port()
    OUT.mkdir(parents=True, exist_ok=True)
    log = open(OUT / "streamlit.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", str(APP), "--server.headless", "true",
         "--server.port", str(port), "--server.address", "127.0.0.1", "--browser.gatherUsageStats", "false",
         "--server.fileWatcherType", "none"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"streamlit did not start (see {OUT / 'streamlit.log'})")
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


def wait_for_charts(page, n: int, timeout_ms: int = 60_000) -> None:
    page.wait_for_function(
        "n => document.querySelectorAll('.js-plotly-plot .main-svg').length >= n", arg=n, timeout=timeout_ms)
    # the script has finished when Streamlit's status widget no longer says it is running
    page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')",
                           timeout=timeout_ms)


def assert_no_errors(page) -> None:
    for sel in ERROR_SELECTORS:
        found = page.query_selector_all(sel)
        assert not found, f"{sel}: {[e.inner_text()[:300] for e in found]}"
    assert "Traceback" not in page.inner_text("body")


def test_dashboard_in_headless_chromium(server):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROME_ARGS, timeout=60_000)
        try:
            page = browser.new_page(viewport={"width": 1500, "height": 3000})
            page.set_default_timeout(60_000)
            page.goto(server, wait_until="domcontentloaded")
            wait_for_charts(page, 1)
            page.get_by_text("Measured points: per-point error").wait_for()
            assert_no_errors(page)
            page.screenshot(path=str(OUT / "compare.png"), full_page=True)

            page.locator('[data-testid="stSidebar"]').get_by_text("What-if", exact=True).click()
            page.set_viewport_size({"width": 1500, "height": 4300})  # the page scrolls inside its own div
            wait_for_charts(page, 4)
            page.get_by_text("Roofline (per device, per layer)").wait_for()
            assert_no_errors(page)
            page.screenshot(path=str(OUT / "whatif.png"), full_page=True)

            page.locator('[data-testid="stSidebar"]').get_by_text("Models & hardware", exact=True).click()
            page.get_by_text("Hardware presets").wait_for()
            page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')")
            assert_no_errors(page)
            page.screenshot(path=str(OUT / "models.png"), full_page=True)

            page.locator('[data-testid="stSidebar"]').get_by_text("Validation", exact=True).click()
            page.get_by_text("Bundled host validation").wait_for()
            page.wait_for_function("() => !document.querySelector('[data-testid=\"stStatusWidget\"]')")
            assert_no_errors(page)
            page.screenshot(path=str(OUT / "validation.png"), full_page=True)
        finally:
            browser.close()
    for name in ("compare.png", "whatif.png", "models.png", "validation.png"):
        assert (OUT / name).stat().st_size > 10_000
