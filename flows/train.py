"""The ``train`` flow: sft_short -> sft_long -> dpo_short -> dpo_long -> rl on DeepSpeed.

Each stage is a Prefect task with its own MLflow child run (params, per-step curves, the
DeepSpeed JSON, plots, its data snapshot as a dataset input, the final weights), and a
``models`` row whose parents are the snapshots it trained on. Stages checkpoint under
``$POSTTRAIN_HOME/checkpoints/<run>/<stage>/``: with ``resume=True`` a killed stage
continues from its last checkpoint and a finished one is not trained again, as long as
its config, data and initial model are unchanged.

The RL stage watches for length bias (reward following response length at fixed
correctness); with ``rl.length_bias.trigger_recalibration`` it corrects the GenRM rewards of
its own later steps as soon as the monitor fires, and returns the events, on each of which
this flow then runs the references flow's ``recalibrate_flow`` (the stored
``judge_calibrations`` row, the judge re-measured) for the stages after it.

The stages, the table each trains on and the model each starts from come from the stage
registry (``data_specs.stages``). Only the training tables the chosen stages read are built,
and a table whose sources and settings are unchanged is not rebuilt.

Before a stage's model is registered, the training-data audit checks what it saw (its
training snapshot and those of the models it started from): a model that fails is registered
with ``audit = failed``, the stage fails, and neither a later stage nor ``evaluate`` takes it
unless ``accept_failed_audit``.

Public entry points: ``train_flow`` (all or some stages) and ``train_stage_flow`` (one stage).
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import polars as pl
from prefect import flow, task

from data_specs.stages import STAGE_NAMES, earlier_stages, train_stage
from flows.common import flow_context, flow_logger, prefect_run_tags, report_progress
from flows.references import recalibrate_flow
from tasks import tracking
from tasks.audit import SIDE_OF_TABLE, AuditFailed, AuditReport, model_scope, run_audit
from tasks.genrm.config import LengthBiasConfig
from tasks.genrm.models import resolve_model_name
from tasks.model_registry import read_models, refuse_failed_audit
from tasks.rollout.factory import backend_kind
from tasks.train import checkpoint
from tasks.train.base_model import prepare_base_model
from tasks.train.config import TrainConfig
from tasks.train.models import register_model
from tasks.train.runner import StageJob, execute_stage
from warehouse import TableRef, Warehouse


def _digest(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


@task(name="train-base-model")
def base_model_task(home: str, cfg: dict, model_section: dict, seed: int,
                    sources: dict[str, TableRef] | None = None) -> str:
    """The base model, built (once per name) from the text tables handed over in ``sources``."""
    return str(prepare_base_model(Warehouse(home), TrainConfig(**cfg).base_model, model_section, seed, sources))


@task(name="train-build-data")
def build_data_task(home: str, cfg: dict, base_model: str, tables: list[str],
                    sources: dict[str, TableRef] | None = None) -> dict[str, TableRef]:
    """Write the named training tables (unchanged ones are kept) from ``sources``, the snapshots
    the pipeline's earlier stages handed over (None: each source's newest); refs by name."""
    from transformers import AutoTokenizer

    from tasks.train.data import write_training_tables

    tokenizer = AutoTokenizer.from_pretrained(base_model)
    refs, reports = write_training_tables(Warehouse(home), TrainConfig(**cfg), tokenizer, tables, sources)
    for name, report in reports.items():
        tracking.log_counters(report.counters(), prefix=f"data.{name}")
    return refs


# tables a recipe reads while it trains, besides its training table: pinned in its job when it starts
# (RL's references and judge calibration; the agent stage's replay of RL's verified samples)
RUNTIME_READS = {"rl": ("references", "judge_calibrations"), "agent": ("rl_rollouts", "rl_prompts")}


def judge_model(wh: Warehouse, conf: TrainConfig, stage: str, sources: dict[str, TableRef] | None) -> str | None:
    """The checkpoint an RL stage's GenRM judge runs, when its rollout names a model of this home
    (``judge``, another stage, ``policy``): resolved from the ``models`` snapshot handed over in
    ``sources``, so a judge trained after the hand-over is not the one this run was given. None
    when the stage has no GenRM judge, names a fixed model, or the home has no such model yet (a
    run whose prompts need no judge never asks for one)."""
    if train_stage(stage).recipe != "rl":
        return None
    genrm = conf.stage(stage).genrm
    rollout = genrm.judge.rollout
    if not genrm.enabled or not backend_kind(rollout.backend).loads_model:
        return None
    try:
        path = resolve_model_name(rollout.model, wh.home, sources)
    except LookupError:
        return None
    return path if path != rollout.model else None


def runtime_sources(wh: Warehouse, stage: str, sources: dict[str, TableRef] | None) -> dict[str, str | None]:
    """The snapshots the stage reads while it trains: those handed over in ``sources``, else each
    table's newest now (None: it does not exist, and the stage reads none)."""
    return {t: (str(r) if (r := wh.pinned(t, sources)) is not None else None)
            for t in RUNTIME_READS.get(train_stage(stage).recipe, ())}


