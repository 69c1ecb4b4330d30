"""Checks of the package's bundled data remembered across processes: content that passed a check
is not checked again, so a command line does not re-validate thousands of table rows it read
unchanged a moment ago (the GPU kernel tables: about 50 ms of a 190 ms command); and what a
reader made of such content (`kept`: parsed and checked), so it is not parsed again either.

A file's bytes, as its reader read them, are named once (`content`: their length, CRC-32 and
Adler-32, by zlib: no OpenSSL to load), and a marker per (content, check) lives in
$XDG_CACHE_HOME/perfmodel/checked (default ~/.cache/perfmodel/checked), beside the kept forms;
where the cache cannot be written (or a caller names no content), every process checks. A file
whose bytes change (a re-import rewrites it) is checked again on its next read.
"""
from __future__ import annotations

import marshal
import os
import sys
import zlib
from functools import lru_cache
from pathlib import Path
from typing import Callable, TypeVar

from perfmodel.util.errors import SpecError
from perfmodel.util.files import write_atomic

T = TypeVar("T")


def content(data: bytes) -> str:
    """The name of a file's bytes, as its reader read them."""
    return f"{len(data):x}-{zlib.crc32(data):08x}-{zlib.adler32(data):08x}"


def _marker(content_id: str | None, what: str) -> str | None:
    """The marker's path, as a string (a command line asks for dozens; pathlib costs more than the stat)."""
    if content_id is None:
        return None
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        home = os.path.expanduser("~")
        if home.startswith("~"):   # no home directory to cache in
            return None
        base = os.path.join(home, ".cache")
    return os.path.join(base, "perfmodel", "checked", f"{content_id}-{zlib.crc32(what.encode()):08x}")


def known(content_id: str | None, what: str) -> bool:
    """Whether the content named `content_id` passed check `what` before."""
    marker = _marker(content_id, what)
    return marker is not None and os.path.exists(marker)


def remember(content_id: str | None, what: str) -> None:
    """Note that the content named `content_id` passed check `what` (nothing where the cache
    cannot be written)."""
    marker = _marker(content_id, what)
    if marker is not None:
        try:
            os.makedirs(os.path.dirname(marker), exist_ok=True)
            Path(marker).touch()
        except OSError:
            pass


def once(content_id: str | None, what: str, check: Callable[[], None]) -> None:
    """Run `check` (which raises on bad data) unless the content named `content_id` passed check
    `what` before."""
    if not known(content_id, what):
        check()
        remember(content_id, what)


def kept(content_id: str | None, what: str, make: Callable[[], T]) -> T:
    """`make()` (which reads the content named `content_id` and raises on bad data), or what it
    returned for that content before: its value (plain data: numbers, strings, bytes, lists,
    tuples, dicts) is kept in the cache by marshal, as Python keeps bytecode, with the name of the
    source of `make`'s module (a value an edited reader made is made again, in its place). Made in
    every process where the cache cannot be read or written, or a caller names no content."""
    path, source = _marker(content_id, f"kept {what}"), _source(make.__module__)
    if path is not None:
        try:
            with open(path, "rb") as f:
                made_by, value = marshal.loads(f.read())
            if made_by == source:
                return value
        except (OSError, EOFError, ValueError, TypeError):   # not kept yet, or unreadable: made again
            pass
    value = make()
    if path is not None:
        try:
            write_atomic(path, marshal.dumps((source, value)), "cache", parents=True)
        except (ValueError, SpecError):   # not plain data, or the cache cannot be written
            pass
    return value


@lru_cache(maxsize=None)
def _source(module: str) -> str:
    with open(sys.modules[module].__file__, "rb") as f:
        return content(f.read())
