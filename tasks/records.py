"""Input files read row by row into ``RawRecord``s: JSON lines (plain or gzipped), a JSON array,
CSV and Parquet. Every row comes back, good or bad: a bad one carries its file, line and the
reason (invalid UTF-8, malformed JSON or CSV, not an object, an oversized line, an empty or
unreadable file), so a caller can quarantine it and go on. Ingest and the judge's validation
sets read files through here.
"""
from __future__ import annotations

import csv
import gzip
import io
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from data_specs.core import MAX_TEXT_CHARS

SUPPORTED_SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".csv", ".parquet")
MAX_LINE_BYTES = 4 * MAX_TEXT_CHARS


@dataclass
class RawRecord:
    file: str
    line: int | None
    data: dict | None = None
    raw: str = ""
    field: str | None = None
    reason: str | None = None


def _suffix(path: Path) -> str:
    name = path.name.lower()
    for s in SUPPORTED_SUFFIXES:
        if name.endswith(s):
            return s
    return path.suffix.lower()


def _decode(raw: bytes, file: str, line: int) -> tuple[str | None, RawRecord | None]:
    try:
        return raw.decode("utf-8"), None
    except UnicodeDecodeError as e:
        return None, RawRecord(file, line, raw=raw[:2000].decode("utf-8", "replace"),
                               reason=f"invalid_utf8: byte {e.start}")


def _read_jsonl(path: Path, opener) -> Iterator[RawRecord]:
    file = str(path)
    with opener(path, "rb") as fh:
        for i, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            if len(raw) > MAX_LINE_BYTES:
                yield RawRecord(file, i, raw=raw[:2000].decode("utf-8", "replace"),
                                reason=f"oversized_line: {len(raw)} bytes > {MAX_LINE_BYTES}")
                continue
            text, bad = _decode(raw.rstrip(b"\r\n"), file, i)
            if bad:
                yield bad
                continue
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                yield RawRecord(file, i, raw=text[:2000], reason=f"malformed_json: {e.msg} at column {e.colno}")
                continue
            if not isinstance(data, dict):
                yield RawRecord(file, i, raw=text[:2000], reason=f"not_an_object: got {type(data).__name__}")
                continue
            yield RawRecord(file, i, data=data, raw=text[:2000])


def _read_json_array(path: Path) -> Iterator[RawRecord]:
    file = str(path)
    raw = path.read_bytes()
    text, bad = _decode(raw, file, 1)
    if bad:
        yield bad
        return
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        # not one JSON document: treat as JSON lines
        if e.msg == "Extra data":
            yield from _read_jsonl(path, open)
        else:
            yield RawRecord(file, e.lineno, raw=text[:2000], reason=f"malformed_json: {e.msg} at column {e.colno}")
        return
    items = data if isinstance(data, list) else [data]
    for i, item in enumerate(items, start=1):
        if isinstance(item, dict):
            yield RawRecord(file, i, data=item, raw=json.dumps(item)[:2000])
        else:
            yield RawRecord(file, i, raw=json.dumps(item)[:2000], reason=f"not_an_object: got {type(item).__name__}")


def _read_csv(path: Path) -> Iterator[RawRecord]:
    file = str(path)
    raw = path.read_bytes()
    lines = raw.splitlines(keepends=True)
    if not lines:
        return
    header_text, bad = _decode(lines[0], file, 1)
    if bad:
        yield bad
        return
    header = next(csv.reader([header_text]))
    for i, raw_line in enumerate(lines[1:], start=2):
        if not raw_line.strip():
            continue
        text, bad = _decode(raw_line, file, i)
        if bad:
            yield bad
            continue
        try:
            values = next(csv.reader(io.StringIO(text), strict=True))
        except csv.Error as e:
            yield RawRecord(file, i, raw=text[:2000], reason=f"malformed_csv: {e}")
            continue
        if len(values) != len(header):
            yield RawRecord(file, i, raw=text[:2000],
                            reason=f"malformed_csv: {len(values)} fields, header has {len(header)}")
            continue
        yield RawRecord(file, i, data=dict(zip(header, values)), raw=text[:2000])


def _read_parquet(path: Path) -> Iterator[RawRecord]:
    file = str(path)
    try:
        df = pl.read_parquet(path)
    except Exception as e:  # noqa: BLE001 - a corrupt file is one bad input, not a crash
        yield RawRecord(file, None, reason=f"unreadable_parquet: {type(e).__name__}: {e}"[:500])
        return
    for i, row in enumerate(df.iter_rows(named=True), start=1):
        yield RawRecord(file, i, data=row, raw=json.dumps(row, default=str)[:2000])


def read_records(path: str | Path) -> Iterator[RawRecord]:
    """Every row of a JSONL / JSON / CSV / Parquet file as a RawRecord (bad rows flagged)."""
    path = Path(path)
    suffix = _suffix(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file")
    if path.stat().st_size == 0:
        yield RawRecord(str(path), None, reason="empty_file")
        return
    count = 0
    if suffix == ".jsonl":
        it = _read_jsonl(path, open)
    elif suffix == ".jsonl.gz":
        it = _read_jsonl(path, gzip.open)
    elif suffix == ".json":
        it = _read_json_array(path)
    elif suffix == ".csv":
        it = _read_csv(path)
    elif suffix == ".parquet":
        it = _read_parquet(path)
    else:
        raise ValueError(f"{path}: unsupported file type {suffix!r}; use one of {SUPPORTED_SUFFIXES}")
    for rec in it:
        count += 1
        yield rec
    if count == 0:
        yield RawRecord(str(path), None, reason="empty_file: no rows")


def expand_paths(paths: Iterable[str | Path]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            out.extend(sorted(f for f in p.rglob("*") if f.is_file() and _suffix(f) in SUPPORTED_SUFFIXES))
        else:
            out.append(p)
    return out