@task(name="train-stage")
def train_stage_task(stage: str, home: str, profile: str, run_name: str, init_model: str, ref: TableRef,
                     cfg: dict, config_hash: str, parent_run_id: str | None, resume: bool = True,
                     sources: dict[str, TableRef] | None = None, accept_failed_audit: bool = False) -> dict:
    """Train one stage in its own MLflow child run and register the resulting model; what it reads
    while it trains is pinned to ``sources`` (the pipeline's hand-over) where they hold it.

    The model is registered only after the audit of what it saw (``gate_audit``); a model that
    fails it is registered as failed and the stage raises ``AuditFailed``, unless
    ``accept_failed_audit``."""
    wh, conf = Warehouse(home), TrainConfig(**cfg)
    params = {"stage": stage, "run_name": run_name, "init_model": init_model, "data": str(ref),
              "stage_config": conf.stage(stage).model_dump(), "engine": conf.engine_for(stage).model_dump(),
              "optimizer": conf.optimizer.model_dump(), "seed": conf.seed}
    with tracking.tracked_run(stage, params=params, parent_run_id=parent_run_id,
                              tags={"posttrain.profile": profile, "posttrain.train_run": run_name,
                                    **prefect_run_tags()}) as run_id:
        tracking.log_table(ref, context="input")
        reads = runtime_sources(wh, stage, sources)
        judge = judge_model(wh, conf, stage, sources)
        fingerprint = stage_fingerprint(wh, config_hash, stage, ref, init_model, reads, judge)
        extra = {**({"sources": reads} if reads else {}), **({"judge_model": judge} if judge else {})}
        job = StageJob(stage=stage, home=home, run_name=run_name, profile=profile, init_model=init_model,
                       data_ref=ref, config=cfg, fingerprint=fingerprint, mlflow_run_id=run_id,
                       tracking_uri=tracking.mlflow.get_tracking_uri(), extra=extra)
        if _stage_rows(wh, ref, stage) == 0:
            # e.g. no example is long enough for a long stage: nothing to learn, the model goes on as is
            flow_logger().warning("train %s: no rows of %s fall in this stage's range; the model passes "
                                  "through unchanged", stage, ref)
            skipped, result = False, {"path": init_model, "steps": 0, "final_loss": None, "seconds": 0.0,
                                      "passed_through": True,
                                      "reason": f"no row of {ref.name} is assigned to it: the model of the stage "
                                                "before passes through unchanged"}
            tracking.set_tags({"posttrain.passed_through": True})
        else:
            skipped = _prepare_stage_dir(job, resume)
            result = checkpoint.read_done(job.stage_path) if skipped else execute_stage(job)
            result = {**result, "path": wh.local_path(result["path"])}   # a copied home's own weights
        report = gate_audit(wh, stage, ref, init_model, conf.data.rl_requires_difficulty)
        model_ref = register_model(wh, run_name=run_name, stage=stage, result=result, init_model=init_model,
                                   profile=profile, parents=[ref], config_hash=config_hash,
                                   mlflow_run_id=run_id, log_weights_max_mb=conf.log_weights_max_mb,
                                   audit_violations=report.violations)
        tracking.log_table(model_ref, context="output")
        tracking.set_tags({"posttrain.skipped": skipped})
        if not report.passed and not accept_failed_audit:
            raise AuditFailed(report)
        return {**result, "mlflow_run_id": run_id, "skipped": skipped, "models": str(model_ref), "data": str(ref),
                "audit": "passed" if report.passed else "failed"}


