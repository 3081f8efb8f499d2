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
from tasks.synthesize import generate_task_instances, run_calibration, run_synthesis

# one Prefect task run per synthetic task, on the flow's task runner
generate_task = task(name="synthesize-task-instances")(generate_task_instances)


def prefect_map(fn, calls: list[tuple]) -> list:
    """Each call of ``fn`` (the generator) as its own task run, side by side on the flow's runner."""
    runner = generate_task if fn is generate_task_instances else task(name=f"synthesize-{fn.__name__}")(fn)
    futures = [runner.submit(*args) for args in calls]
    return [f.result() for f in futures]


@flow(name="synthesize", log_prints=True, flow_run_name="synthesize")
def synthesize_flow(
    profile: str = "tiny",
    home: str | None = None,
    per_task: int | None = None,
    tasks: list[str] | None = None,
    calibrate: bool = False,
    strong_model: str = "smol",
) -> dict:
    """Generate ``per_task`` instances of every task (profile defaults when None)."""
    log = flow_logger()
    report_progress("synthesize", "start")
    params = {"per_task": per_task, "tasks": tasks, "calibrate": calibrate, "strong_model": strong_model}
    with flow_context("synthesize", profile, home, params, sections=("synthesize", "rollout")) as ctx:
        cfg = ctx.profile.section("synthesize", SynthesizeConfig)
        outputs = []
        if calibrate:
            rollout = ctx.profile.section("rollout", RolloutConfig)
            params_ = rollout.sampling_params()
            base = rollout_solver(make_backend(rollout), params_)
            strong = rollout_solver(make_backend(rollout.model_copy(update={"model": strong_model})),
                                    replace(params_))
            base.name, strong.name = f"base:{rollout.model}", f"strong:{strong_model}"
            cal_ref = run_calibration(ctx.wh, cfg, base, strong, tasks=tasks)
            log.info("calibrated %d tasks into %s", cal_ref.rows, cal_ref)
            outputs.append(cal_ref)
        ref = run_synthesis(ctx.wh, cfg, per_task=per_task, tasks=tasks, seed=ctx.profile.core.seed + cfg.seed,
                            mapper=prefect_map)
        outputs.append(ref)
        per_task_counts = ctx.wh.sql("SELECT task, count(*) AS n FROM synthetic_tasks GROUP BY task ORDER BY task")
        log.info("synthetic_tasks: %d instances over %d tasks (%s)", ref.rows, per_task_counts.height, ref)
        tracking.log_counters({"instances": ref.rows, "tasks": per_task_counts.height}, prefix="synthesize")
        report_progress("synthesize", "done")
        return {"mlflow_run_id": ctx.run_id, "tables": ctx.log_outputs(outputs), "instances": ref.rows,
                "tasks": per_task_counts.height}
