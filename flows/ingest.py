"""The ``ingest`` flow: user files and bundled offline sources into the warehouse."""
from __future__ import annotations

from prefect import flow, task

from flows.common import flow_context, flow_logger, report_progress
from tasks import sources, tracking
from tasks.ingest import BUNDLED_SOURCES, IngestConfig, IngestReport, ingest_files, store_records
from warehouse import Warehouse


@task(name="ingest-files")
def ingest_files_task(home: str, paths: list[str], source: str, kind: str, domain: str | None,
                      mapping: dict[str, str] | None, max_chars: int, run_id: str | None) -> IngestReport:
    return ingest_files(Warehouse(home), paths, source, kind=kind, domain=domain, mapping=mapping,
                        max_chars=max_chars, run_id=run_id)


@task(name="ingest-bundled")
def ingest_bundled_task(home: str, name: str, cfg: IngestConfig, seed: int, run_id: str | None) -> IngestReport:
    wh = Warehouse(home)
    if name == "mmath":
        report = IngestReport("mmath")
        for bench, recs in sources.mmath_records().items():
            report.merge(store_records(wh, recs, bench, kind="benchmarks", run_id=run_id))
        return report
    if name == "humaneval":
        return store_records(wh, sources.humaneval_records(), "humaneval", kind="benchmarks", run_id=run_id)
    if name == "champ":
        return store_records(wh, sources.champ_records(), "champ", kind="prompts", run_id=run_id)
    if name == "reasoning_gym":
        recs = sources.reasoning_gym_records(cfg.reasoning_gym_tasks, cfg.reasoning_gym_per_task, seed)
        return store_records(wh, recs, "reasoning_gym", kind="prompts", run_id=run_id)
    if name == "open_prompts":
        return store_records(wh, sources.open_prompt_records(), "open_prompts", kind="prompts", run_id=run_id)
    raise ValueError(f"unknown bundled source {name!r}; known: {list(BUNDLED_SOURCES)}")


@flow(name="ingest", log_prints=True, flow_run_name="ingest")
def ingest_flow(
    paths: list[str] | None = None,
    source: str | None = None,
    kind: str = "prompts",
    domain: str | None = None,
    bundled: bool = False,
    mapping: dict[str, str] | None = None,
    profile: str = "tiny",
    home: str | None = None,
) -> dict:
    """Load files (JSONL/JSON/CSV/Parquet) and/or the bundled sources; quarantine bad rows."""
    log = flow_logger()
    report_progress("ingest", "start")
    params = {"paths": paths or [], "source": source, "kind": kind, "domain": domain, "bundled": bundled}
    with flow_context("ingest", profile, home, params, sections=("ingest",)) as ctx:
        cfg = ctx.profile.section("ingest", IngestConfig)
        total = IngestReport(source or "bundled")
        if paths:
            if not source:
                raise ValueError("ingesting files needs --source NAME")
            rep = ingest_files_task(str(ctx.wh.home), paths, source, kind, domain, mapping,
                                    cfg.max_field_chars, ctx.run_id)
            log.info("ingested %s: %d rows in, %s stored, %d already present, %d quarantined %s",
                     source, rep.rows_in, rep.stored, rep.already_present, rep.quarantined,
                     rep.quarantine_reasons)
            total.merge(rep)
        if bundled:
            for name in cfg.bundled:
                rep = ingest_bundled_task(str(ctx.wh.home), name, cfg, ctx.profile.core.seed, ctx.run_id)
                log.info("bundled %s: %d rows in, %s stored, %d already present, %d quarantined",
                         name, rep.rows_in, rep.stored, rep.already_present, rep.quarantined)
                tracking.log_counters(rep.as_counters(), prefix=f"ingest.{name}")
                total.merge(rep)
        if not paths and not bundled:
            raise ValueError("nothing to ingest: give PATH(s) with a source, or bundled=True")
        if not total.accounted:
            raise RuntimeError(f"ingest accounting broken: {total}")
        tracking.log_counters(total.as_counters(), prefix="ingest")
        tracking.log_counters(total.quarantine_reasons, prefix="ingest.quarantine")
        outputs = ctx.log_outputs(total.refs)
        report_progress("ingest", "done")
        return {"rows_in": total.rows_in, "stored": total.stored, "already_present": total.already_present,
                "quarantined": total.quarantined, "quarantine_reasons": total.quarantine_reasons,
                "tables": outputs, "mlflow_run_id": ctx.run_id}