def gate_audit(wh: Warehouse, stage: str, ref: TableRef, init_model: str, require_difficulty: bool) -> AuditReport:
    """The training-data audit of what the stage's model saw (its training snapshot and those of
    the models it started from), run before the model is registered; logged to the stage's run."""
    report = run_audit(wh, model_scope(wh, [ref], init_model), require_difficulty)
    tracking.log_counters(report.metrics(), prefix="audit")
    tracking.log_dict(report.as_dict(), "audit/report.json")
    tracking.set_tags({"posttrain.audit": "passed" if report.passed else "failed"})
    if report.passed:
        flow_logger().info("train %s: the audit of what it trained on passed (%s)", stage,
                           "; ".join(report.snapshots.get(t, "") for t in SIDE_OF_TABLE if t in report.snapshots))
    else:
        flow_logger().error("train %s: the audit of what it trained on FAILED with %d violation(s); the model is "
                            "recorded as failed:\n%s", stage, report.violations, report.describe())
    return report


def stage_fingerprint(wh: Warehouse, config_hash: str, stage: str, ref: TableRef, init_model: str,
                      reads: dict[str, str | None], judge: str | None = None) -> str:
    """What a stage's training is: its config, its data's content, the weights it starts from and
    the content of what it reads while it trains (``runtime_sources``: new references or a new
    judge calibration retrain RL; the same content under a new snapshot does not), and the judge it
    was handed (``judge_model``: a retrained judge retrains RL). A finished stage with the same
    fingerprint is not trained again."""
    read_hashes = {t: wh.ref(*r.split("@", 1)).content_hash for t, r in reads.items() if r is not None}
    return _digest(config_hash, stage, ref.content_hash, _model_identity(wh, init_model),
                   *([read_hashes] if read_hashes else []), *([_model_identity(wh, judge)] if judge else []))


def _stage_rows(wh: Warehouse, ref: TableRef, stage: str) -> int:
    """Rows of the stage's table snapshot this stage trains on (its ``stage`` column, if any)."""
    lazy = wh.scan(ref.name, ref.snapshot)   # counted from the Parquet files, not loaded
    if "stage" in lazy.collect_schema().names():
        lazy = lazy.filter(pl.col("stage") == stage)
    return int(lazy.select(pl.len()).collect().item())


def _model_identity(wh: Warehouse, path: str) -> str:
    """What the initial model is: the fingerprint of the stage that wrote it, else its path (in
    this home: relative to it, so a copied home resumes what the original finished).

    A stage's final directory keeps its path across retrains, so the path alone would let
    a later stage resume on top of weights that have since changed.
    """
    job = Path(path).parent / "job.json"
    if job.exists():
        return StageJob.load(job).fingerprint
    inside = Path(path).is_relative_to(wh.home)
    return f"$POSTTRAIN_HOME/{Path(path).relative_to(wh.home)}" if inside else path


