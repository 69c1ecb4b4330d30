"""`perfmodel dashboard`: start the Streamlit app shipped with the package (the [dashboard] extra)."""
from __future__ import annotations

import importlib.util
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


def cmd_dashboard(a) -> dict:
    import streamlit  # noqa: F401  (the CLI turns a missing one into an install hint)
    app = app_path()
    rc = subprocess.call([sys.executable, "-m", "streamlit", "run", str(app), "--server.headless",
                          "true", "--server.port", str(a.port)])
    return {"app": str(app), "exit_status": rc}


def configure_dashboard(p) -> None:
    p.add_argument("--port", type=lambda t: integer(t, 1, 65535), default=8501)
    p.set_defaults(func=cmd_dashboard)
