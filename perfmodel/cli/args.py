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
    def error(self, message: str):
        raise UsageError(f"{self.prog}: error: {message}")


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
