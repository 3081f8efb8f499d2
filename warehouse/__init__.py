"""The catalog and table store: DuckDB catalog, Parquet snapshots, lineage."""
from warehouse.paths import posttrain_home
from warehouse.store import (
           WRITER_ENV,
           TableRef,
           Warehouse,
           WarehouseError,
           current_writer,
           frame_digest,
           recording_flow_run,
           recording_tables,
           recording_writer,
)

__all__ = ["WRITER_ENV", "TableRef", "Warehouse", "WarehouseError", "current_writer", "frame_digest",
           "posttrain_home", "recording_flow_run", "recording_tables", "recording_writer"]
