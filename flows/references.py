"""The ``references`` flow: GenRM-judged Swiss tournaments pick a reference per open prompt,
and the judge is validated (benchmark accuracy, Best-of-N vs pass@N) in the same run.

``recalibrate_flow`` answers the length-bias monitor: it fits a length correction on the
window of RL rewards that tripped the monitor, checks that the correction removes the
bias, re-measures the judge's benchmark accuracy and stores it all in
``judge_calibrations``. The RL loop wires it in with

    monitor = LengthBiasMonitor(cfg.length_bias, on_event=length_bias_trigger(profile, home))
"""
from __future__ import annotations

from collections.abc import Callable

import polars as pl
from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from flows.common import flow_context, flow_logger, report_progress
from tasks import tracking
from tasks.genrm.config import ReferencesConfig
from tasks.genrm.judge import GenRMJudge
from tasks.genrm.length_bias import EVENT_TAG, STATISTICS, LengthBiasEvent, fit_length_correction
from tasks.genrm.references import build_backends, run_references
from tasks.genrm.validation import judge_accuracy, run_judge_validation
from tasks.rollout.factory import make_backend
from warehouse import Warehouse

SECTION = "references"


@task(name="references-tournaments", cache_policy=NO_CACHE)
def tournaments_task(wh: Warehouse, cfg: ReferencesConfig, judge: GenRMJudge, backends: dict,
                     prompts: list | None, run_id: str):
    return run_references(wh, cfg, judge, backends, prompts=prompts, run_id=run_id)


@task(name="references-validate-judge", cache_policy=NO_CACHE)
def validation_task(wh: Warehouse, cfg: ReferencesConfig, judge: GenRMJudge, backends: dict,
                    labelled_files: list[str], run_id: str):
    return run_judge_validation(wh, cfg, judge, backends, labelled_files, run_id)


@flow(name="references", log_prints=True)
def references_flow(profile: str = "tiny", home: str | None = None, prompts: list | None = None,
                    labelled_files: list[str] | None = None, validate_judge: bool | None = None) -> dict:
    """Pick and store a reference per open prompt; validate the judge (unless disabled).

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
        judge_backend, backends = build_backends(cfg)
        judge = GenRMJudge(judge_backend, cfg.judge, seed=cfg.seed)
        report = tournaments_task(wh, cfg, judge, backends, prompts, ctx.run_id)
        for ref in report.inputs:
            tracking.log_table(ref, context="input", run_id=ctx.run_id)
        log.info("references: %d prompts, %d candidates, %d games, %d references, games by status %s",
                 report.prompts, report.candidates, report.games, report.references, dict(report.status_counts))
        tracking.log_counters(report.as_counters(), prefix="references", run_id=ctx.run_id)
        refs = dict(report.refs)
        validation: dict[str, float] = {}
        if cfg.validation.enabled if validate_judge is None else validate_judge:
            validation, val_refs = validation_task(wh, cfg, judge, backends, labelled_files or [], ctx.run_id)
            tracking.log_counters(validation, prefix="genrm", run_id=ctx.run_id)
            log.info("judge validation: %s", {k: round(v, 3) for k, v in validation.items()})
            refs["judge_benchmark"] = val_refs["judge_benchmark"]
            refs["judgments"] = val_refs["judgments"]  # the later append includes the tournament rows
        outputs = ctx.log_outputs(refs)
        report_progress(SECTION, "done")
        return {"mlflow_run_id": ctx.run_id, "tables": outputs, **report.as_counters(),
                "validation": validation}


@flow(name="recalibrate-genrm", log_prints=True)
def recalibrate_flow(event: dict, profile: str = "tiny", home: str | None = None,
                     remeasure_judge: bool = True) -> dict:
    """Fit a length correction on the monitor's window and re-check the judge.

    ``event`` is ``LengthBiasEvent.as_dict()``: the statistic that fired and the pooled
    rewards, lengths and correctness behind it.
    """
    log = flow_logger()
    report_progress("recalibrate", "start")
    params = {"trigger_step": event.get("step"), "trigger_statistic": event.get("statistic")}
    with flow_context("recalibrate", profile, home, params, sections=(SECTION,)) as ctx:
        cfg = ctx.profile.section(SECTION, ReferencesConfig)
        method = event.get("method") or cfg.length_bias.method
        rewards, lengths, correct = event["rewards"], event["lengths"], event["correct"]
        correction = fit_length_correction(rewards, lengths, correct)
        after, _ = STATISTICS[method](correction.apply(rewards, lengths), lengths, correct,
                                      cfg.length_bias.min_group_size)
        accuracy = None
        if remeasure_judge and ctx.wh.exists("judge_benchmark"):
            judge = GenRMJudge(make_backend(cfg.judge.rollout), cfg.judge, seed=cfg.seed)
            accuracy = judge_accuracy(judge, ctx.wh.read("judge_benchmark"), ctx.run_id).metrics.get("accuracy")
        row = {"run_id": ctx.run_id, "trigger_step": event.get("step"), "method": method,
               "statistic": float(event["statistic"]), "threshold": float(event.get("threshold", cfg.length_bias.threshold)),
               "slope": correction.slope, "log_length_mean": correction.log_length_mean,
               "log_length_std": correction.log_length_std, "n": correction.n,
               "statistic_after": after, "judge_accuracy": accuracy}
        ref = ctx.wh.write("judge_calibrations", pl.DataFrame([row]), mode="append")
        tracking.log_counters({k: row[k] for k in ("statistic", "slope", "statistic_after", "judge_accuracy")},
                              prefix="recalibration", run_id=ctx.run_id)
        tracking.set_tags({EVENT_TAG: "recalibrated"}, run_id=ctx.run_id)
        log.warning("GenRM recalibrated: length slope %.4f, %s %.3f -> %s", correction.slope, method,
                    row["statistic"], "n/a" if after is None else f"{after:.3f}")
        outputs = ctx.log_outputs([ref])
        report_progress("recalibrate", "done")
        return {"mlflow_run_id": ctx.run_id, "tables": outputs, **row}


def length_bias_trigger(profile: str = "tiny", home: str | None = None,
                        remeasure_judge: bool = True) -> Callable[[LengthBiasEvent], dict]:
    """A monitor callback that runs ``recalibrate_flow`` on each recalibration event."""
    def trigger(event: LengthBiasEvent) -> dict:
        return recalibrate_flow(event.as_dict(), profile=profile, home=home, remeasure_judge=remeasure_judge)
    return trigger
