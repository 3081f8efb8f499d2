"""The catalog and table store: DuckDB catalog, Parquet snapshots, lineage.

The store's names load on first use (PEP 562), so code that needs only ``warehouse.paths``
(the rollout engine, a model cache, a GPU machine without DuckDB or Polars) does not import
DuckDB and Polars.
"""
from __future__ import annotations

import importlib

from warehouse.paths import posttrain_home

_STORE_NAMES = ("WRITER_ENV", "TableRef", "Warehouse", "WarehouseError", "current_writer", "frame_digest",
                "note_standing_output", "recording_flow_run", "recording_tables", "recording_writer")

__all__ = ["WRITER_ENV", "TableRef", "Warehouse", "WarehouseError", "current_writer", "frame_digest",
           "note_standing_output", "posttrain_home", "recording_flow_run", "recording_tables", "recording_writer"]


def __getattr__(name: str):
    if name in _STORE_NAMES:
        return getattr(importlib.import_module("warehouse.store"), name)
    raise AttributeError(f"module 'warehouse' has no attribute {name!r}")
