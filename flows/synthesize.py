"""The ``synthesize`` flow: SynLogic-style task instances into ``synthetic_tasks``.

With ``calibrate=True`` it first probes every task's levels with a base and a strong
solver (rollout backends) and stores each task's M1 band in ``task_calibration``;
synthesis then draws from the calibrated levels.
"""
from __future__ import annotations

from dataclasses import replace

from prefect import flow, task

from flows.common import flow_context, flow_logger, report_progress
from tasks import tracking
from tasks.rollout.config import RolloutConfig
from tasks.rollout.factory import make_backend
from tasks.synth.calibration import rollout_solver
from tasks.synth.config import SynthesizeConfig
from tasks.synth.registry import own_task_names
from tasks.synthesize import (
    calibration_summary,
    generate_task_instances,
    run_calibration,
    run_synthesis,
)

# one Prefect task run per synthetic task, on the flow's task runner
generate_task = task(name="synthesize-task-instances")(generate_task_instances)


def prefect_map(fn, calls: list[tuple]) -> list:
    """Each call of ``fn`` (the generator) as its own task run, side by side on the flow's runner."""
    runner = generate_task if fn is generate_task_instances else task(name=f"synthesize-{fn.__name__}")(fn)
    futures = [runner.submit(*args) for args in calls]
    return [f.result() for f in futures]


def _solvers(profile, cfg: SynthesizeConfig, home: str | None, strong_model: str | None):
    """(base, strong) solvers for calibration: the rollout section's backend with the
    calibration's models (``strong_model`` overrides the profile's). With no strong model the
    strong solver *is* the base one (its pass@k the upper bound; sampled once)."""
    from tasks.genrm.models import resolve_model_name

    rollout = profile.section("rollout", RolloutConfig)
    ccfg = cfg.calibration
    params = rollout.sampling_params()
    if ccfg.max_tokens is not None:
        params = replace(params, max_tokens=ccfg.max_tokens)

    def solver(model: str, role: str):
        try:
            where = resolve_model_name(model, home)
        except LookupError:
            where = model
        made = rollout_solver(make_backend(rollout.model_copy(update={"model": where})), params)
        made.name = f"{role}:{model}" + (f"@{where}" if where != model else "")
        return made

    base = solver(ccfg.base_model or rollout.model, "base")
    strong_name = strong_model or ccfg.strong_model
    return base, (solver(strong_name, "strong") if strong_name else base)


@flow(name="synthesize", log_prints=True, flow_run_name="synthesize")
def synthesize_flow(
    profile: str = "tiny",
    home: str | None = None,
    per_task: int | None = None,
    tasks: list[str] | None = None,
    calibrate: bool = False,
    strong_model: str | None = None,
) -> dict:
    """Generate ``per_task`` instances of every task (profile defaults when None), after
    calibrating each task's levels first when ``calibrate`` or the profile's
    ``synthesize.calibration.enabled`` says so."""
    log = flow_logger()
    report_progress("synthesize", "start")
    params = {"per_task": per_task, "tasks": tasks, "calibrate": calibrate, "strong_model": strong_model}
    with flow_context("synthesize", profile, home, params, sections=("synthesize", "rollout")) as ctx:
        cfg = ctx.profile.section("synthesize", SynthesizeConfig)
        outputs, bands = [], None
        if calibrate or cfg.calibration.enabled:
            base, strong = _solvers(ctx.profile, cfg, home, strong_model)
            cal_ref = run_calibration(ctx.wh, cfg, base, strong, tasks=tasks, log=log.info)
            log.info("calibrated %d tasks into %s", cal_ref.rows, cal_ref)
            outputs.append(cal_ref)
            bands = calibration_summary(ctx.wh, cal_ref, list(tasks) if tasks is not None
                                        else cfg.task_names(own_task_names()))
        ref = run_synthesis(ctx.wh, cfg, per_task=per_task, tasks=tasks, seed=ctx.profile.core.seed + cfg.seed,
                            mapper=prefect_map, log=log.warning)
        outputs.append(ref)
        per_task_counts = ctx.wh.sql("SELECT task, count(*) AS n FROM synthetic_tasks GROUP BY task ORDER BY task")
        log.info("synthetic_tasks: %d instances over %d tasks (%s)", ref.rows, per_task_counts.height, ref)
        tracking.log_counters({"instances": ref.rows, "tasks": per_task_counts.height}, prefix="synthesize")
        report_progress("synthesize", "done")
        return {"mlflow_run_id": ctx.run_id, "tables": ctx.log_outputs(outputs), "instances": ref.rows,
                "tasks": per_task_counts.height, **({"calibration": bands} if bands is not None else {})}
