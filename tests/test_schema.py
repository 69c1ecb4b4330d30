"""The schema layer (perfmodel.util.checks rules, perfmodel.util.schema.load) and the writers
(perfmodel.util.files), property-based: any parsed data either passes its rule or fails with one
SpecError naming the file, the field and the value; any write leaves the old file or the whole
new one and no temporary; shipped data files pass their schemas."""
from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from perfmodel.util import schema
from perfmodel.util.checks import MAX_DEPTH, NUMBER, STR, ListOf, Num, OneOf, Req, check_tree
from perfmodel.util.csvsafe import csv_text, neutral
from perfmodel.util.errors import SpecError, in_file
from perfmodel.util.files import AtomicFile, write_all, write_atomic

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
RULE = {"name": Req((STR,)), "count": Req(Num(1, 100, integer=True)), "rate": Num(0, lo_open=True),
        "kind": OneOf("a", "b"), "tags": ListOf((STR,), 1, 4), "extra": {"*": (NUMBER,)}}

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**60, 2**60), st.text(max_size=6),
                    st.floats(allow_nan=True, allow_infinity=True))
trees = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(["name", "count", "rate", "kind", "tags",
                                                                  "extra", "x", "y"]), inner, max_size=5)),
    max_leaves=12)


def satisfies(data) -> bool:
    """RULE written out by hand: the oracle the checker is compared with."""
    if not isinstance(data, dict) or not {"name", "count"} <= set(data) or set(data) - set(RULE):
        return False

    def number(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and abs(v) <= 2**53

    def finite(v):
        if isinstance(v, dict):
            return all(finite(x) for x in v.values())
        if isinstance(v, list):
            return all(finite(x) for x in v)
        return not isinstance(v, float) or math.isfinite(v)

    ok = isinstance(data["name"], str)
    ok &= isinstance(data["count"], int) and not isinstance(data["count"], bool) and 1 <= data["count"] <= 100
    if "rate" in data:
        ok &= number(data["rate"]) and data["rate"] > 0
    if "kind" in data:
        ok &= data["kind"] in ("a", "b") and isinstance(data["kind"], str)
    if "tags" in data:
        ok &= isinstance(data["tags"], list) and 1 <= len(data["tags"]) <= 4 and all(isinstance(t, str) for t in data["tags"])
    if "extra" in data:
        ok &= isinstance(data["extra"], dict) and all(number(v) for v in data["extra"].values())
    return bool(ok) and finite(data)


@SETTINGS
@given(data=trees)
def test_check_tree_agrees_with_the_rule_written_out(data):
    try:
        check_tree(data, RULE)
        passed = True
    except SpecError as e:
        passed = False
        assert "\n" not in str(e) and e.field and e.why
    assert passed == satisfies(data), data


@SETTINGS
@given(data=st.fixed_dictionaries({"name": st.text(max_size=5), "count": st.integers(1, 100)},
                                  optional={"rate": st.floats(1e-9, 1e9), "kind": st.sampled_from("ab"),
                                            "tags": st.lists(st.text(max_size=3), min_size=1, max_size=4)}))
def test_valid_data_passes(data):
    assert check_tree(data, RULE) is data


@SETTINGS
@given(fmt=st.sampled_from(["json", "toml"]), data=trees, noise=st.binary(max_size=8), at=st.integers(0, 400))
def test_load_is_a_value_or_one_named_error(tmp_path_factory, fmt, data, noise, at):
    """Whatever bytes a file holds, `load` returns checked data or raises one SpecError that names
    the file (as the field's value or in front of the field)."""
    path = tmp_path_factory.mktemp("f") / f"x.{fmt}"
    text = json.dumps({"v": data}) if fmt == "json" else f"v = {json.dumps(str(data))}\n"
    raw = text.encode()
    raw = raw[:at] + noise + raw[at:]
    path.write_bytes(raw)
    try:
        schema.load(path, {"v": None}, "--x")
    except SpecError as e:
        assert str(path) in str(e) and "\n" not in str(e)


def test_unknown_key_missing_key_and_range_name_file_field_value(tmp_path):
    f = tmp_path / "a.json"
    for text, field, value in [('{"count": 1}', "name", None), ('{"name": "n", "count": 1, "zz": 3}', "zz", 3),
                               ('{"name": "n", "count": 0}', "count", 0), ('{"name": "n", "count": NaN}', "count", None),
                               ('{"name": "n", "count": 1, "tags": []}', "tags", [])]:
        f.write_text(text)
        with pytest.raises(SpecError) as e:
            schema.load(f, RULE, "--x")
        assert e.value.file == str(f) and e.value.field == field, str(e.value)
        if value is not None:
            assert e.value.value == value
        assert str(e.value).startswith(f"{f}: {field}=")


def test_nesting_refused_before_parsing(tmp_path):
    for fmt, deep in [("json", "[" * 100_000), ("toml", "a = " + "[" * 100_000), ("json", '{"a":' * 50 + "1" + "}" * 50)]:
        f = tmp_path / f"d.{fmt}"
        f.write_text(deep)
        with pytest.raises(SpecError, match="nested more than"):
            schema.load(f, None, "--x")
    ok = tmp_path / "ok.json"
    ok.write_text("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1))
    assert schema.load(ok, ListOf(None), "--x") is not None
    s = tmp_path / "s.toml"  # brackets in strings and comments do not count
    s.write_text('a = "[[[[[[[[[[[[[[[[[["  # [[[[[[[[[[[[[[[[[[\n')
    assert schema.load(s, {"a": (STR,)}, "--x") == {"a": "[" * 18}


def test_size_and_encoding_refused(tmp_path):
    big = tmp_path / "big.json"
    big.write_bytes(b" " * 2049)
    with pytest.raises(SpecError, match="larger than"):
        schema.load(big, None, "--x", limit=2048)
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b'a = "\xff"')
    with pytest.raises(SpecError, match="not UTF-8"):
        schema.load(bad, None, "--x")
    with pytest.raises(SpecError, match="Is a directory"):
        schema.load(tmp_path, None, "--x", fmt="json")
    (tmp_path / "link.json").symlink_to(tmp_path / "missing.json")
    with pytest.raises(SpecError, match="No such file"):
        schema.load(tmp_path / "link.json", None, "--x")


def test_in_file_names_the_file_once():
    with pytest.raises(SpecError) as e, in_file("m.toml"):
        with in_file("inner.toml"):
            raise SpecError("layers", 5, "too many")
    assert str(e.value) == "inner.toml: layers=5: too many"
    assert SpecError("f", "x" * 1000, "why").message().endswith("...: why")
    assert "bits" in str(SpecError("f", 10**5000, "why"))  # beyond int -> str digits


def test_spec_error_pickles_whole():
    import pickle
    e = pickle.loads(pickle.dumps(SpecError("a", 1, "b", "f.toml")))
    assert (e.field, e.value, e.why, e.file, str(e)) == ("a", 1, "b", "f.toml", "f.toml: a=1: b")


# ----- the writer --------------------------------------------------------------------------------

def leftovers(d: Path, name: str) -> list[str]:
    return [p.name for p in d.iterdir() if p.name != name and name in p.name]


@SETTINGS
@given(old=st.one_of(st.none(), st.binary(max_size=64)), new=st.binary(max_size=4096),
       fail_at=st.one_of(st.none(), st.integers(0, 3)))
def test_write_atomic_old_or_whole_new(tmp_path_factory, old, new, fail_at):
    d = tmp_path_factory.mktemp("w")
    p = d / "out.bin"
    if old is not None:
        p.write_bytes(old)
    f = AtomicFile(p, binary=True)
    try:
        with f as out:
            for i in range(4):
                if i == fail_at:
                    raise KeyboardInterrupt
                out.write(new[i::4])
        assert p.read_bytes() == b"".join(new[i::4] for i in range(4))
    except KeyboardInterrupt:
        assert (p.read_bytes() if p.exists() else None) == old
    assert leftovers(d, "out.bin") == []


def test_write_errors_name_the_path_and_leave_nothing(tmp_path):
    with pytest.raises(SpecError, match="is a directory"):
        write_atomic(tmp_path, "x")
    with pytest.raises(SpecError, match="does not exist"):
        write_atomic(tmp_path / "no" / "x", "x")
    with pytest.raises(SpecError, match="cannot be encoded|NUL"):
        write_atomic("a\0b", "x")
    with pytest.raises(SpecError, match="not a regular file"):
        write_atomic("/dev/full", "x")


def test_file_size_limit_is_an_input_error_and_leaves_nothing(tmp_path):
    """EFBIG (RLIMIT_FSIZE) in a child process: one SpecError, the old file intact, no temporary."""
    p = tmp_path / "out.txt"
    p.write_text("old")
    code = (f"from perfmodel.util.files import write_atomic\n"
            f"try:\n    write_atomic({str(p)!r}, 'x' * 100000)\nexcept Exception as e:\n    print(type(e).__name__, e)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)))
    assert r.stdout.startswith("SpecError") and "File too large" in r.stdout, r.stdout + r.stderr
    assert p.read_text() == "old" and leftovers(tmp_path, "out.txt") == []


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small filesystem needs root")
def test_full_and_read_only_filesystems(tmp_path):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        (mnt / "a.txt").write_text("old")
        with pytest.raises(SpecError, match="No space left"):
            write_atomic(mnt / "a.txt", "x" * 200_000)
        with pytest.raises(SpecError, match="No space left"):
            write_all({mnt / "b.txt": "new", mnt / "a.txt": "y" * 200_000})
        assert (mnt / "a.txt").read_text() == "old" and sorted(os.listdir(mnt)) == ["a.txt"]
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        with pytest.raises(SpecError, match="Read-only"):
            write_atomic(mnt / "a.txt", "new")
    finally:
        subprocess.run(["umount", str(mnt)])


def test_write_all_is_all_or_none(tmp_path, monkeypatch):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("old a")
    write_all({a: "new a", b: "new b"})
    assert (a.read_text(), b.read_text()) == ("new a", "new b")
    commits = []
    real = AtomicFile.commit

    def second_fails(self):
        commits.append(self.path)
        if len(commits) == 2:
            self.discard()
            raise SpecError("--out", str(self.path), "cannot write: injected")
        return real(self)

    monkeypatch.setattr(AtomicFile, "commit", second_fails)
    with pytest.raises(SpecError, match="injected"):
        write_all({a: "newer a", b: "newer b", tmp_path / "c.txt": "c"})
    assert (a.read_text(), b.read_text()) == ("new a", "new b")  # the first rename was put back
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt"]


# ----- uploads -----------------------------------------------------------------------------------

@SETTINGS
@given(cell=st.one_of(st.text(max_size=8), st.integers(), st.floats(allow_nan=False), st.none()))
def test_neutral_cells_never_start_a_formula(cell):
    out = neutral(cell)
    if isinstance(cell, str):
        assert not out.startswith(("=", "+", "-", "@", "\t", "\r")) and out.lstrip("'") == cell.lstrip("'")
        assert out == cell or out == "'" + cell
    else:
        assert out is cell


def test_csv_text_bounds():
    assert csv_text(b"# c\na,b\n1,2\n", "u.csv") == "a,b\n1,2"
    with pytest.raises(SpecError, match="more than 3 rows"):
        csv_text(b"a\n" + b"1\n" * 4, "u.csv", max_rows=3)
    with pytest.raises(SpecError, match="larger than"):
        csv_text(b"a" * 2000, "u.csv", max_bytes=1000)
    with pytest.raises(SpecError, match="not UTF-8"):
        csv_text(b"\xff", "u.csv")


# ----- shipped data through the schema -----------------------------------------------------------

KERNEL_TABLE = {"gpu": (STR,), "engine": (STR,), "source": Req((STR,)), "licence": (STR,), "imported_by": (STR,),
                "units": (STR,), "system": None, "files": Req({"*": {"version": Req((STR,)), "*": None}}),
                "tables": Req(ListOf({"class": Req((STR,)), "file": Req((STR,)), "key": Req({"*": None}),
                                      "axes": Req({"*": ListOf(Num(0, lo_open=True), 1)}),
                                      "latency_us": Req(ListOf(Num(0, lo_open=True, null=True), 1)), "*": None}))}
KERNEL_FIT = {"engines": Req({"*": {"*": {"*": None}}}), "*": None}


def test_shipped_kernel_tables_and_fits_pass_their_schema():
    from perfmodel.cost.gpu_kernels import KERNEL_DIR
    files = sorted(KERNEL_DIR.glob("*/*.json"))
    assert files
    for f in files:
        doc = schema.load(f, KERNEL_FIT if f.name == "fit.json" else KERNEL_TABLE, "kernel table")
        for t in doc.get("tables", []):  # every axis has its values, the grid its cells
            assert math.prod(len(t["axes"][a]) for a in t["axes"]) == len(t["latency_us"]), (f, t["key"])


def test_shipped_inputs_load():
    from perfmodel.fit import microbench
    from perfmodel.spec import engines, hardware, loaders
    for f in sorted(microbench.DATA_DIR.glob("*.json")):
        assert microbench.load(f)["entries"]
    for name in engines.serving_engines():
        assert engines.inventory(name)
    for name in hardware.list_presets():
        hardware.load_hardware(name)
    from perfmodel.spec.arch import list_presets
    for name in list_presets():
        loaders.load_model(name)
