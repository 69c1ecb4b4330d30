"""Checks at the input boundary: value types, finite numbers, ranges, and sizes that bound memory.

Loaders call these on the raw data of a file (TOML / JSON) before building a spec, so a bad
file fails with one `SpecError` naming the field and its value, never deep inside the model.
"""
from __future__ import annotations

import math

from perfmodel.util.errors import require

# Sizes that keep one prediction within memory and seconds (real models are far below them).
MAX_LAYERS = 1024          # Kimi K3: 93
MAX_EXPERTS = 65536        # Kimi K3: 896 routed experts
MAX_INT = 2**53            # larger integers lose precision (and overflow) as floats
MAX_DEPTH = 8              # nesting of tables / lists in a spec file
MAX_ITEMS = 100_000        # entries of one list or table

MAX_SKEW = 10.0            # Zipf exponent of expert popularity (1 is already very skewed)
MAX_MIB = 2**30            # an on-chip buffer or ring depth in MiB (1 PiB)

NUMBER, INT, STR, BOOL, TABLE, LIST = "a number", "an integer", "a string", "a boolean", "a table", "a list"
COUNT = "a positive integer"
LAYERS = f"an integer in [0, {MAX_LAYERS}]"
_CHECK = {NUMBER: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          INT: lambda v: isinstance(v, int) and not isinstance(v, bool),
          STR: lambda v: isinstance(v, str), BOOL: lambda v: isinstance(v, bool),
          TABLE: lambda v: isinstance(v, dict), LIST: lambda v: isinstance(v, list),
          COUNT: lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
          LAYERS: lambda v: isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_LAYERS,
          None: lambda v: v is None}

# Rules for check_tree (one file's schema): None, any value; a tuple of kinds (NUMBER, INT, STR,
# ..., None for null); Num(...) a finite number in a range; OneOf(...) one of some values; a dict, a
# table whose keys are those listed (Req(rule) marks a required one; "*": the rule of any other
# key, else another key is an error naming it); a one-element list [rule], a list of that rule;
# ListOf(rule, min_len, max_len). Finer checks stay with the loaders.


class Req:
    """A table key that must be present."""
    def __init__(self, rule=None):
        self.rule = rule


class Num:
    """A finite number (an integer with `integer`) in [lo, hi] ((lo, hi] with lo_open)."""
    def __init__(self, lo=None, hi=None, lo_open: bool = False, integer: bool = False, null: bool = False):
        self.lo, self.hi, self.lo_open, self.integer, self.null = lo, hi, lo_open, integer, null


class OneOf:
    def __init__(self, *choices):
        self.choices = choices


class ListOf:
    def __init__(self, rule=None, min_len: int = 0, max_len: int = MAX_ITEMS):
        self.rule, self.min_len, self.max_len = rule, min_len, max_len


_SECTION = {"*": (NUMBER, BOOL)}
HARDWARE_FILE = {"peak_flops_per_s": {"*": (NUMBER,)}, "efficiency": {"*": (NUMBER,)},
                 "components": {"*": (NUMBER,)},
                 "sources": {"*": (STR,)}, "*": (NUMBER, STR)}


def check_type(field: str, value, *kinds: str | None):
    """`value` if it is one of `kinds` (NUMBER, INT, COUNT, STR, ..., None for null)."""
    require(any(_CHECK[k](value) for k in kinds), field, value,
            "must be " + " or ".join(k or "null" for k in kinds))
    return value


def check_finite(field: str, value):
    if isinstance(value, float):
        require(math.isfinite(value), field, value, "must be a finite number")
    elif isinstance(value, int) and not isinstance(value, bool):
        require(abs(value) <= MAX_INT, field, value, "magnitude must be <= 2**53")
    return value


def check_range(field: str, value, lo=None, hi=None, lo_open: bool = False):
    """`value` (a finite number) within [lo, hi] ((lo, hi] with lo_open)."""
    check_finite(field, check_type(field, value, NUMBER))
    if lo is not None:
        ok = value > lo if lo_open else value >= lo
        require(ok, field, value, f"must be {'>' if lo_open else '>='} {lo}")
    if hi is not None:
        require(value <= hi, field, value, f"must be <= {hi}")
    return value


