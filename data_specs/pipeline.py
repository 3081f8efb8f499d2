"""Bookkeeping of pipeline stage runs, used to skip stages whose inputs did not change."""
from __future__ import annotations

import polars as pl

from data_specs.base import Column, TableSpec, register

STAGE_RUNS = register(TableSpec(
    "stage_runs", version=1,
    description="One row per executed pipeline stage: its cache key, and the tables it read and wrote "
                "as the warehouse recorded them while it ran.",
    columns=[
        Column("stage", pl.Utf8, required=True),
        Column("cache_key", pl.Utf8, required=True,
               description="hash of the stage's config sections, upstream keys and package versions"),
        Column("inputs", pl.Utf8, required=True,
               description="JSON list of table references ({name, snapshot, rows, content_hash}): each table it "
                           "consulted, at the snapshot it read (snapshot none: the table did not exist)"),
        Column("outputs", pl.Utf8, required=True,
               description="JSON map table -> list of table references (as in inputs) it wrote, oldest first"),
        Column("config_hash", pl.Utf8, required=True),
        Column("mlflow_run_id", pl.Utf8),
        Column("summary", pl.Utf8, description="JSON summary the stage returned"),
        Column("seconds", pl.Float64),
    ],
))
