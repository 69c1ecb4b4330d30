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
