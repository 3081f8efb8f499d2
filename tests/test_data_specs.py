import polars as pl
import pytest

from data_specs import SpecError, get_spec, validate_name
from data_specs.base import Column, TableSpec


@pytest.mark.parametrize("bad", ["../x", "a;drop table", "", "x" * 64, "A", "1abc", "a b", "a/b", "a'b", "a-b"])
def test_name_validation_refuses_bad_names(bad):
    with pytest.raises(ValueError):
        validate_name(bad)


@pytest.mark.parametrize("good", ["prompts", "sft_pool", "a", "x" * 63, "t2"])
def test_name_validation_accepts_identifiers(good):
    assert validate_name(good) == good


def test_core_specs_registered():
    for name in ("prompts", "benchmarks", "quarantine", "decisions"):
        spec = get_spec(name)
        assert spec is not None and spec.version >= 1
    assert "content_hash" in get_spec("prompts").column_names


def test_validate_splits_rows_with_reasons():
    spec = TableSpec("t_demo", 1, [
        Column("id", pl.Utf8, required=True),
        Column("n", pl.Int64),
        Column("kind", pl.Utf8, allowed=("a", "b")),
        Column("text", pl.Utf8, max_length=5),
        Column("score", pl.Float64, check=lambda c: c.is_between(0, 1), check_reason="out_of_range"),
    ])
    df = pl.DataFrame({
        "id": ["1", "", None, "4", "5", "6", "7"],
        "n": ["1", "2", "3", "x", "5", "6", "7"],
        "kind": ["a", "a", "a", "a", "z", "b", "b"],
        "text": ["ok", "ok", "ok", "ok", "ok", "toolong", "ok"],
        "score": [0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 2.0],
    })
    valid, rejected = spec.validate(df)
    assert valid.height + rejected.height == df.height
    assert valid["id"].to_list() == ["1"]
    assert valid.schema["n"] == pl.Int64
    reasons = dict(zip(rejected["id"].fill_null("<null>").to_list(), rejected["reason"].to_list()))
    assert reasons[""] == "missing_required_field"
    assert reasons["<null>"] == "missing_required_field"
    assert reasons["4"].startswith("wrong_type")
    assert reasons["5"].startswith("not_allowed")
    assert reasons["6"].startswith("too_long")
    assert reasons["7"] == "out_of_range"
    assert dict(zip(rejected["id"].fill_null("<null>").to_list(), rejected["field"].to_list()))["4"] == "n"


def test_conform_requires_required_columns():
    with pytest.raises(SpecError, match="missing required"):
        get_spec("decisions").conform(pl.DataFrame({"row_id": ["a"]}))
