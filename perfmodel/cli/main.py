"""`perfmodel` command line: list, predict, trace, explain, sweep, serve, reproduce, calibrate,
validate, hostbench, capture, dashboard.

Every command takes --json for a stable, documented output (docs/json-schema.md). Bad input
exits with status 2 and one line naming the file, field and value, never a traceback; so does an
output that cannot be written (a full disk, a closed stdout). SIGINT ends with status 130,
SIGTERM 143, SIGHUP 129, each with one line; outputs are whole or absent. A command's
module is imported only when that command runs, so `perfmodel --help` and a one-off
`perfmodel predict` start fast.
"""
from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

from perfmodel.cli.args import Parser, UsageError
from perfmodel.util import interrupts
from perfmodel.util.checks import one_line
from perfmodel.util.errors import SpecError
from perfmodel.util.interrupts import Terminated

# command -> (module, the function that adds its arguments and sets `func`, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "list": ("perfmodel.cli.predict", "configure_list", "show model and hardware presets"),
    "predict": ("perfmodel.cli.predict", "configure_predict", "predict decode step time and tokens/s"),
    "trace": ("perfmodel.cli.predict", "configure_trace", "export the simulated step as Perfetto / Chrome trace JSON"),
    "explain": ("perfmodel.cli.predict", "configure_explain",
                "one layer or op term by term: bytes, FLOPs, mechanisms, sources"),
    "sweep": ("perfmodel.cli.sweep", "configure_sweep", "what-if and design search: --vary axes or a --design "
              "file, top K and Pareto front, Parquet/CSV out, local or Ray executor"),
    "serve": ("perfmodel.cli.serve", "configure_serve", "serving simulation: arrivals, continuous batching, paged "
              "KV cache, disaggregated prefill; TTFT / TPOT / E2E percentiles and throughput"),
    "reproduce": ("perfmodel.cli.fit", "configure_reproduce", "the seed table: fit on batch 1 and 8, predict the rest"),
    "calibrate": ("perfmodel.cli.fit", "configure_calibrate", "fit component parameters to their own micro-benchmarks"),
    "validate": ("perfmodel.cli.validate", "configure_validate",
                 "per-layer predicted vs measured from profiler traces"),
    "hostbench": ("perfmodel_jax.hostbench", "configure_hostbench", "measure this machine and write a CPU hardware file"),
    "capture": ("perfmodel_jax.capture", "configure_capture", "record profiler traces of the pure-JAX reference step"),
    "dashboard": ("perfmodel.cli.dashboard", "configure_dashboard",
                  "start the Streamlit dashboard (needs perfmodel[dashboard])"),
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; the command named in `argv` alone when it names one (parsing imports that
    command's module alone), else every command (for the overview and the error naming them)."""
    parser = Parser(prog="perfmodel", description="LLM decode performance model: predict, explain, sweep and serve "
                    "decode steps on accelerators; validate them against measurements")
    parser.add_argument("--debug", action="store_true", help="show the traceback of internal errors")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = None if argv is None else next((x for x in argv if not x.startswith("-")), "")
    for name, (module, configure, text) in COMMANDS.items():
        if chosen in COMMANDS and name != chosen:
            continue
        p = sub.add_parser(name, help=text, description=text)
        if chosen is None or name == chosen:
            getattr(importlib.import_module(module), configure)(p)
    return parser


class _Stdout:
    """sys.stdout whose write errors are input errors naming where stdout goes."""

    def __init__(self, f):
        self.f = f

    def _call(self, name: str, *args):
        if self.f is None:
            raise SpecError("stdout", "<closed>", "standard output is closed; redirect it (> FILE)")
        try:
            return getattr(self.f, name)(*args)
        except BrokenPipeError:
            raise
        except (OSError, ValueError) as e:  # ValueError: a closed file
            raise SpecError("stdout", _stdout_target(), f"cannot write: {getattr(e, 'strerror', None) or e}") from None

    def write(self, text: str):
        return self._call("write", text)

    def flush(self):
        return self._call("flush")

    def __getattr__(self, name: str):
        return getattr(self.f, name)


def _stdout_target() -> str:
    try:
        return os.readlink("/proc/self/fd/1")
    except OSError:
        return "<stdout>"


def _silence_stdout() -> None:
    """After a failed write: later flushes (at exit too) go nowhere instead of failing again."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, 1)
        os.close(fd)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    """Run one command. Exit 0; 2 with one line on stderr for bad input (or a missing optional
    dependency, or an output that cannot be written); 1 with one line for an internal error
    (`--debug` adds the traceback); 128 + N with one line for signal N (INT, TERM, HUP;
    perfmodel.util.interrupts). Called without `argv` (the `perfmodel` program), a signal that
    arrives after the command has ended no longer interrupts the interpreter's exit."""
    process = argv is None
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv  # accepted anywhere on the line
    argv = [x for x in argv if x != "--debug"]
    if hasattr(sys.stdout, "reconfigure"):  # echoed paths may hold undecodable bytes
        sys.stdout.reconfigure(errors="backslashreplace")
    real_stdout, sys.stdout = sys.stdout, _Stdout(sys.stdout)
    handlers = interrupts.install()
    code = 1
    try:
        code = _run(argv, debug)
        return code
    finally:
        sys.stdout = real_stdout
        if process and handlers:  # the command has ended: its exit status stands
            interrupts.finished()
            if code in SIGNAL_EXITS:
                _exit_now(code)
        else:
            interrupts.restore(handlers)


SIGNAL_EXITS = (128 + signal.SIGINT, 128 + signal.SIGTERM, 128 + signal.SIGHUP)


def _exit_now(code: int) -> None:
    """End the process with `code` at once, after a signal ended its command: its outputs are
    discarded and its workers ended, and the interpreter's teardown is skipped (a KeyboardInterrupt
    that passed through an extension's embedded evaluation would make it exit by SIGINT instead,
    and a finalizer could print)."""
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError, AttributeError):
            pass
    os._exit(code)


