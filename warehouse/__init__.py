"""The catalog and table store: DuckDB catalog, Parquet snapshots, lineage."""
from warehouse.paths import posttrain_home
from warehouse.store import (
           TableRef,
           Warehouse,
           WarehouseError,
           frame_digest,
           recording_flow_run,
           recording_tables,
)

__all__ = ["TableRef", "Warehouse", "WarehouseError", "frame_digest", "posttrain_home", "recording_flow_run",
           "recording_tables"]
