"""Table specs: column names and types, required fields, constraints, a schema version.

A spec validates a polars frame and splits it into the rows that conform and the rows
that do not, each rejected row carrying the offending field and a reason.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

import polars as pl

NAME_PATTERN = re.compile(r"^[a-z][a-z0-9_]{0,62}$")
MAX_NAME_LENGTH = 63


class SpecError(ValueError):
    """A frame cannot be made to fit a spec (missing column, incompatible type)."""


def validate_name(name: str, kind: str = "table") -> str:
    """Table, source and column names: lowercase identifiers, nothing a path or SQL can abuse."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"{kind} name must be a non-empty string")
    if len(name) > MAX_NAME_LENGTH:
        raise ValueError(f"{kind} name {name[:20]!r}... is longer than {MAX_NAME_LENGTH} characters")
    if not NAME_PATTERN.match(name):
        raise ValueError(
            f"invalid {kind} name {name!r}: use lowercase letters, digits and '_', starting with a letter"
        )
    return name


@dataclass(frozen=True)
class Column:
    name: str
    dtype: pl.DataType | type
    required: bool = False          # must be present and non-null (and non-empty for strings)
    allowed: tuple | None = None    # closed set of values
    max_length: int | None = None   # for strings: characters
    check: Callable[[pl.Expr], pl.Expr] | None = None  # extra constraint: True where valid
    check_reason: str = "constraint_failed"
    description: str = ""


@dataclass
class TableSpec:
    name: str
    version: int
    columns: list[Column]
    description: str = ""
    key: tuple[str, ...] = ()
    _by_name: dict[str, Column] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        validate_name(self.name)
        self._by_name = {c.name: c for c in self.columns}

    @property
    def schema(self) -> dict[str, pl.DataType]:
        return {c.name: c.dtype for c in self.columns}

    @property
    def column_names(self) -> list[str]:
        return [c.name for c in self.columns]

    def empty(self) -> pl.DataFrame:
        return pl.DataFrame(schema=self.schema)

    def conform(self, df: pl.DataFrame) -> pl.DataFrame:
        """Select spec columns in order, add missing optional ones as nulls, cast types."""
        missing = [c.name for c in self.columns if c.required and c.name not in df.columns]
        if missing:
            raise SpecError(f"table {self.name!r}: missing required column(s) {missing}")
        exprs = []
        for c in self.columns:
            if c.name in df.columns:
                exprs.append(pl.col(c.name).cast(c.dtype, strict=False).alias(c.name))
            else:
                exprs.append(pl.lit(None, dtype=c.dtype).alias(c.name))
        # strict=False turns uncastable values into nulls; validate() reports them
        return df.select(exprs)

    def _violations(self, df: pl.DataFrame, conformed: pl.DataFrame) -> list[tuple[str, str, pl.Series]]:
        """(field, reason, mask of violating rows) for each rule, in order of precedence."""
        out: list[tuple[str, str, pl.Series]] = []
        for c in self.columns:
            col = conformed.get_column(c.name)
            if c.name in df.columns:
                src = df.get_column(c.name)
                # a value that was present but became null in the cast has the wrong type
                bad_type = src.is_not_null() & col.is_null()
                if bad_type.any():
                    out.append((c.name, f"wrong_type: expected {c.dtype}", bad_type))
            if c.required:
                missing = col.is_null()
                if col.dtype == pl.Utf8:
                    missing = missing | (col.str.strip_chars().str.len_chars() == 0)
                out.append((c.name, "missing_required_field", missing.fill_null(True)))
            if c.allowed is not None:
                out.append((c.name, f"not_allowed: must be one of {list(c.allowed)}",
                            (col.is_not_null() & ~col.is_in(list(c.allowed))).fill_null(False)))
            if c.max_length is not None and col.dtype == pl.Utf8:
                out.append((c.name, f"too_long: over {c.max_length} characters",
                            (col.str.len_chars() > c.max_length).fill_null(False)))
            if c.check is not None:
                ok = conformed.select(c.check(pl.col(c.name)).alias("ok")).get_column("ok")
                out.append((c.name, c.check_reason, (~ok.fill_null(True)).fill_null(False)))
        return out

    def validate(self, df: pl.DataFrame) -> tuple[pl.DataFrame, pl.DataFrame]:
        """Split into (valid rows conformed to the spec, rejected rows).

        Rejected rows keep their original columns plus ``field`` and ``reason`` (the first
        rule each row broke). valid + rejected always equals the input row count.
        """
        conformed = self.conform(df)
        n = df.height
        reason = pl.Series("reason", [None] * n, dtype=pl.Utf8)
        fieldname = pl.Series("field", [None] * n, dtype=pl.Utf8)
        for fld, why, mask in self._violations(df, conformed):
            take = mask & reason.is_null()
            if take.any():
                reason = pl.select(pl.when(take).then(pl.lit(why)).otherwise(reason)).to_series()
                fieldname = pl.select(pl.when(take).then(pl.lit(fld)).otherwise(fieldname)).to_series()
        bad = reason.is_not_null()
        valid = conformed.filter(~bad)
        rejected = df.with_columns(fieldname.alias("field"), reason.alias("reason")).filter(bad)
        return valid, rejected


_REGISTRY: dict[str, TableSpec] = {}


def register(spec: TableSpec) -> TableSpec:
    existing = _REGISTRY.get(spec.name)
    if existing is not None and existing is not spec and existing.version != spec.version:
        raise SpecError(f"table {spec.name!r} registered twice with versions {existing.version} and {spec.version}")
    _REGISTRY[spec.name] = spec
    return spec


def get_spec(name: str) -> TableSpec | None:
    return _REGISTRY.get(name)


def all_specs() -> dict[str, TableSpec]:
    return dict(_REGISTRY)
