"""The full pipeline: every stage flow as a subflow under one parent MLflow run."""
from __future__ import annotations

import time
from typing import Any, Callable

from prefect import flow

from flows.common import flow_context, flow_logger, report_progress
from flows.ingest import ingest_flow

# Stage name -> callable(profile, home) -> summary dict, in DAG order.
StageFn = Callable[[str, str | None], dict]


def _ingest(profile: str, home: str | None) -> dict:
    return ingest_flow(bundled=True, profile=profile, home=home)


STAGES: dict[str, StageFn] = {
    "ingest": _ingest,
}


def stage_names() -> list[str]:
    return list(STAGES)


@flow(name="pipeline", log_prints=True)
def pipeline_flow(profile: str = "tiny", stages: list[str] | None = None, home: str | None = None) -> dict[str, Any]:
    """Run the chosen stages (all by default) in DAG order."""
    log = flow_logger()
    chosen = stages or stage_names()
    unknown = [s for s in chosen if s not in STAGES]
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; known: {stage_names()}")
    results: dict[str, Any] = {}
    with flow_context("pipeline", profile, home, {"stages": chosen}) as ctx:
        for name in stage_names():
            if name not in chosen:
                continue
            report_progress(name, "start")
            t0 = time.time()
            results[name] = STAGES[name](profile, home)
            log.info("stage %s finished in %.1fs", name, time.time() - t0)
            report_progress(name, "done")
        results["mlflow_run_id"] = ctx.run_id
        results["tables"] = {r["name"]: r["rows"] for r in ctx.wh.tables().iter_rows(named=True)}
    return results
