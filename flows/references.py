"""The ``references`` flow: GenRM-judged Swiss tournaments pick a reference per open prompt,
and the judge is validated (benchmark accuracy, Best-of-N vs pass@N) in the same run.

``recalibrate_flow`` answers the length-bias monitor: it fits a length correction on the
window of RL rewards that tripped the monitor, checks that the correction removes the
bias, re-measures the judge's benchmark accuracy and stores it all in
``judge_calibrations``, whose newest row for a judge corrects the GenRM rewards of later RL
stages (``tasks.train.genrm_reward.DomainReward``). Within the RL stage that tripped it the
correction is already in force from the next step: the stage applies the same fit itself
(``tasks.genrm.length_bias.event_correction``; a task cannot start a flow), and the train
flow runs this flow on each of the stage's events once it returns, to store and check it.
Outside RL, ``length_bias_trigger`` wires it to a monitor directly.
"""
from __future__ import annotations

from collections.abc import Callable

import polars as pl
from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from data_specs import get_spec
from flows.common import flow_context, flow_logger, report_progress
from tasks import tracking
from tasks.genrm.config import ReferencesConfig
from tasks.genrm.judge import GenRMJudge
from tasks.genrm.length_bias import (
    CALIBRATIONS_TABLE,
    EVENT_TAG,
    STATISTICS,
    LengthBiasEvent,
    event_correction,
)
from tasks.genrm.models import resolve_rollout
from tasks.genrm.references import build_backends, run_references
from tasks.genrm.validation import judge_accuracy, run_judge_validation
from tasks.rollout.factory import make_backend
from warehouse import TableRef, Warehouse

SECTION = "references"


@task(name="references-tournaments", cache_policy=NO_CACHE)
def tournaments_task(wh: Warehouse, cfg: ReferencesConfig, judge: GenRMJudge, backends: dict,
                     prompts: list | None, run_id: str, sources: dict[str, TableRef] | None = None):
    return run_references(wh, cfg, judge, backends, prompts=prompts, run_id=run_id, sources=sources)


@task(name="references-validate-judge", cache_policy=NO_CACHE)
def validation_task(wh: Warehouse, cfg: ReferencesConfig, judge: GenRMJudge, backends: dict,
                    labelled_files: list[str], run_id: str, sources: dict[str, TableRef] | None = None):
    return run_judge_validation(wh, cfg, judge, backends, labelled_files, run_id, sources)


@flow(name="references", log_prints=True, flow_run_name="references")
def references_flow(profile: str = "tiny", home: str | None = None, prompts: list | None = None,
                    labelled_files: list[str] | None = None, validate_judge: bool | None = None,
                    sources: dict[str, TableRef] | None = None) -> dict:
    """Pick and store a reference per open prompt; validate the judge (unless disabled).

    ``sources``: the prompt tables' snapshots to draw open prompts from and to build the judge
    benchmark from (the pipeline hands over what curate wrote); a table not among them is read
    at its newest.

    ``prompts``: extra open prompts (text, or dicts with ``prompt`` and optional ``id``,
    ``domain``, ``constraints``) judged beside the configured table's rows.
    ``labelled_files``: user judge-label files added to the judge benchmark.
    """
    log = flow_logger()
    report_progress(SECTION, "start")
    params = {"extra_prompts": len(prompts or []), "labelled_files": labelled_files or [], "validate_judge": validate_judge}
    with flow_context(SECTION, profile, home, params, sections=(SECTION,)) as ctx:
        cfg = ctx.profile.section(SECTION, ReferencesConfig)
        wh = ctx.wh
        judge_backend, backends = build_backends(cfg, str(wh.home), sources)
        judge = GenRMJudge(judge_backend, cfg.judge, seed=cfg.seed)
        report = tournaments_task(wh, cfg, judge, backends, prompts, ctx.run_id, sources)
        for ref in report.inputs:
            tracking.log_table(ref, context="input", run_id=ctx.run_id)
        log.info("references: %d prompts, %d candidates, %d games, %d references, games by status %s",
                 report.prompts, report.candidates, report.games, report.references, dict(report.status_counts))
        tracking.log_counters(report.as_counters(), prefix="references", run_id=ctx.run_id)
        refs = dict(report.refs)
        validation: dict[str, float] = {}
        if cfg.validation.enabled if validate_judge is None else validate_judge:
            validation, val_refs = validation_task(wh, cfg, judge, backends, labelled_files or [], ctx.run_id, sources)
            tracking.log_counters(validation, prefix="genrm", run_id=ctx.run_id)
            log.info("judge validation: %s", {k: round(v, 3) for k, v in validation.items()})
            refs["judge_benchmark"] = val_refs["judge_benchmark"]
            refs["judgments"] = val_refs["judgments"]  # the later append includes the tournament rows
        outputs = ctx.log_outputs(refs)
        report_progress(SECTION, "done")
        return {"mlflow_run_id": ctx.run_id, "tables": outputs, **report.as_counters(),
                "validation": validation}


