"""Bookkeeping of pipeline stage runs, used to skip stages whose inputs did not change."""
from __future__ import annotations

import polars as pl

from data_specs.base import Column, TableSpec, register

STAGE_RUNS = register(TableSpec(
    "stage_runs", version=1,
    description="One row per executed pipeline stage: its cache key, inputs and outputs.",
    columns=[
        Column("stage", pl.Utf8, required=True),
        Column("cache_key", pl.Utf8, required=True, description="hash of input snapshots and config"),
        Column("inputs", pl.Utf8, required=True, description="JSON list of name@snapshot"),
        Column("outputs", pl.Utf8, required=True, description="JSON map table -> name@snapshot"),
        Column("config_hash", pl.Utf8, required=True),
        Column("mlflow_run_id", pl.Utf8),
        Column("summary", pl.Utf8, description="JSON summary the stage returned"),
        Column("seconds", pl.Float64),
    ],
))