def _prepare_stage_dir(job: StageJob, resume: bool) -> bool:
    """True when the stage already finished with the same inputs (nothing to train).

    A stage directory left by different inputs, or any directory when ``resume`` is off,
    is cleared so training starts from the initial model.
    """
    path = job.stage_path
    previous = path / "job.json"
    same = previous.exists() and StageJob.load(previous).fingerprint == job.fingerprint
    if resume and same:
        return checkpoint.is_done(path)
    if path.exists():
        shutil.rmtree(path)
    return False


def _run_name(profile, run_name: str | None, config_hash: str) -> str:
    return run_name or f"{profile.name}-{config_hash}"


def _stage_sequence(stages: list[str] | None, cfg: TrainConfig) -> list[str]:
    wanted = list(stages) if stages is not None else list(cfg.stages)
    for name in wanted:
        train_stage(name)   # a clear error for an unknown name
    return [s for s in STAGE_NAMES if s in wanted]


def _previous_model(wh: Warehouse, run_name: str, stage: str, base: str, accept_failed_audit: bool = False,
                    sources: dict[str, TableRef] | None = None) -> str:
    """The newest model this run produced in the stages ``stage`` follows (nearest first), as of
    the ``models`` snapshot handed over in ``sources`` (else the newest), else the base model; one
    whose audit failed is refused unless accepted."""
    models = read_models(wh, sources).filter(pl.col("run_name") == run_name)
    for prev in earlier_stages(stage):
        rows = models.filter(pl.col("stage") == prev)
        if rows.height:
            refuse_failed_audit(rows.row(-1, named=True), accept_failed_audit)
            return rows["path"][-1]
    return base


def handle_length_bias_events(events: list[dict], cfg: LengthBiasConfig, profile: str, home: str) -> list[dict]:
    """Recalibrate the GenRM once per length-bias event of an RL stage; what each run found."""
    log = flow_logger()
    if not events:
        return []
    if not cfg.trigger_recalibration:
        log.warning("rl: %d length-bias event(s); rl.length_bias.trigger_recalibration is off, not recalibrating",
                    len(events))
        return []
    out = []
    for event in events:
        res = recalibrate_flow(event, profile=profile, home=home)
        log.warning("rl step %s: length bias %s=%.3f > %.2f -> recalibration run %s (slope %.4f, after %s)",
                    event.get("rl_step"), event.get("method"), event["statistic"], event["threshold"],
                    res["mlflow_run_id"], res["slope"], res["statistic_after"])
        out.append({"rl_step": event.get("rl_step"), "statistic": event["statistic"],
                    "mlflow_run_id": res["mlflow_run_id"], "slope": res["slope"],
                    "statistic_after": res["statistic_after"], "tables": res["tables"]})
    return out


def _train_flow_run_name() -> str:
    """Prefect flow-run name of ``train_flow``: the stages it trains (``train sft_short``)."""
    from prefect.runtime import flow_run

    return train_run_title(flow_run.parameters.get("stages"))


def train_run_title(stages: list[str] | None) -> str:
    return "train " + (" + ".join(stages) if stages else "all stages")


