"""Checks of the package's bundled data remembered across processes: content that passed a check
is not checked again, so a command line does not re-validate thousands of table rows it read
unchanged a moment ago (the GPU kernel tables: about 50 ms of a 190 ms command).

A marker per (content, check) lives in $XDG_CACHE_HOME/perfmodel/checked (default
~/.cache/perfmodel/checked), named by the bytes' length, CRC-32 and Adler-32 (zlib: no OpenSSL
to load) and the check's name; where that cannot be written, every process checks. A file whose
bytes change (a re-import rewrites it) is checked again on its next read.
"""
from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Callable


def _marker(path: Path, what: str) -> Path | None:
    try:
        data = path.read_bytes()
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    except (OSError, RuntimeError):   # unreadable, or no home directory to cache in
        return None
    name = f"{len(data):x}-{zlib.crc32(data):08x}-{zlib.adler32(data):08x}-{zlib.crc32(what.encode()):08x}"
    return base / "perfmodel" / "checked" / name


def known(path: Path, what: str) -> bool:
    """Whether `path`'s bytes passed check `what` before."""
    marker = _marker(path, what)
    return marker is not None and marker.exists()


def remember(path: Path, what: str) -> None:
    """Note that `path`'s bytes passed check `what` (nothing where the cache cannot be written)."""
    marker = _marker(path, what)
    if marker is not None:
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        except OSError:
            pass


def once(path: Path, what: str, check: Callable[[], None]) -> None:
    """Run `check` (which raises on bad data) unless `path`'s bytes passed check `what` before."""
    if not known(path, what):
        check()
        remember(path, what)
