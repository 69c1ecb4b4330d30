"""SIGINT, SIGTERM and SIGHUP end a command cleanly, wherever they land.

`perfmodel.cli.main` installs `handler` for the three signals. It records the signal and raises
KeyboardInterrupt (SIGINT) or `Terminated` (SIGTERM, SIGHUP), so the command unwinds: every open
output is discarded, worker processes are ended, and main prints one line.

Four places where Python would lose or mangle that exception are closed:
- inside compiled code (the simulator's numba loops): a handler that raises while the compiled
  function's dispatcher is between calls into Python leaves "a result with an exception set"
  (SystemError). `deferred` wraps those calls: a signal that arrives inside is recorded and
  raised when the call returns;
- inside a finalizer or a callback whose exceptions Python ignores (printed as "Exception ignored
  in ..."): the signal stays recorded and `checkpoint`, called with every unit of work
  (perfmodel.util.limits.spend) and before an output is committed, raises it again; main's
  unraisable hook keeps such a swallowed interrupt, and once a signal has arrived any
  finalizer's error, off stderr;
- inside an extension's import (numpy's C modules): an interrupt there comes out as an
  ImportError; main treats any error raised once a signal has arrived (`arrived`) as that
  signal;
- after an output is committed (perfmodel.util.files): the command's work is done and whole, so
  a signal from then on is recorded and not raised (`finished`): the command ends as it would
  have, and nothing it wrote is left half-done or removed.
"""
from __future__ import annotations

import contextlib
import signal
import sys

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Terminated(BaseException):
    """SIGTERM or SIGHUP: unwinds like Ctrl-C, so every open output is discarded on the way out."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_state = {"pending": None, "deferred": 0, "finished": False, "installed": False}


def exception(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def handler(signum, _frame) -> None:
    _state["pending"] = signum
    if _state["installed"] and not _state["deferred"] and not _state["finished"]:
        raise exception(signum)


def install() -> dict:
    """Install `handler` for SIGINT, SIGTERM and SIGHUP (the main thread only); returns the
    handlers it replaced (for `restore`), {} where signals cannot be set here."""
    _state.update(pending=None, deferred=0, finished=False)
    old = {}
    try:
        for sig in SIGNALS:
            old[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread: signals stay as they are
        for sig, h in old.items():
            signal.signal(sig, h)
        return {}
    _state["installed"] = True
    sys.unraisablehook, old["unraisable"] = _unraisable, sys.unraisablehook
    return old


def restore(old: dict) -> None:
    hook = old.pop("unraisable", None)
    if hook is not None:
        sys.unraisablehook = hook
    for sig, h in old.items():
        signal.signal(sig, h)
    _state.update(installed=False, deferred=0)


def _unraisable(args) -> None:
    """An interrupt swallowed where Python ignores exceptions stays recorded (checkpoint raises
    it again). Once a signal has arrived, a finalizer's error is not reported either: it comes
    from work the signal cut short (llvmlite's handles of a numba compile it interrupted, half
    built, fail in their __del__), and the command ends with its one line. Anything else is
    reported as Python would."""
    if isinstance(args.exc_value, (KeyboardInterrupt, Terminated)) or _state["pending"] is not None:
        return
    sys.__unraisablehook__(args)


def checkpoint() -> None:
    """Raise a recorded signal (one that landed where it could not unwind the command)."""
    s = _state
    if s["pending"] is not None and s["installed"] and not s["deferred"] and not s["finished"]:
        raise exception(s["pending"])


@contextlib.contextmanager
def deferred(check: bool = True):
    """A signal inside the block is recorded, not raised; raised after it (`check`) unless the
    command has finished by then."""
    _state["deferred"] += 1
    try:
        yield
    finally:
        _state["deferred"] -= 1
    if check:
        checkpoint()


def arrived() -> int | None:
    """The signal that arrived while the command could still be ended by it, else None."""
    return None if _state["finished"] else _state["pending"]


def finished() -> None:
    """The command's outputs are committed: signals from now on end nothing."""
    _state["finished"] = True
