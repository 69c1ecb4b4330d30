"""Checks at the input boundary: value types, finite numbers, ranges, and sizes that bound memory.

Loaders call these on the raw data of a file (TOML / JSON) before building a spec, so a bad
file fails with one `SpecError` naming the field and its value, never deep inside the model.
"""
from __future__ import annotations

import math
import unicodedata

from .errors import SpecError, require

# Sizes that keep one prediction within memory and seconds (real models are far below them).
MAX_LAYERS = 1024          # Kimi K3: 93
MAX_EXPERTS = 65536        # Kimi K3: 896 routed experts
MAX_INT = 2**53            # larger integers lose precision (and overflow) as floats
MAX_DEPTH = 8              # nesting of tables / lists in a spec file
MAX_ITEMS = 100_000        # entries of one list or table

NUMBER = "number"          # an int or a float, not a bool
INT = "integer"
STR = "string"
BOOL = "boolean"
TABLE = "table"
LIST = "list"
_CHECK = {NUMBER: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          INT: lambda v: isinstance(v, int) and not isinstance(v, bool),
          STR: lambda v: isinstance(v, str), BOOL: lambda v: isinstance(v, bool),
          TABLE: lambda v: isinstance(v, dict), LIST: lambda v: isinstance(v, list),
          None: lambda v: v is None}


def check_type(field: str, value, *kinds: str | None):
    """`value` if it is one of `kinds` (NUMBER, INT, STR, BOOL, TABLE, LIST, None for null)."""
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


def check_tree(data, schema: dict | None = None, prefix: str = "", depth: int = 0):
    """Every value in a parsed file finite, bounded and nested at most MAX_DEPTH deep; keys in
    `schema` of its kind: {"key": (kinds...)} or {"key": {nested schema}} for a table."""
    field = prefix.rstrip(".") or "file"
    require(depth <= MAX_DEPTH, field, "...", f"nested more than {MAX_DEPTH} deep")
    if isinstance(data, (dict, list)):
        require(len(data) <= MAX_ITEMS, field, f"{len(data)} entries", f"at most {MAX_ITEMS}")
    if isinstance(data, list):
        for i, v in enumerate(data):
            check_tree(v, None, f"{prefix.rstrip('.')}[{i}].", depth + 1)
        return data
    if not isinstance(data, dict):
        return check_finite(field, data)
    for k, v in data.items():
        key = f"{prefix}{k}"
        rule = (schema or {}).get(k)
        if isinstance(rule, dict):
            check_type(key, v, TABLE)
        elif rule:
            check_type(key, v, *rule)
        check_tree(v, rule if isinstance(rule, dict) else None, key + ".", depth + 1)
    return data


def one_line(text: str) -> str:
    """`text` with control, format and separator characters (and lone surrogates) escaped."""
    return "".join(c.encode("unicode_escape").decode("ascii") if c != " " and
                   unicodedata.category(c)[0] in "CZ" else c for c in str(text))
