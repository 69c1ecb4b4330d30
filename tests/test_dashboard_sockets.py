"""The dashboard stays on this machine: its settings (localhost only, no usage statistics, no Deploy
button) and a real `streamlit run` whose sockets an audit hook records (no browser needed; the
browser test checks the same over whole sessions of every view)."""
from __future__ import annotations

import importlib.util
import ipaddress
import json
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_dashboard_browser",
                                               ROOT / "experiments" / "bench_dashboard_browser.py")
bb = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bb)


def test_settings_keep_the_app_local():
    cfg = tomllib.loads((ROOT / "dashboards" / ".streamlit" / "config.toml").read_text())
    assert cfg["server"]["address"] == "localhost" and cfg["server"]["headless"] is True
    assert cfg["browser"]["gatherUsageStats"] is False
    assert cfg["client"]["toolbarMode"] == "viewer"  # no Deploy button
    from perfmodel.cli.dashboard import command
    cmd = command(Path("app.py"), 8501)
    flags = dict(zip(cmd[5::2], cmd[6::2]))
    assert flags["--server.address"] == "localhost" and flags["--browser.gatherUsageStats"] == "false"


@pytest.mark.parametrize("event,address,local", [
    ("socket.connect", "('127.0.0.1', 8501)", True), ("socket.connect", "('::1', 8501, 0, 0)", True),
    ("socket.bind", "('127.0.0.1', 0)", True), ("socket.connect", "'/tmp/x.sock'", True),
    ("socket.getaddrinfo", "'localhost'", True), ("socket.getaddrinfo", "None", True),
    ("socket.connect", "('8.8.8.8', 1)", False), ("socket.sendto", "('10.0.0.1', 53)", False),
    ("socket.bind", "('0.0.0.0', 8501)", False), ("socket.getaddrinfo", "'checkip.amazonaws.com'", False),
    ("socket.connect", "not python", False)])
def test_audited_addresses_are_classified(event, address, local):
    assert bb.local_address(event, address) is local


def test_server_listens_on_loopback_and_reaches_nothing_outside(tmp_path):
    pytest.importorskip("streamlit")
    audit, info = tmp_path / "sockets.jsonl", {}
    with bb.serve(tmp_path / "streamlit.log", info=info, audit_log=audit) as url:
        with urllib.request.urlopen(url, timeout=30) as r:  # the page and its health check, as a browser asks
            assert r.status == 200
        time.sleep(1)
        listening = bb.listening(info["pid"])
    assert listening and all(ipaddress.ip_address(a).is_loopback for a, _ in listening), listening
    seen = [json.loads(line) for line in audit.read_text().splitlines()]
    assert any(e["event"] == "socket.bind" for e in seen)  # the hook saw the server's own socket
    outside = [e for e in seen if not bb.local_address(e["event"], e["address"])]
    assert not outside, outside


def test_page_load_cpu_counts_a_process_that_exited(monkeypatch):
    """A closed page's renderer exiting during the next load neither takes its whole past CPU off that
    load (as summing by kind did) nor hides what it used after the first snapshot: its parent's
    reaped-children time holds all it used. Snapshots: pid -> (kind, own CPU s, reaped children's s)."""
    c0 = {1: ("browser", 10.0, 0.0), 2: ("browser", 1.0, 0.0), 3: ("renderer", 2.0, 0.0)}
    # the page's new renderer used 1.5 s; pid 3 exited after 0.25 s more, reaped by pid 2
    c1 = {1: ("browser", 10.5, 0.0), 2: ("browser", 1.0, 2.25), 4: ("renderer", 1.5, 0.0)}
    monkeypatch.setattr(bb, "browser_processes", lambda: c1)
    got = bb.cpu_since(c0)
    assert got["renderer"] == pytest.approx(1.75) and got["browser"] == pytest.approx(0.5)
    assert sum(got.values()) == pytest.approx(2.25)
