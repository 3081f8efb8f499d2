"""The ``audit`` flow: prove from the warehouse alone that training saw only what curation
and difficulty chose (``tasks.audit``). The pipeline runs it last and fails on a violation."""
from __future__ import annotations

from prefect import flow

from flows.common import flow_context, flow_logger, report_progress
from tasks import tracking
from tasks.audit import AuditFailed, run_audit
from tasks.train.config import TrainConfig
from warehouse import TableRef


@flow(name="audit", log_prints=True, flow_run_name="audit")
def audit_flow(profile: str = "tiny", home: str | None = None, fail_on_violation: bool = True,
               sources: dict[str, TableRef] | None = None) -> dict:
    """Counts per check and the offending ids; raises ``AuditFailed`` on a violation by default.
    ``sources``: the snapshots to audit (the pipeline hands over what its stages wrote); else each
    table's newest."""
    log = flow_logger()
    report_progress("audit", "start")
    with flow_context("audit", profile, home, {"fail_on_violation": fail_on_violation}) as ctx:
        train = ctx.profile.section("train", TrainConfig)
        report = run_audit(ctx.wh, require_difficulty=train.data.rl_requires_difficulty, sources=sources)
        for refs in report.snapshots.values():   # the snapshots audited, as the run's inputs
            for ref in refs.split(", "):
                tracking.log_table(ctx.wh.ref(*ref.split("@", 1)), context="input")
        tracking.log_counters(report.metrics(), prefix="audit")
        tracking.log_dict(report.as_dict(), "audit/report.json")
        tracking.set_tags({"posttrain.audit": "passed" if report.passed else "failed"})
        for line in report.describe().splitlines():
            log.info("audit %s", line)
        report_progress("audit", "done")
        if not report.passed and fail_on_violation:
            raise AuditFailed(report)
        return {"mlflow_run_id": ctx.run_id, **report.as_dict()}
