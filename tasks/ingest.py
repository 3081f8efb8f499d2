"""Ingest: files and bundled offline sources into ``prompts`` and ``benchmarks``.

Every input row ends in exactly one place: stored (new), already present (the same
content was ingested before), or ``quarantine`` with file, line, field and reason.
Bad rows never stop a run.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
from pydantic import BaseModel, ConfigDict

from data_specs import get_spec, validate_name
from data_specs.core import DOMAINS, MAX_TEXT_CHARS
from tasks.records import SUPPORTED_SUFFIXES, RawRecord, expand_paths, read_records
from tasks.text import collapse_text, stable_id
from warehouse import TableRef, Warehouse

BUNDLED_SOURCES = ("mmath", "humaneval", "champ", "reasoning_gym", "open_prompts")

# Accepted spellings of each field in user files, first match wins.
FIELD_ALIASES: dict[str, tuple[str, ...]] = {
    "prompt": ("prompt", "question", "problem", "text", "input", "instruction"),
    "answer": ("answer", "final_answer", "gold", "target", "output"),
    "solution": ("solution", "rationale", "explanation", "canonical_solution"),
    "tests": ("tests", "test", "test_cases"),
    "domain": ("domain",),
    "item_id": ("item_id", "id", "task_id", "uid"),
    "entry_point": ("entry_point",),
}


class IngestConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    bundled: list[str] = list(BUNDLED_SOURCES)
    reasoning_gym_tasks: list[str] = ["basic_arithmetic", "chain_sum", "leg_counting"]
    reasoning_gym_per_task: int = 20
    max_field_chars: int = MAX_TEXT_CHARS


@dataclass
class IngestReport:
    source: str
    rows_in: int = 0
    stored: dict[str, int] = field(default_factory=dict)        # table -> new rows
    already_present: int = 0
    quarantined: int = 0
    quarantine_reasons: dict[str, int] = field(default_factory=dict)
    refs: dict[str, TableRef] = field(default_factory=dict)

    @property
    def accounted(self) -> bool:
        return self.rows_in == sum(self.stored.values()) + self.already_present + self.quarantined

    def merge(self, other: IngestReport) -> IngestReport:
        self.rows_in += other.rows_in
        self.already_present += other.already_present
        self.quarantined += other.quarantined
        for k, v in other.stored.items():
            self.stored[k] = self.stored.get(k, 0) + v
        for k, v in other.quarantine_reasons.items():
            self.quarantine_reasons[k] = self.quarantine_reasons.get(k, 0) + v
        self.refs.update(other.refs)
        return self

    def as_counters(self) -> dict[str, float]:
        out = {"rows_in": self.rows_in, "already_present": self.already_present, "quarantined": self.quarantined}
        out.update({f"stored_{k}": v for k, v in self.stored.items()})
        return out


# -- identity ---------------------------------------------------------------------------
def content_hash(prompt: str, answer: str | None) -> str:
    return hashlib.sha256(f"{collapse_text(prompt)}\x1f{collapse_text(answer or '')}".encode()).hexdigest()


# -- records to rows --------------------------------------------------------------------
def _pick(data: dict, name: str, mapping: dict[str, str]) -> tuple[str | None, Any]:
    keys = (mapping[name],) if name in mapping else FIELD_ALIASES.get(name, (name,))
    for k in keys:
        if k in data and data[k] is not None:
            return k, data[k]
    return None, None


def _as_text(key: str, value: Any, *, numbers_ok: bool) -> str:
    if isinstance(value, str):
        return value
    if numbers_ok and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if key == "tests" and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    raise TypeError(f"wrong_type: expected string, got {type(value).__name__}")


class RowError(ValueError):
    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


def record_to_prompt(rec: RawRecord, source: str, domain: str | None, mapping: dict[str, str],
                     max_chars: int, run_id: str | None) -> dict:
    data = rec.data or {}
    row: dict[str, Any] = {}
    used: set[str] = set()
    for name, numbers_ok in (("prompt", False), ("answer", True), ("solution", False), ("tests", False)):
        key, value = _pick(data, name, mapping)
        if key is None:
            row[name] = None
            continue
        used.add(key)
        try:
            row[name] = _as_text(name, value, numbers_ok=numbers_ok)
        except TypeError as e:
            raise RowError(key, str(e)) from None
        if len(row[name]) > max_chars:
            raise RowError(key, f"oversized_field: {len(row[name])} characters > {max_chars}")
    dkey, dval = _pick(data, "domain", mapping)
    used.add(dkey or "")
    row["domain"] = (dval if isinstance(dval, str) else None) or domain
    if row["domain"] not in DOMAINS:
        raise RowError("domain", f"not_allowed: {row['domain']!r} is not one of {list(DOMAINS)}")
    if not row["prompt"] or not row["prompt"].strip():
        raise RowError(mapping.get("prompt", "prompt"), "missing_required_field")
    extra = {k: v for k, v in data.items() if k not in used and k != "metadata"}
    meta = data.get("metadata")
    if isinstance(meta, str):
        try:
            meta = json.loads(meta)
        except json.JSONDecodeError:
            meta = {"metadata": meta}
    if meta is not None and not isinstance(meta, dict):
        raise RowError("metadata", f"wrong_type: expected object, got {type(meta).__name__}")
    row["metadata"] = json.dumps({**extra, **(meta or {})}, default=str, sort_keys=True)
    row["source"] = source
    row["id"] = stable_id(source, collapse_text(row["prompt"]), collapse_text(row["answer"] or ""))
    row["content_hash"] = content_hash(row["prompt"], row["answer"])
    row["file"], row["line"], row["ingest_run"] = rec.file, rec.line, run_id
    return row


def record_to_benchmark(rec: RawRecord, benchmark: str, domain: str | None, mapping: dict[str, str],
                        max_chars: int, ordinal: int) -> dict:
    row = record_to_prompt(rec, benchmark, domain, mapping, max_chars, None)
    _key, item_id = _pick(rec.data or {}, "item_id", mapping)
    return {
        "benchmark": benchmark,
        "item_id": str(item_id) if item_id is not None else f"{ordinal}",
        "text": row["prompt"], "answer": row["answer"], "tests": row["tests"],
        "entry_point": str((rec.data or {}).get("entry_point") or "") or None,
        "domain": row["domain"], "metadata": row["metadata"],
    }


# -- writing ----------------------------------------------------------------------------
def _quarantine_rows(source: str, rejects: list[RawRecord], run_id: str | None) -> pl.DataFrame:
    return pl.DataFrame(
        [{"source": source, "file": r.file, "line": r.line, "field": r.field, "reason": r.reason,
          "raw": r.raw, "run_id": run_id} for r in rejects],
        schema=get_spec("quarantine").schema,
    )


def store_records(
    wh: Warehouse,
    records: Iterable[RawRecord],
    source: str,
    *,
    kind: str = "prompts",
    domain: str | None = None,
    mapping: dict[str, str] | None = None,
    max_chars: int = MAX_TEXT_CHARS,
    run_id: str | None = None,
) -> IngestReport:
    """Turn records into rows of ``prompts`` or ``benchmarks``; quarantine the rest."""
    validate_name(source, "source")
    if kind not in ("prompts", "benchmarks"):
        raise ValueError(f"kind must be 'prompts' or 'benchmarks', not {kind!r}")
    mapping = mapping or {}
    report = IngestReport(source)
    good: list[dict] = []
    good_recs: list[RawRecord] = []
    rejects: list[RawRecord] = []
    for rec in records:
        report.rows_in += 1
        if rec.reason:
            rejects.append(rec)
            continue
        try:
            if kind == "prompts":
                good.append(record_to_prompt(rec, source, domain, mapping, max_chars, run_id))
            else:
                good.append(record_to_benchmark(rec, source, domain, mapping, max_chars, len(good) + 1))
            good_recs.append(rec)
        except RowError as e:
            rec.field, rec.reason = e.field, e.reason
            rejects.append(rec)
    spec = get_spec(kind)
    frame = pl.DataFrame(good, schema=spec.schema) if good else spec.empty()
    valid, rejected = spec.validate(frame.with_row_index("_i"))
    for r in rejected.iter_rows(named=True):
        rec = good_recs[r["_i"]]
        rec.field, rec.reason = r["field"], r["reason"]
        rejects.append(rec)
    valid = spec.conform(valid)
    # identical rows (same key) are stored once: later copies count as already present
    key = list(spec.key)
    before = valid.height
    valid = valid.unique(subset=key, keep="first", maintain_order=True)
    report.already_present += before - valid.height
    if wh.exists(kind) and valid.height:
        existing = wh.scan(kind).select(key).collect()
        fresh = valid.join(existing, on=key, how="anti")
        report.already_present += valid.height - fresh.height
        valid = fresh
    if valid.height:
        report.refs[kind] = wh.append(kind, valid, note=f"ingest {source}")
    report.stored[kind] = valid.height
    report.quarantined = len(rejects)
    for r in rejects:
        code = (r.reason or "unknown").split(":")[0]
        report.quarantine_reasons[code] = report.quarantine_reasons.get(code, 0) + 1
    if rejects:
        report.refs["quarantine"] = wh.append("quarantine", _quarantine_rows(source, rejects, run_id),
                                              note=f"ingest {source}")
    return report


def ingest_files(wh: Warehouse, paths: Iterable[str | Path], source: str, *, kind: str = "prompts",
                 domain: str | None = None, mapping: dict[str, str] | None = None,
                 max_chars: int = MAX_TEXT_CHARS, run_id: str | None = None) -> IngestReport:
    files = expand_paths(paths)
    if not files:
        raise FileNotFoundError(f"no {', '.join(SUPPORTED_SUFFIXES)} files under {list(map(str, paths))}")

    def all_records() -> Iterator[RawRecord]:
        for f in files:
            yield from read_records(f)

    return store_records(wh, all_records(), source, kind=kind, domain=domain, mapping=mapping,
                         max_chars=max_chars, run_id=run_id)
