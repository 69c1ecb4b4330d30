"""Checks of the package's bundled data remembered across processes: content that passed a check
is not checked again, so a command line does not re-validate thousands of table rows it read
unchanged a moment ago (the GPU kernel tables: about 50 ms of a 190 ms command).

A marker per (content hash, check) lives in $XDG_CACHE_HOME/perfmodel/checked (default
~/.cache/perfmodel/checked); where that cannot be written, every process checks. A file whose
bytes change (a re-import rewrites it) is checked again on its next read.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Callable


def _marker(path: Path, what: str) -> Path | None:
    try:
        digest = hashlib.sha256(path.read_bytes() + b"|" + what.encode()).hexdigest()[:32]
    except OSError:
        return None
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "perfmodel" / "checked" / digest


def once(path: Path, what: str, check: Callable[[], None]) -> None:
    """Run `check` (which raises on bad data) unless `path`'s bytes passed check `what` before."""
    marker = _marker(path, what)
    if marker is not None and marker.exists():
        return
    check()
    if marker is not None:
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        except OSError:
            pass
