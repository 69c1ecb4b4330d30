"""`perfmodel dashboard`: start the Streamlit app shipped with the package (the [dashboard] extra).

Local and offline: it listens on localhost only and makes no request of its own (no usage statistics,
no external-IP lookup; dashboards/.streamlit/config.toml says the same for `streamlit run`). A trace
path typed into the app must lie in the project's results or a --trace-root directory."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from perfmodel.cli.args import integer
from perfmodel.util.errors import SpecError


def app_path() -> Path:
    """dashboards/app.py of this checkout or of the installed wheel."""
    spec = importlib.util.find_spec("dashboards")
    app = Path(spec.origin).parent / "app.py" if spec and spec.origin else None
    if app is None or not app.exists():
        raise SpecError("dashboard", "dashboards/app.py", "not installed with this package")
    return app


# what `streamlit run` is told besides the app's own config file (which an installed copy reads too)
SERVER_FLAGS = ("--server.headless", "true", "--server.address", "localhost", "--browser.gatherUsageStats", "false",
                "--client.toolbarMode", "viewer")
TRACE_ROOT_ENV = "PERFMODEL_TRACE_ROOT"


def command(app: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "streamlit", "run", str(app), *SERVER_FLAGS, "--server.port", str(port)]


def cmd_dashboard(a) -> dict:
    import streamlit  # noqa: F401  (the CLI turns a missing one into an install hint)
    app = app_path()
    env = dict(os.environ)
    if a.trace_root:
        roots = [Path(r).expanduser().resolve() for r in a.trace_root]
        for r in roots:
            if not r.is_dir():
                raise SpecError("--trace-root", str(r), "is not a directory")
        env[TRACE_ROOT_ENV] = os.pathsep.join(map(str, roots))
    rc = subprocess.call(command(app, a.port), env=env)
    return {"app": str(app), "exit_status": rc}


def configure_dashboard(p) -> None:
    p.add_argument("--port", type=lambda t: integer(t, 1, 65535), default=8501)
    p.add_argument("--trace-root", action="append", default=[],
                   help="a directory whose traces the Validation view may open by path (repeatable; "
                        "default: ./traces of the repository)")
    p.set_defaults(func=cmd_dashboard)