@flow(name="recalibrate-genrm", log_prints=True, flow_run_name="recalibrate-genrm")
def recalibrate_flow(event: dict, profile: str = "tiny", home: str | None = None,
                     remeasure_judge: bool = True) -> dict:
    """Fit a length correction on the monitor's window and re-check the judge.

    ``event`` is ``LengthBiasEvent.as_dict()``: the statistic that fired and the pooled
    rewards, lengths and correctness behind it; the RL stage adds ``judge_model`` (whose
    rewards these are) and ``base_calibration`` (the correction already applied to them,
    ``LengthCorrection.as_dict()``). The stored row is the correction RL applies from then on
    (``DomainReward`` reads the newest one for its judge): the fit on top of the base one.
    """
    log = flow_logger()
    report_progress("recalibrate", "start")
    params = {"trigger_step": event.get("step"), "trigger_statistic": event.get("statistic")}
    with flow_context("recalibrate", profile, home, params, sections=(SECTION,)) as ctx:
        cfg = ctx.profile.section(SECTION, ReferencesConfig)
        method = event.get("method") or cfg.length_bias.method
        rewards, lengths, correct = event["rewards"], event["lengths"], event["correct"]
        # the window's rewards already carry the base correction: the fit is what is left of the bias
        fitted, correction = event_correction(event)
        after, _ = STATISTICS[method](fitted.apply(rewards, lengths, correct), lengths, correct,
                                      cfg.length_bias.min_group_size)
        accuracy = None
        if remeasure_judge and ctx.wh.exists("judge_benchmark"):
            judge = GenRMJudge(make_backend(resolve_rollout(cfg.judge.rollout, str(ctx.wh.home))), cfg.judge,
                               seed=cfg.seed)
            accuracy = judge_accuracy(judge, ctx.wh.read("judge_benchmark"), ctx.run_id).metrics.get("accuracy")
        row = {"run_id": ctx.run_id, "judge_model": event.get("judge_model"), "trigger_step": event.get("step"),
               "method": method, "statistic": float(event["statistic"]),
               "threshold": float(event.get("threshold", cfg.length_bias.threshold)),
               **correction.as_dict(), "fitted_slope": fitted.slope, "statistic_after": after,
               "judge_accuracy": accuracy}
        ref = append_calibration(ctx.wh, row)
        tracking.log_counters({k: row[k] for k in ("statistic", "slope", "statistic_after", "judge_accuracy")},
                              prefix="recalibration", run_id=ctx.run_id)
        tracking.set_tags({EVENT_TAG: "recalibrated"}, run_id=ctx.run_id)
        log.warning("GenRM recalibrated: length slope %.4f, %s %.3f -> %s", correction.slope, method,
                    row["statistic"], "n/a" if after is None else f"{after:.3f}")
        outputs = ctx.log_outputs([ref])
        report_progress("recalibrate", "done")
        return {"mlflow_run_id": ctx.run_id, "tables": outputs, **row}


def append_calibration(wh: Warehouse, row: dict):
    """Append one calibration; a table written under an older spec is rewritten once in the current one."""
    spec = get_spec(CALIBRATIONS_TABLE)
    new = spec.conform(pl.DataFrame([row]))
    if wh.exists(CALIBRATIONS_TABLE):
        old = wh.read(CALIBRATIONS_TABLE)
        if old.schema != new.schema:  # v1 rows lack judge_model / fitted_slope: keep them, as nulls
            return wh.write(CALIBRATIONS_TABLE, pl.concat([spec.conform(old), new]))
    return wh.append(CALIBRATIONS_TABLE, new)


def length_bias_trigger(profile: str = "tiny", home: str | None = None,
                        remeasure_judge: bool = True) -> Callable[[LengthBiasEvent], dict]:
    """A monitor callback that runs ``recalibrate_flow`` on each recalibration event."""
    def trigger(event: LengthBiasEvent) -> dict:
        return recalibrate_flow(event.as_dict(), profile=profile, home=home, remeasure_judge=remeasure_judge)
    return trigger
