import pytest

from tasks.model_cache import build_once


def _build(calls):
    def build(out):
        calls.append(out)
        out.mkdir()
        (out / "config.json").write_text("{}")
        (out / "tokenizer.json").write_text("{}")
    return build


def test_builds_once_and_reuses(tmp_path):
    calls = []
    first = build_once(tmp_path, "m", _build(calls))
    again = build_once(tmp_path, "m", _build(calls))
    assert first == again == tmp_path / "m" and len(calls) == 1
    assert not (tmp_path / ".m.tmp").exists()


def test_leftovers_of_a_killed_build_are_rebuilt(tmp_path):
    (tmp_path / ".m.tmp").mkdir()                 # a build killed mid-way
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")  # incomplete: no tokenizer
    calls = []
    out = build_once(tmp_path, "m", _build(calls))
    assert len(calls) == 1 and (out / "tokenizer.json").exists()


def test_a_failing_build_leaves_nothing_that_looks_usable(tmp_path):
    def broken(out):
        out.mkdir()
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")
    with pytest.raises(RuntimeError, match="disk full"):
        build_once(tmp_path, "m", broken)
    assert not (tmp_path / "m").exists()
    calls = []
    build_once(tmp_path, "m", _build(calls))
    assert len(calls) == 1
