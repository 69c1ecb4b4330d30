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