@flow(name="train", log_prints=True, flow_run_name=_train_flow_run_name)
def train_flow(profile: str = "tiny", home: str | None = None, stages: list[str] | None = None,
               resume: bool = True, run_name: str | None = None,
               sources: dict[str, TableRef] | None = None, accept_failed_audit: bool = False) -> dict:
    """Run the training stages in order, each starting from the previous stage's model.

    ``sources``: the snapshots to build the training tables from (the pipeline hands over
    what its earlier stages wrote); a source not among them is read at its newest. Each model
    is audited before it is registered; a failed audit stops the flow (and a later stage refuses
    to start from that model) unless ``accept_failed_audit``."""
    log = flow_logger()
    report_progress("train", "start")
    with flow_context("train", profile, home, {"stages": stages or "all", "resume": resume},
                      sections=("train", "model"), run_name=train_run_title(stages)) as ctx:
        cfg = ctx.profile.section("train", TrainConfig)
        wh, home_str = ctx.wh, str(ctx.wh.home)
        config_hash = ctx.profile.config_hash("train", "model")
        name = _run_name(ctx.profile, run_name, config_hash)
        sequence = _stage_sequence(stages, cfg)
        results: dict[str, dict] = {}
        for stage in [s for s in sequence if s not in cfg.stages]:
            # the recipe this profile trains leaves the stage out (smol: SFT straight to RL, as M1)
            reason = f"not in train.stages of profile {ctx.profile.name} ({', '.join(cfg.stages)})"
            log.warning("train %s: %s: stage not trained; the stages after it start from the one before it",
                        stage, reason)
            results[stage] = {"steps": 0, "not_in_profile": True, "reason": reason}
        sequence = [s for s in sequence if s in cfg.stages]
        if not sequence:
            report_progress("train", "done")
            return {"mlflow_run_id": ctx.run_id, "run_name": name, "base_model": None, "data": {},
                    "stages": results, "final_model": None, "recalibrations": [], "tables": {}}
        base = base_model_task(home_str, cfg.model_dump(), ctx.profile.raw("model"), ctx.profile.core.seed, sources)
        tables = list(dict.fromkeys(train_stage(s).table for s in sequence))
        data_refs = build_data_task(home_str, cfg.model_dump(), base, tables, sources)
        for ref in data_refs.values():
            tracking.log_table(ref, context="output")
        recalibrations: list[dict] = []
        final_model = base
        for stage in sequence:
            # the model of the nearest stage it follows: trained just now, else earlier in this run
            init_model = next((results[p]["path"] for p in earlier_stages(stage) if "path" in results.get(p, {})), None) \
                or _previous_model(wh, name, stage, base, accept_failed_audit, sources)
            table = train_stage(stage).table
            if table not in data_refs and train_stage(stage).optional:
                log.info("train %s: no %s rows (the profile asks for none): stage not trained", stage, table)
                results[stage] = {"steps": 0, "no_data": True,
                                  "reason": f"no {table} rows: the profile asks for none"}
                continue
            if table not in data_refs:
                raise ValueError(f"stage {stage}: the warehouse yielded no {table} rows "
                                 "(ingest, curate or synthesize data first)")
            report_progress(f"train.{stage}", "start")
            res = train_stage_task(stage, home_str, ctx.profile.name, name, init_model, data_refs[table],
                                   cfg.model_dump(), config_hash, ctx.run_id, resume, sources, accept_failed_audit)
            log.info("train %s: %s steps in %.1fs, final loss %s%s", stage, res.get("steps"), res.get("seconds", 0),
                     res.get("final_loss"), " (already done)" if res.get("skipped") else "")
            # a reused stage's length-bias events were handled when it ran
            if train_stage(stage).recipe == "rl" and not res.get("skipped"):
                recalibrations = handle_length_bias_events(res.get("length_bias_events") or [],
                                                           cfg.stage(stage).length_bias, ctx.profile.name, home_str)
            results[stage] = res
            final_model = res["path"]
            report_progress(f"train.{stage}", "done")
        report_progress("train", "done")
        data = {table: str(ref) for table, ref in data_refs.items()}
        return {"mlflow_run_id": ctx.run_id, "run_name": name, "base_model": base, "data": data,
                "stages": results, "final_model": final_model, "recalibrations": recalibrations,
                "tables": {**data, **({"models": str(wh.latest("models"))} if wh.exists("models") else {})}}


@flow(name="train-stage", flow_run_name="{stage}")
def train_stage_flow(stage: str, profile: str = "tiny", home: str | None = None, resume: bool = True,
                     run_name: str | None = None, sources: dict[str, TableRef] | None = None,
                     accept_failed_audit: bool = False) -> dict:
    """One stage on its own (it starts from this run's previous stage's model, else the base)."""
    return train_flow(profile=profile, home=home, stages=[stage], resume=resume, run_name=run_name,
                      sources=sources, accept_failed_audit=accept_failed_audit)
