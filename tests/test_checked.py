"""Checks of bundled data remembered across processes (perfmodel.util.checked)."""
import pytest

from perfmodel.util import checked


def test_content_that_passed_is_not_checked_again_and_changed_content_is(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    f = tmp_path / "table.json"
    f.write_text('{"a": 1}')
    calls = []
    checked.once(checked.content(f.read_bytes()), "class gemm", lambda: calls.append(1))
    checked.once(checked.content(f.read_bytes()), "class gemm", lambda: calls.append(2))
    assert calls == [1]
    checked.once(checked.content(f.read_bytes()), "class moe", lambda: calls.append(3))   # another check of the same bytes
    f.write_text('{"a": 2}')                                                  # same size, other bytes
    checked.once(checked.content(f.read_bytes()), "class gemm", lambda: calls.append(4))
    assert calls == [1, 3, 4]


def test_a_failed_check_is_not_remembered(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    f = tmp_path / "table.json"
    f.write_text("bad")

    def bad():
        raise ValueError("bad data")
    for _ in range(2):
        with pytest.raises(ValueError, match="bad data"):
            checked.once(checked.content(f.read_bytes()), "class gemm", bad)


def test_an_unwritable_cache_or_unnamed_content_checks_every_time(tmp_path, monkeypatch):
    (tmp_path / "cache").write_text("a file where the cache directory would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    f = tmp_path / "table.json"
    f.write_text("{}")
    calls = []
    for i in range(2):
        checked.once(checked.content(f.read_bytes()), "class gemm", lambda i=i: calls.append(i))
    assert calls == [0, 1]
    for i in range(2):   # a caller that names no content
        checked.once(None, "class gemm", lambda i=i: calls.append(i))
    assert calls == [0, 1, 0, 1]


def test_a_kept_value_is_made_once_per_content_and_reader(tmp_path, monkeypatch):
    """`kept` returns what `make` returned for the same content before, without calling it; other
    content, a changed reader (its module's source), a corrupt entry or a value marshal cannot
    hold make it again; a failing make is not kept."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    calls = []

    def make(v):
        def f():
            calls.append(v)
            return {"rows": [(1, 2.5, "a")], "v": v}
        return f
    cid = checked.content(b"table bytes")
    assert checked.kept(cid, "parse", make(1)) == {"rows": [(1, 2.5, "a")], "v": 1}
    assert checked.kept(cid, "parse", make(2))["v"] == 1 and calls == [1]        # kept
    assert checked.kept(checked.content(b"other"), "parse", make(3))["v"] == 3    # other content
    monkeypatch.setattr(checked, "_source", lambda module: "an edited reader")
    assert checked.kept(cid, "parse", make(4))["v"] == 4 and calls == [1, 3, 4]   # made again in its place
    entry = checked._marker(cid, "kept parse")
    with open(entry, "wb") as f:
        f.write(b"\x00not marshal")
    assert checked.kept(cid, "parse", make(5))["v"] == 5                          # corrupt: made again

    def bad():
        raise ValueError("bad data")
    other = checked.content(b"bad bytes")
    for _ in range(2):
        with pytest.raises(ValueError, match="bad data"):
            checked.kept(other, "parse", bad)
    obj = object()
    assert checked.kept(checked.content(b"x"), "parse", lambda: obj) is obj        # not plain data: not kept
    assert checked.kept(checked.content(b"x"), "parse", lambda: 7) == 7


def test_an_unwritable_cache_makes_a_kept_value_every_time(tmp_path, monkeypatch):
    (tmp_path / "cache").write_text("a file where the cache directory would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    calls = []
    for i in range(2):
        assert checked.kept(checked.content(b"t"), "parse", lambda i=i: calls.append(i) or i) == i
    assert calls == [0, 1]
