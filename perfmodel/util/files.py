"""Files at the boundary: read user files as checked text, write outputs atomically, and the
user's data directory (the default home of files perfmodel writes, never the package)."""
from __future__ import annotations

import csv
import io
import os
import tempfile
from pathlib import Path

from perfmodel.util.errors import SpecError, require

MAX_FILE_BYTES = 64 * 2**20   # a spec or config file; traces are read elsewhere


def check_path(field: str, path) -> Path:
    """`path` as a Path, if it could name a file (not empty, no NUL, not over-long)."""
    text = str(path)
    require(text != "", field, text, "empty path")
    require("\0" not in text, field, text, "path holds a NUL character")
    require(len(os.fsencode(text)) <= 4096, field, text[:64] + "...", "path longer than 4096 bytes")
    require(all(len(os.fsencode(p)) <= 255 for p in Path(text).parts), field, text[:64] + "...",
            "a path component is longer than 255 bytes")
    return Path(text)


def read_text(path, field: str = "file") -> str:
    """The UTF-8 text of a user file, or a SpecError naming the file and what is wrong."""
    p = check_path(field, path)
    try:
        with open(p, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except OSError as e:
        raise SpecError(field, str(p), e.strerror or type(e).__name__) from None
    require(len(data) <= MAX_FILE_BYTES, field, str(p), f"larger than {MAX_FILE_BYTES >> 20} MiB")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(field, str(p), f"not UTF-8 text (byte {data[e.start]:#04x} at offset "
                                       f"{e.start})") from None


def write_atomic(path, text: str, field: str = "--out", parents: bool = False) -> Path:
    """Write `text` to a temporary file beside `path`, then rename it over `path`: a reader
    sees the old file or the whole new one, never a part. `parents`: create missing directories."""
    p = check_path(field, path)
    if parents:
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SpecError(field, str(p), f"cannot create its directory: {e.strerror}") from None
    require(not p.is_dir(), field, str(p), "is a directory; give a file name")
    require(not p.exists() or p.is_file(), field, str(p), "exists and is not a regular file")
    parent = p.parent
    require(parent.is_dir(), field, str(p), f"directory {str(parent)!r} does not exist")
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{p.name[:200]}.", suffix=".tmp")
        os.chmod(tmp, p.stat().st_mode & 0o777 if p.exists() else 0o666 & ~_umask())
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
        tmp = None
    except OSError as e:
        raise SpecError(field, str(p), f"cannot write: {e.strerror or type(e).__name__}") from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return p


def write_csv(path, comments: list[str], header: list[str], rows, field: str = "--out") -> Path:
    """A CSV with its provenance as leading `# ` comment lines, written atomically (missing
    directories created)."""
    f = io.StringIO(newline="")
    f.writelines(f"# {c}\n" for c in comments)
    w = csv.writer(f)
    w.writerow(header)
    w.writerows(rows)
    return write_atomic(path, f.getvalue(), field, parents=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def user_data_dir() -> Path:
    """$XDG_DATA_HOME/perfmodel (default ~/.local/share/perfmodel): where perfmodel keeps what it
    measures or fits on this machine unless told otherwise."""
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "perfmodel"


def user_data_path(name: str) -> Path:
    """`name` in the user data directory (`write_atomic(..., parents=True)` creates it)."""
    return user_data_dir() / name


def host_hardware_file() -> Path:
    """Where `perfmodel hostbench` writes this machine's hardware file by default (and where
    `perfmodel validate` looks for it): the user data directory, never the package or a checkout."""
    return user_data_path("host-cpu.toml")
