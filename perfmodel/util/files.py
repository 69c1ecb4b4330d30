"""Files at the boundary: read user files as checked text, write outputs whole or not at all, and
the user's data directory (the default home of files perfmodel writes, never the package).

Every output goes through `AtomicFile` (one file; `write_atomic`, `write_csv` for text) or
`write_all` (several files, all or none). The new content is written into an unnamed file in
the target's directory (Linux O_TMPFILE: nothing to clean up after any failure or signal, even
SIGKILL), fsynced, then linked into place by one rename: a reader sees the old file or the whole
new one. Over an existing file the unnamed file gets a hidden name for the rename
(`.NAME.<pid>.tmp`), and where O_TMPFILE is unsupported a hidden named temporary
(`.NAME.<pid>.<random>.tmp`) stands in; both are removed on every error path, and one left by a
process killed outright (SIGKILL) is removed by the next write of the same path (its process is
gone). A command's last output is committed with signals held (`commit(last=True)`): from then
on its work is whole and a signal ends nothing (perfmodel.util.interrupts).
"""
from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import signal
from pathlib import Path

from perfmodel.util import interrupts
from perfmodel.util.errors import SpecError, require

MAX_FILE_BYTES = 64 * 2**20   # a spec or config file; traces are read elsewhere


def check_path(field: str, path) -> Path:
    """`path` as a Path, if it could name a file (not empty, no NUL, not over-long)."""
    text = str(path)
    require(text != "", field, text, "empty path")
    require("\0" not in text, field, text, "path holds a NUL character")
    try:
        encoded = os.fsencode(text)
    except UnicodeError:
        raise SpecError(field, text, "cannot be encoded as a file name on this system") from None
    require(len(encoded) <= 4096, field, text[:64] + "...", "path longer than 4096 bytes")
    require(all(len(os.fsencode(p)) <= 255 for p in Path(text).parts), field, text[:64] + "...",
            "a path component is longer than 255 bytes")
    return Path(text)


MAX_WALK_ENTRIES = 100_000   # directory entries a search under a directory looks at
MAX_WALK_DEPTH = 8


def find_files(root, name: str, field: str) -> list[Path]:
    """The files called `name` under directory `root`, found by a bounded walk: at most
    MAX_WALK_ENTRIES entries, MAX_WALK_DEPTH levels down, symbolic links not followed; a
    directory it cannot read, or a tree beyond those bounds, is a SpecError naming `root`."""
    root = check_path(field, root)
    found, seen, stack = [], 0, [(root, 0)]
    while stack:
        d, depth = stack.pop()
        try:
            with os.scandir(d) as it:
                entries = list(it)
        except OSError as e:
            raise SpecError(field, str(root), f"cannot read {str(d)!r}: {e.strerror or type(e).__name__}") from None
        seen += len(entries)
        require(seen <= MAX_WALK_ENTRIES, field, str(root), f"more than {MAX_WALK_ENTRIES:,} entries under it; "
                "give the directory of the runs")
        for e in entries:
            try:
                if e.is_dir(follow_symlinks=False):
                    if depth < MAX_WALK_DEPTH:
                        stack.append((Path(e.path), depth + 1))
                elif e.name == name and e.is_file():
                    found.append(Path(e.path))
            except OSError:
                continue
    return sorted(found)


