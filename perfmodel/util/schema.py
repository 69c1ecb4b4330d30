"""Every input file through one door: read (size bounded), nesting bounded before parsing, parsed
(TOML, JSON or YAML), checked against its rule (perfmodel.util.checks) with the file named in
every error.

`load(path, rule, field)` is what each loader calls. Its errors are one `SpecError`, of two forms:
    <field>='<path>': <why>              the file as a whole (missing, unreadable, not UTF-8,
                                         too large, nested too deep, not valid TOML / JSON)
    <path>: <key>=<value>: <why>         one value in it (missing, wrong type, not finite, out of
                                         range, unknown key), `in_file` naming the file
"""
from __future__ import annotations

import os
import re
from pathlib import Path

from perfmodel.util import checked
from perfmodel.util.checks import MAX_DEPTH, check_tree
from perfmodel.util.errors import SpecError, in_file, require
from perfmodel.util.files import MAX_FILE_BYTES, as_text, read_bytes

# strings and comments, skipped when counting brackets (possessive: linear time on any input);
# patterns compiled when first used (re keeps them), not by every command that imports this
_JSON_SKIP = r'"(?:[^"\\]++|\\.)*+"?'
_TOML_SKIP = (r'"""(?:[^"\\]++|\\.|"(?!""))*+(?:"""|$)|\'\'\'(?:[^\']++|\'(?!\'\'))*+(?:\'\'\'|$)'
              r'|"(?:[^"\\\n]++|\\.)*+"?|\'[^\'\n]*+\'?|#[^\n]*+')
_NOT_BRACKET = r"[^\[\]{}]++"
_PAIR = r"\[\]|\{\}"
FORMATS = ("toml", "json", "yaml")
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # its presets and data


def too_deep(text: str, fmt: str, bound: int) -> bool:
    """Whether brackets outside strings and comments nest more than `bound` deep, found without
    parsing: each pass deletes the innermost pairs (at most `bound` passes, each linear)."""
    s = re.sub(_NOT_BRACKET, "", re.sub(_TOML_SKIP if fmt == "toml" else _JSON_SKIP, "", text))
    for _ in range(bound):
        s, n = re.subn(_PAIR, "", s)
        if not n:
            break
    return bool(re.search(_PAIR, s) or re.search(r"[\[{]{%d}" % (bound + 1), s))


def parse(text: str, fmt: str, field: str, path, json_constant=None) -> object:
    """`text` parsed as `fmt`, nesting bounded first; a SpecError naming the file otherwise."""
    require(fmt in FORMATS, field, str(path), f"must be a {', '.join('.' + f for f in FORMATS)} file")
    require(not too_deep(text, fmt, MAX_DEPTH + 1), field, str(path), f"nested more than {MAX_DEPTH} deep")
    try:
        if fmt == "json":
            import json   # imported here, as tomllib: a command on kept presets parses neither
            return json.loads(text, parse_constant=json_constant)
        if fmt == "toml":
            import tomllib
            return tomllib.loads(text)
        try:
            import yaml
        except ImportError:
            raise SpecError(field, str(path), "YAML needs PyYAML (pip install pyyaml); or write the file "
                                              "as TOML") from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise SpecError(field, str(path), f"not valid YAML: {str(e).splitlines()[0]}") from None
    except (ValueError, RecursionError) as e:  # decode errors, over-long integers
        raise SpecError(field, str(path), f"not valid {fmt.upper()}: {str(e).splitlines()[0][:200]}") from None


def parse_file(raw: bytes, fmt: str, field: str, path, json_constant=None) -> object:
    """The bytes of file `path` parsed as `fmt` (`parse`); the package's own TOML once per content
    (perfmodel.util.checked.kept: tomllib is Python, and importing it and parsing a preset cost
    more than the rest of its loading)."""
    text = as_text(raw, field, path)
    if fmt == "toml" and os.path.abspath(path).startswith(PACKAGE_DIR):
        return checked.kept(checked.content(raw), "parse toml", lambda: parse(text, fmt, field, path))
    return parse(text, fmt, field, path, json_constant)


def format_of(path) -> str:
    suffix = Path(path).suffix.lower().lstrip(".")
    return {"yml": "yaml"}.get(suffix, suffix)


def load(path, rule=None, field: str = "file", fmt: str | None = None, limit: int = MAX_FILE_BYTES,
         json_constant=None):
    """The checked content of one input file: `fmt` (default: from the suffix) parsed and
    checked against `rule` (a table unless the rule says otherwise). `json_constant`: what
    JSON's NaN / Infinity become (default: floats, refused by the check as not finite)."""
    fmt = fmt or format_of(path)
    data = parse_file(read_bytes(path, field, limit), fmt, field, path, json_constant)
    rule = {"*": None} if rule is None else rule
    require(not isinstance(rule, dict) or isinstance(data, dict), field, str(path),
            f"must hold {'an object' if fmt == 'json' else 'a table'} at the top, not {type(data).__name__}")
    with in_file(path):
        return check_tree(data, rule, "file")
