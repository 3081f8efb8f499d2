"""The ``curate`` flow: prompts -> leak-free, decontaminated ``sft_pool`` and ``rl_pool``."""
from __future__ import annotations

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from flows.common import flow_context, flow_logger, report_progress
from tasks import tracking
from tasks.curate import CurateConfig, run_curate
from tasks.curate.parallel import DaskMapper, LocalMapper
from tasks.curate.pipeline import CURATED_INPUTS
from tasks.curate.report import log_curate, log_removed, removed_rows
from tasks.genrm.models import resolve_rollout
from tasks.rollout.base import RolloutBackend
from tasks.rollout.factory import make_backend
from warehouse import TableRef, Warehouse


def prefect_step(name: str, fn):
    """One curate block as a Prefect task (``curate.filter``, ``curate.minhash``, ...): the run's
    graph shows each block with its own state and duration. Each block's result is applied
    to the run's in-memory state, so nothing is cached or persisted between them."""
    return task(name=f"curate.{name}", cache_policy=NO_CACHE, persist_result=False)(fn)()


def model_repair_backend(cfg: CurateConfig, home: str) -> RolloutBackend | None:
    """The backend ``curate.model_repair`` asks (its ``rollout``, home aliases resolved), or None
    when model repair is off."""
    repair = cfg.model_repair
    if not repair.enabled:
        return None
    return make_backend(resolve_rollout(repair.rollout, home))


def curate_task(home: str, cfg: CurateConfig, run_id: str, task_runner: str, dask_settings: dict,
                dask_processes: bool, sources: dict[str, TableRef] | None = None):
    """Runs every curate block as a task; heavy map steps go to Dask when the profile asks for it."""
    mapper = LocalMapper() if task_runner == "local" else DaskMapper(
        address=dask_settings.get("address"), n_workers=dask_settings.get("n_workers", 2),
        threads_per_worker=dask_settings.get("threads_per_worker", 1), processes=dask_processes)
    backend = None
    try:
        backend = model_repair_backend(cfg, home)
        return run_curate(Warehouse(home), cfg, run_id=run_id, mapper=mapper, step=prefect_step, sources=sources,
                          repair_backend=backend)
    finally:
        if backend is not None and callable(getattr(backend, "close", None)):
            backend.close()
        mapper.close()


def publish_removed(removed: dict) -> None:
    """Each block's removed rows as a Prefect table artifact on this flow run (``curate-removed-
    minhash`` ...): what was removed, why, and what it matched, where a user looks at the run."""
    from prefect.artifacts import create_table_artifact

    from tasks.curate.report import MAX_REMOVED_SHOWN

    for stage, frame in removed.items():
        block = stage.split(".", 1)[-1]
        shown = frame.head(MAX_REMOVED_SHOWN).drop("row_id")
        more = f" (the first {MAX_REMOVED_SHOWN}; `posttrain sql` on `decisions` has all)" \
            if frame.height > MAX_REMOVED_SHOWN else ""
        try:
            create_table_artifact(shown.to_dicts(), key=f"curate-removed-{block.replace('_', '-')}",
                                  description=f"{frame.height} row(s) curate's {block} block removed{more}")
        except Exception as e:  # noqa: BLE001 - outside a flow run, or an API hiccup: the MLflow table stands
            flow_logger().warning("curate: could not publish the %s removals to Prefect: %s", block, e)


@flow(name="curate", log_prints=True, flow_run_name="curate")
def curate_flow(profile: str = "tiny", home: str | None = None, dask_processes: bool = True,
                sources: dict[str, TableRef] | None = None) -> dict:
    """Curate prompts not seen by an earlier run; returns table refs, counters and the MLflow run id.

    ``sources``: the ``prompts`` and ``benchmarks`` snapshots to curate (the pipeline hands over
    what ingest wrote); one not given is read at its newest.

    ``dask_processes=False`` runs Dask workers as threads (faster start, same code path).
    """
    log = flow_logger()
    report_progress("curate", "start")
    with flow_context("curate", profile, home, {"dask_processes": dask_processes}, sections=("curate",)) as ctx:
        cfg = ctx.profile.section("curate", CurateConfig)
        inputs = {name: ref for name in CURATED_INPUTS if (ref := ctx.wh.pinned(name, sources)) is not None}
        for ref in inputs.values():
            tracking.log_table(ref, context="input", run_id=ctx.run_id)
        core = ctx.profile.core
        if cfg.model_repair.enabled:
            log.info("curate: model repair on (%s via %s): unparseable math answers extracted, tests written for "
                     "code rows without them, each checked before use", cfg.model_repair.rollout.model,
                     cfg.model_repair.rollout.backend)
        result = curate_task(str(ctx.wh.home), cfg, ctx.run_id, core.task_runner, core.dask.model_dump(),
                             dask_processes, inputs)
        log_curate(result, {"minhash_candidate_jaccard": cfg.minhash.threshold,
                            "semantic_nearest_cosine": cfg.semantic.threshold,
                            "decontam_embedding_cosine": cfg.decontam.embedding_threshold}, run_id=ctx.run_id)
        if result.counters.get("from_scratch"):
            log.info("curate: the pools were made with other settings (or unrecorded ones): every prompt "
                     "is curated again; the previous pool snapshots stay for comparison")
        if not any(stage.rows_in for stage in result.stages.values()):
            log.info("curate: no new prompts since the last curated snapshot: nothing to curate, the pools "
                     "stand as they are")
        else:
            for stage in result.stages.values():
                log.info("%s: %d in, %d kept, %d removed %s", stage.stage, stage.rows_in, stage.kept,
                         stage.removed_total, dict(stage.removed))
        removed = removed_rows(ctx.wh, ctx.run_id, inputs.get("prompts"), inputs.get("benchmarks"))
        log_removed(removed, run_id=ctx.run_id)
        publish_removed(removed)
        outputs = ctx.log_outputs(result.refs)
        report_progress("curate", "done")
        return {"mlflow_run_id": ctx.run_id, "tables": outputs, "runner": core.task_runner,
                "stages": {s.stage: s.counters() for s in result.stages.values()}, **result.counters}