def check_tree(data, rule=None, field: str = "file", depth: int = 0):
    """Every value in parsed file data finite, bounded and nested at most MAX_DEPTH deep, and of
    the kind `rule` says (see the rules above); returns `data`."""
    require(depth <= MAX_DEPTH, field, "...", f"nested more than {MAX_DEPTH} deep")
    if rule is None:   # any value: scalars checked here at once (the common case in large files)
        t = type(data)
        if t is str or t is bool or data is None:
            return data
        if t is float or t is int:
            return check_finite(field, data)
    if isinstance(rule, Req):
        rule = rule.rule
    if isinstance(rule, list):
        rule = ListOf(rule[0])
    if isinstance(rule, dict):
        check_type(field, data, TABLE)
    elif isinstance(rule, ListOf):
        check_type(field, data, LIST)
        require(rule.min_len <= len(data) <= rule.max_len, field, data,
                f"must have {rule.min_len}..{rule.max_len} entries")
    elif isinstance(rule, Num):
        _check_num(field, data, rule)
    elif isinstance(rule, OneOf):
        require(any(data == c and type(data) is type(c) for c in rule.choices), field, data,
                f"must be one of {', '.join(map(repr, rule.choices))}")
    elif rule:
        check_type(field, data, *rule)
    if isinstance(data, (dict, list)):
        require(len(data) <= MAX_ITEMS, field, f"{len(data)} entries", f"at most {MAX_ITEMS}")
    at = lambda k: f"{field}.{k}" if depth else str(k)
    if isinstance(data, list):
        item = rule.rule if isinstance(rule, ListOf) else None
        if _numbers_pass(data, item) or (item is None and _scalars_pass(data)):
            return data
        for i, v in enumerate(data):
            check_tree(v, item, f"{field}[{i}]", depth + 1)
    elif isinstance(data, dict):
        sub = rule if isinstance(rule, dict) else {}
        for k, v in data.items():
            require(isinstance(k, str), at(k), v, "keys must be strings")
            require(k in sub or "*" in sub or not isinstance(rule, dict), at(k), v,
                    "unknown key; known: " + ", ".join(sorted(k for k in sub if k != "*")))
            check_tree(v, sub.get(k, sub.get("*")), at(k), depth + 1)
        for k, r in sub.items():
            require(not isinstance(r, Req) or k in data, at(k), None, "required key is missing")
    else:
        check_finite(field, data)
    return data


def _scalars_pass(data: list) -> bool:
    """Whether a list surely passes the rule None: strings, booleans, nulls and finite numbers
    of bounded magnitude only (False: check one by one, where a bad one is named)."""
    for v in data:
        t = type(v)
        if t is float:
            if not math.isfinite(v):
                return False
        elif t is int:
            if abs(v) > MAX_INT:
                return False
        elif not (t is str or t is bool or v is None):
            return False
    return True


def _numbers_pass(data: list, item) -> bool:
    """Whether a long list of plain numbers (or nulls a Num rule allows) surely passes `item`
    (None, Num or a kinds tuple with NUMBER): checked in bulk; False means check one by one."""
    if len(data) < 8 or not (item is None or isinstance(item, Num) or (isinstance(item, tuple) and NUMBER in item)):
        return False
    nums = [v for v in data if v is not None] if isinstance(item, Num) and item.null else data
    if not all(type(v) is float or type(v) is int for v in nums):
        return False
    if isinstance(item, Num) and item.integer and not all(type(v) is int for v in nums):
        return False
    if not nums:
        return True
    lo, hi = min(nums), max(nums)
    if not (all(map(math.isfinite, nums)) and -MAX_INT <= lo and hi <= MAX_INT):
        return False
    if isinstance(item, Num):
        if item.lo is not None and not (lo > item.lo if item.lo_open else lo >= item.lo):
            return False
        if item.hi is not None and hi > item.hi:
            return False
    return True


def _check_num(field: str, v, r: Num) -> None:
    if v is None and r.null:
        return
    check_type(field, v, INT if r.integer else NUMBER, *((None,) if r.null else ()))
    check_range(field, v, r.lo, r.hi, r.lo_open)


def one_line(text: str) -> str:
    """`text` with control, format and separator characters (and lone surrogates) escaped."""
    import unicodedata   # imported here: only a message needs it
    return "".join(c.encode("unicode_escape").decode("ascii") if c != " " and
                   unicodedata.category(c)[0] in "CZ" else c for c in str(text))