def _run(argv: list[str], debug: bool) -> int:
    chosen = next((x for x in argv if not x.startswith("-")), None)
    command = f"perfmodel {chosen}" if chosen in COMMANDS else "perfmodel"
    try:
        a = build_parser(argv).parse_args(argv)
        command = f"perfmodel {a.command}"
        out = a.func(a)
        interrupts.checkpoint()  # a signal that landed where it could not unwind the command
        if getattr(a, "json", False):
            from perfmodel.step.report import SCHEMA_VERSION, json_text
            sys.stdout.write(json_text({"schema_version": SCHEMA_VERSION, "command": a.command, **out}))
        sys.stdout.flush()
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else 0
    except UsageError as e:
        return _fail(str(e), 2)
    except SpecError as e:
        if e.field == "stdout":
            _silence_stdout()
        return _fail(f"{command}: error: {e}", 2)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] in OPTIONAL:
            return _fail(f"{command}: needs {e.name.split('.')[0]}, which is not installed: "
                         f"pip install 'perfmodel[{OPTIONAL[e.name.split('.')[0]]}]'", 2)
        return _internal(command, e, debug)
    except BrokenPipeError:  # output piped into head and the like: not an error
        _silence_stdout()
    except KeyboardInterrupt:
        return _signalled(command, signal.SIGINT)
    except Terminated as e:
        return _signalled(command, e.signum)
    except Exception as e:
        return _internal(command, e, debug)
    return 0


def _signalled(command: str, signum: int) -> int:
    words = {signal.SIGINT: "interrupted", signal.SIGTERM: "terminated", signal.SIGHUP: "hung up"}
    return _fail(f"{command}: {words[signum]}", 128 + signum)


# optional dependency (top-level module) -> the extra that installs it
OPTIONAL = {"jax": "jax", "jaxlib": "jax", "streamlit": "dashboard", "pandas": "dashboard"}


def _fail(message: str, code: int) -> int:
    try:
        print(one_line(message), file=sys.stderr)
    except (OSError, ValueError, AttributeError):  # stderr closed or full: the status still tells
        pass
    return code


def _internal(command: str, e: BaseException, debug: bool) -> int:
    """One line for an internal error, or the signal's line where one had arrived: an interrupt
    that lands in an extension's import comes out as another error (numpy's ImportError)."""
    signum = interrupts.arrived()
    if signum is not None:
        return _signalled(command, signum)
    if debug:
        import traceback   # imported here: only a crash under --debug prints one
        traceback.print_exception(e)
    return _fail(f"{command}: internal error: {type(e).__name__}: {e} (please report it; "
                 f"--debug shows the traceback)", 1)


if __name__ == "__main__":
    sys.exit(main())
