"""Command-line argument types shared by every `perfmodel` subcommand (checked at parse time).

A parse error raises `UsageError` (one line, exit 2 in `perfmodel.cli.main`) instead of argparse's
usage dump and `SystemExit`.
"""
from __future__ import annotations

import argparse
import math

from perfmodel.util.checks import MAX_MIB, MAX_SKEW

MAX_COUNT = 2**20       # batch sizes, devices, slots, steps: far beyond any real deployment
MAX_CONTEXT = 2**30     # tokens in one sequence's cache
MAX_LIST = 256          # values in one comma-separated list


class UsageError(Exception):
    """A command line that does not parse."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors, and the options given on the command line recorded in the
    namespace (`given`: dest -> the option's name), so that an option a command would not use
    can be refused by name (`refuse_unused`)."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: error: {message}")

    def parse_known_args(self, args=None, namespace=None):
        self._given: dict[str, str] = {}
        ns, rest = super().parse_known_args(args, namespace)
        ns.given = {**getattr(ns, "given", {}), **self._given}
        return ns, rest

    def _get_values(self, action, arg_strings):
        if action.option_strings and hasattr(self, "_given"):
            self._given[action.dest] = max(action.option_strings, key=len)
        return super()._get_values(action, arg_strings)


def refuse_unused(a: argparse.Namespace, used: set[str] | tuple[str, ...], why: str,
                  ignore: tuple[str, ...] = ("json", "no_progress")) -> None:
    """SpecError naming the first option given on the command line that is not in `used` (dests):
    an option that would do nothing is refused, never ignored."""
    from perfmodel.util.errors import SpecError
    for dest, flag in getattr(a, "given", {}).items():
        if dest not in used and dest not in ignore:
            v = getattr(a, dest, None)
            raise SpecError(flag, v[0] if isinstance(v, list) and len(v) == 1 else v, why)


def given(a: argparse.Namespace, dest: str) -> bool:
    """Whether option `dest` was given on the command line."""
    return dest in getattr(a, "given", {})


def items(text: str) -> list[str]:
    items = [x.strip() for x in text.split(",")]
    if not text.strip() or any(not x for x in items):
        raise argparse.ArgumentTypeError(f"expected comma-separated values, got {text!r}")
    if len(items) > MAX_LIST:
        raise argparse.ArgumentTypeError(f"at most {MAX_LIST} values, got {len(items)}")
    return items


def integer(text: str, lo: int = 1, hi: int = MAX_COUNT) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not lo <= v <= hi:
        raise argparse.ArgumentTypeError(f"expected an integer in [{lo}, {hi}], got {text!r}")
    return v


def count(text: str) -> int:
    """An integer in [1, MAX_COUNT]."""
    return integer(text)


def context(text: str) -> int:
    """Tokens already in the cache: an integer in [0, MAX_CONTEXT]."""
    return integer(text, 0, MAX_CONTEXT)


def number(text: str, lo: float = 0.0, lo_open: bool = False, hi: float = math.inf) -> float:
    """A finite number >= lo (> lo with lo_open) and <= hi."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(v) or v < lo or (lo_open and v == lo) or v > hi:
        bound = f"{'>' if lo_open else '>='} {lo}" + (f" and <= {hi}" if hi < math.inf else "")
        raise argparse.ArgumentTypeError(f"expected a finite number {bound}, got {text!r}")
    return v


def nonnegative(text: str) -> float:
    return number(text)


def positive(text: str) -> float:
    return number(text, lo_open=True)


def mib(text: str) -> float:
    """A size in MiB: > 0 and at most MAX_MIB (1 PiB)."""
    return number(text, 0, True, MAX_MIB)


def skew(text: str) -> float:
    """A Zipf exponent of expert popularity in [0, MAX_SKEW]."""
    return number(text, hi=MAX_SKEW)


def int_list(text: str) -> list[int]:
    """Comma-separated counts (>= 1), at least one."""
    return [count(x) for x in items(text)]


def context_list(text: str) -> list[int]:
    return [context(x) for x in items(text)]


def choice(text: str, choices: tuple[str, ...]) -> str:
    if text not in choices:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(choices)}, got {text!r}")
    return text


def str_list(text: str, choices: tuple[str, ...]) -> list[str]:
    return [choice(x, choices) for x in items(text)]