def read_bytes(path, field: str = "file", limit: int = MAX_FILE_BYTES) -> bytes:
    """The bytes of a user file (at most `limit`), or a SpecError naming the file and what is wrong."""
    p = check_path(field, path)
    try:
        with open(p, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise SpecError(field, str(p), e.strerror or type(e).__name__) from None
    require(len(data) <= limit, field, str(p), f"larger than {limit / 2**20:g} MiB")
    return data


def read_text(path, field: str = "file", limit: int = MAX_FILE_BYTES) -> str:
    """The UTF-8 text of a user file, or a SpecError naming the file and what is wrong."""
    return as_text(read_bytes(path, field, limit), field, path)


def as_text(data: bytes, field: str, path) -> str:
    """`data`, read from `path`, as UTF-8 text, or a SpecError naming the file and the byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecError(field, str(path), f"not UTF-8 text (byte {data[e.start]:#04x} at offset "
                                          f"{e.start})") from None


def check_output(path, field: str = "--out", parents: bool = False) -> Path:
    """`path` if a file could be written there (a command checks its outputs before its work);
    `parents`: missing directories will be created."""
    p = check_path(field, path)
    require(not p.is_dir(), field, str(p), "is a directory; give a file name")
    require(not p.exists() or p.is_file(), field, str(p), "exists and is not a regular file")
    if parents:
        d = next((d for d in p.parents if d.exists()), Path("."))
        require(d.is_dir(), field, str(p), f"{str(d)!r} is not a directory")
    else:
        require(p.parent.is_dir(), field, str(p), f"directory {str(p.parent)!r} does not exist")
    return p


def _cannot(field: str, p: Path, e: OSError, what: str = "cannot write") -> SpecError:
    return SpecError(field, str(p), f"{what}: {e.strerror or type(e).__name__}")


class AtomicFile:
    """`with AtomicFile(path) as f: f.write(...)`: `path` holds the whole new content after the
    block, or is untouched when the block raises (or the process dies). `binary` for bytes;
    `parents` creates missing directories. `stage` / `commit` / `discard` split the steps (for
    `write_all`)."""

    def __init__(self, path, field: str = "--out", parents: bool = False, binary: bool = False,
                 newline: str | None = None):
        self.path, self.field, self.binary, self.newline = check_path(field, path), field, binary, newline
        self.fd = self.tmp = self.file = None
        p = self.path
        if parents:
            try:
                p.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise _cannot(field, p, e, "cannot create its directory") from None
        check_output(p, field)
        remove_stale_temporaries(p)

    def stage(self):
        """Open the unnamed (or hidden) file the content goes to; returns the file object."""
        p, mode = self.path, self.path.stat().st_mode & 0o777 if self.path.exists() else 0o666 & ~_umask()
        try:
            try:
                self.fd = os.open(p.parent, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, mode)
            except (AttributeError, OSError) as e:
                if isinstance(e, OSError) and e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                    raise
                import tempfile   # imported here: the rare fallback (tempfile costs 2 ms of every start)
                self.fd, self.tmp = tempfile.mkstemp(dir=p.parent, prefix=_temp_prefix(p), suffix=".tmp")
            os.fchmod(self.fd, mode)
            self.file = os.fdopen(self.fd, "wb" if self.binary else "w", closefd=True,
                                  **({} if self.binary else {"encoding": "utf-8", "newline": self.newline}))
        except OSError as e:
            self.discard()
            raise _cannot(self.field, p, e) from None
        return self.file

    def commit(self, last: bool = False) -> Path:
        """Flush, fsync and rename the staged content over the path, signals held meanwhile (a
        signal that arrived before is raised first, and nothing is committed). `last`: the
        command's last output; from then on a signal ends nothing (perfmodel.util.interrupts)."""
        p = self.path
        try:
            interrupts.checkpoint()
        except BaseException:
            self.discard()
            raise
        with interrupts.deferred(check=not last):
            try:
                self.file.flush()
                os.fsync(self.file.fileno())
                if self.tmp is None:
                    self._link()
                else:
                    os.replace(self.tmp, p)
                    self.tmp = None
                self.file.close()
                _fsync_dir(p.parent)
            except OSError as e:
                self.discard()
                raise _cannot(self.field, p, e) from None
            if last:
                interrupts.finished()
        return p

    def _link(self) -> None:
        """Give the unnamed file its name: linked straight in when the path is free, else under a
        hidden name renamed over the old file (the only moment a temporary has a name)."""
        try:
            _link_fd(self.file.fileno(), self.path)
            return
        except FileExistsError:
            pass
        except OSError:  # no way to link an unnamed file here: copy it to a named temporary
            self._copy_to_named()
            os.replace(self.tmp, self.path)
            self.tmp = None
            return
        tmp = self.path.with_name(f"{_temp_prefix(self.path)}tmp")
        tmp.unlink(missing_ok=True)
        _link_fd(self.file.fileno(), tmp)
        try:
            os.replace(tmp, self.path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def _copy_to_named(self) -> None:
        import tempfile
        fd, self.tmp = tempfile.mkstemp(dir=self.path.parent, prefix=_temp_prefix(self.path), suffix=".tmp")
        with os.fdopen(fd, "wb") as dst, open(self.file.fileno(), "rb", closefd=False) as src:
            src.seek(0)
            while chunk := src.read(1 << 20):
                dst.write(chunk)
            dst.flush()
            os.fchmod(dst.fileno(), os.fstat(src.fileno()).st_mode & 0o777)
            os.fsync(dst.fileno())

    def discard(self) -> None:
        """Drop the staged content (nothing is left behind)."""
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.close()
        elif self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
        self.file = self.fd = None
        if self.tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.tmp)
            self.tmp = None

    def __enter__(self):
        return self.stage()

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.commit()
        else:
            self.discard()
        return False


def _temp_prefix(path: Path) -> str:
    """The start of this process's temporary names beside `path`: `.NAME.<pid>.`"""
    return f".{path.name[:200]}.{os.getpid()}."


def remove_stale_temporaries(path: Path) -> list[Path]:
    """Remove the hidden temporaries beside `path` (`.NAME.<pid>[.<random>].tmp`) whose process
    is gone (killed outright while it wrote `path`); returns them."""
    pattern = re.compile(re.escape(f".{path.name[:200]}.") + r"(\d+)(\.[A-Za-z0-9_]+)?\.tmp")
    removed = []
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return removed
    for e in entries:
        m = pattern.fullmatch(e.name)
        if m is None or int(m.group(1)) == os.getpid() or _alive(int(m.group(1))):
            continue
        with contextlib.suppress(OSError):
            os.unlink(e.path)
            removed.append(Path(e.path))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # another user's process (or no such number): left alone
    return True


def write_atomic(path, text: str | bytes, field: str = "--out", parents: bool = False, last: bool = False) -> Path:
    """Write `text` (or bytes) to `path` whole or not at all (AtomicFile); `last`: the command's
    last output (AtomicFile.commit)."""
    f = AtomicFile(path, field, parents, binary=isinstance(text, bytes))
    out = f.stage()
    try:
        out.write(text)
    except OSError as e:
        f.discard()
        raise _cannot(field, f.path, e) from None
    except BaseException:
        f.discard()
        raise
    return f.commit(last=True) if last else f.commit()


def write_all(files: dict, field: str = "--out", parents: bool = False) -> list[Path]:
    """Write several files, all or none: every one is staged (written and fsynced) first; then they
    are renamed into place with SIGINT / SIGTERM held back, and a rename that fails puts the old
    contents back."""
    staged, old = [], {}
    try:
        for path, text in files.items():
            f = AtomicFile(path, field, parents, binary=isinstance(text, bytes))
            staged.append(f)
            f.stage().write(text)
            f.file.flush()
            os.fsync(f.file.fileno())
            old[f.path] = f.path.read_bytes() if f.path.exists() else None
    except OSError as e:
        for f in staged:
            f.discard()
        raise _cannot(field, staged[-1].path, e) from None
    except BaseException:
        for f in staged:
            f.discard()
        raise
    done: list[Path] = []
    with _signals_held():
        try:
            for f in staged:
                done.append(f.commit())
        except SpecError:
            for f in staged[len(done):]:
                f.discard()
            for p in done:  # put back what was there
                if old[p] is None:
                    p.unlink(missing_ok=True)
                else:
                    write_atomic(p, old[p], field)
            raise
    return done


@contextlib.contextmanager
def _signals_held():
    """SIGINT and SIGTERM wait until the block is done (the main thread only)."""
    held = {signal.SIGINT, signal.SIGTERM}
    try:
        before = signal.pthread_sigmask(signal.SIG_BLOCK, held)
    except (AttributeError, ValueError, OSError):
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def _link_fd(fd: int, path: Path) -> None:
    """Link the open unnamed file `fd` at `path` (linkat through /proc, else AT_EMPTY_PATH)."""
    try:
        os.link(f"/proc/self/fd/{fd}", path, follow_symlinks=True)
        return
    except FileExistsError:
        raise
    except OSError as e:
        first = e
    import ctypes  # only where /proc cannot link (another mount namespace)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.linkat(fd, b"", -100, os.fsencode(path), 0x1000) != 0:  # AT_FDCWD, AT_EMPTY_PATH
        err = ctypes.get_errno()
        raise FileExistsError(err, os.strerror(err)) if err == errno.EEXIST else first


def _fsync_dir(d: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_csv(path, comments: list[str], header: list[str], rows, field: str = "--out") -> Path:
    """A CSV with its provenance as leading `# ` comment lines, written atomically (missing
    directories created)."""
    import csv   # imported here: most commands write no CSV
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
