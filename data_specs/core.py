"""The foundation tables shared by every flow."""
from __future__ import annotations

import polars as pl

from data_specs.base import Column, TableSpec, register

DOMAINS = ("math", "logic", "code", "general", "science", "instruction")
MAX_TEXT_CHARS = 200_000  # one field larger than this is an ingest error, not a prompt

PROMPTS = register(TableSpec(
    "prompts", version=1, key=("id",),
    description="Every ingested problem with its source, domain, reference answer and tests.",
    columns=[
        Column("id", pl.Utf8, required=True, description="stable id: hash of source and normalized prompt"),
        Column("source", pl.Utf8, required=True),
        Column("domain", pl.Utf8, required=True, allowed=DOMAINS),
        Column("prompt", pl.Utf8, required=True, max_length=MAX_TEXT_CHARS),
        Column("answer", pl.Utf8, max_length=MAX_TEXT_CHARS),
        Column("solution", pl.Utf8, max_length=MAX_TEXT_CHARS),
        Column("tests", pl.Utf8, max_length=MAX_TEXT_CHARS, description="executable tests (code)"),
        Column("metadata", pl.Utf8, description="JSON object"),
        Column("content_hash", pl.Utf8, required=True, description="sha256 of prompt+answer"),
        Column("file", pl.Utf8),
        Column("line", pl.Int64),
        Column("ingest_run", pl.Utf8),
    ],
))

BENCHMARKS = register(TableSpec(
    "benchmarks", version=1, key=("benchmark", "item_id"),
    description="Evaluation items used for decontamination and evaluation.",
    columns=[
        Column("benchmark", pl.Utf8, required=True),
        Column("item_id", pl.Utf8, required=True),
        Column("text", pl.Utf8, required=True, max_length=MAX_TEXT_CHARS),
        Column("answer", pl.Utf8, max_length=MAX_TEXT_CHARS),
        Column("tests", pl.Utf8, max_length=MAX_TEXT_CHARS),
        Column("entry_point", pl.Utf8),
        Column("domain", pl.Utf8, required=True, allowed=DOMAINS),
        Column("metadata", pl.Utf8),
    ],
))

QUARANTINE = register(TableSpec(
    "quarantine", version=1,
    description="Bad input rows: where they came from and why they were refused.",
    columns=[
        Column("source", pl.Utf8, required=True),
        Column("file", pl.Utf8, required=True),
        Column("line", pl.Int64),
        Column("field", pl.Utf8),
        Column("reason", pl.Utf8, required=True),
        Column("raw", pl.Utf8),
        Column("run_id", pl.Utf8),
    ],
))

DECISIONS = register(TableSpec(
    "decisions", version=1,
    description="One row per row a filtering stage removed, with its reason and the row it matched.",
    columns=[
        Column("row_id", pl.Utf8, required=True),
        Column("stage", pl.Utf8, required=True),
        Column("decision", pl.Utf8, required=True, allowed=("removed", "rewritten", "kept")),
        Column("reason", pl.Utf8, required=True),
        Column("reference_id", pl.Utf8),
        Column("score", pl.Float64),
        Column("run_id", pl.Utf8),
    ],
))
