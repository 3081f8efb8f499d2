"""What every flow does first: load the profile, open the warehouse, start its MLflow run."""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from prefect import get_run_logger
from prefect.exceptions import MissingContextError

from tasks import tracking
from tasks.profile import Profile, load_profile
from warehouse import TableRef, Warehouse, WarehouseError, recording_flow_run


@dataclass
class FlowContext:
    profile: Profile
    wh: Warehouse
    run_id: str

    def log_outputs(self, refs: dict[str, TableRef] | list[TableRef]) -> dict[str, str]:
        items = refs.values() if isinstance(refs, dict) else refs
        for ref in items:
            tracking.log_table(ref, context="output", run_id=self.run_id)
        return {r.name: str(r) for r in items}


@contextmanager
def flow_context(stage: str, profile: str, home: str | None = None,
                 params: dict[str, Any] | None = None, sections: tuple[str, ...] = (),
                 run_name: str | None = None) -> Iterator[FlowContext]:
    prof = load_profile(profile)
    wh = Warehouse(home)
    tags = {"posttrain.profile": prof.name, "posttrain.config_hash": prof.config_hash(*sections)}
    run_params = {"profile": prof.name, **(params or {})}
    for s in sections:
        run_params[s] = prof.raw(s)
    # nested stages stay in the parent's store; a top-level run: profile, then environment, then home
    uri = None if tracking.current_run_id() else (
        prof.core.tracking_uri or os.environ.get(tracking.TRACKING_URI_ENV) or tracking.default_tracking_uri(wh.home))
    if uri and uri.startswith("sqlite:///") and wh.is_foreign(uri[len("sqlite:///"):]):
        raise WarehouseError(f"the MLflow store {uri} lies in a home {wh.home} was copied from "
                             f"({', '.join(wh.former_homes)}): a copy never writes into the original (unset "
                             "MLFLOW_TRACKING_URI, or point it at this home's mlflow.db)")
    with tracking.tracked_run(stage, params=run_params, tags={**tags, **prefect_run_tags()}, experiment=prof.core.experiment,
                              tracking_uri=uri, run_name=run_name) as run_id, \
            recording_flow_run(_prefect_flow_run_id()):
        link_runs(wh, run_id)
        yield FlowContext(prof, wh, run_id)


def prefect_run_tags() -> dict[str, str]:
    """The Prefect flow (and task) run an MLflow run belongs to, as its tags: ids, the flow's
    name, and the flow run's URL where a Prefect UI serves it (not a temporary API)."""
    from prefect.runtime import flow_run, task_run
    from prefect.settings import PREFECT_UI_URL

    tags = {}
    if flow_run.get_id():
        tags["prefect.flow_run_id"] = str(flow_run.get_id())
        tags["prefect.flow_name"] = str(flow_run.get_flow_name())
        if PREFECT_UI_URL.value():
            tags["prefect.flow_run_url"] = str(flow_run.get_flow_run_ui_url())
    if task_run.get_id():
        tags["prefect.task_run_id"] = str(task_run.get_id())
    return tags


def mlflow_run_url(mlflow_ui: str, experiment_id: str, run_id: str) -> str:
    """A run in the MLflow UI at ``mlflow_ui``, in its model-training view (not the GenAI one)."""
    return f"{mlflow_ui}/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"


def link_runs(wh: Warehouse, run_id: str) -> None:
    """Link this Prefect flow run and its MLflow run both ways: a Prefect link artifact to the run
    in the MLflow UI serving this home (``posttrain ui``; without one, a note saying how to open
    it), and the MLflow run's description naming the flow run, a link where a Prefect UI serves it.
    Nothing outside a Prefect flow run."""
    from mlflow.tracking import MlflowClient
    from prefect.runtime import flow_run

    from flows.services import running_mlflow_ui

    flow_run_id = flow_run.get_id()
    if not flow_run_id:
        return
    client = MlflowClient()
    run = client.get_run(run_id)
    name = run.data.tags.get("mlflow.runName", run_id)
    prefect_url = run.data.tags.get("prefect.flow_run_url")
    flow_run_name = flow_run.get_name()
    if prefect_url:
        note = f"Prefect flow run: [{flow_run_name}]({prefect_url})"
    else:
        note = (f"Prefect flow run `{flow_run_name}` (id `{flow_run_id}`): open `posttrain ui --home {wh.home}` "
                "and find it under Runs")
    tracking.set_tags({"mlflow.note.content": note}, run_id=run_id)
    try:
        from prefect.artifacts import create_link_artifact, create_markdown_artifact

        mlflow_ui = running_mlflow_ui(wh.home)
        if mlflow_ui:
            create_link_artifact(link=mlflow_run_url(mlflow_ui, run.info.experiment_id, run_id),
                                 link_text=f"MLflow run: {name}", key="mlflow-run",
                                 description=f"this flow run's MLflow run (`{run_id}`): params, metrics, plots")
        else:
            create_markdown_artifact(
                f"MLflow run **{name}** (`{run_id}`, experiment `{run.info.experiment_id}`). No MLflow UI serves "
                f"this home now: `posttrain ui --home {wh.home}` starts one and prints its address.",
                key="mlflow-run", description="this flow run's MLflow run")
    except Exception as e:  # noqa: BLE001 - a link must never fail the flow it describes
        flow_logger().warning("could not link the MLflow run %s in Prefect: %s", run_id, e)


def _prefect_flow_run_id() -> str | None:
    """This flow run's id, recorded on every snapshot it writes (None outside a Prefect flow)."""
    from prefect.runtime import flow_run

    fid = flow_run.get_id()
    return str(fid) if fid else None


def flow_logger():
    """The logger of the run this code is in: a task's own run, else the flow run. A flow called
    from a pipeline stage's task logs to its own flow run (Prefect's ``get_run_logger`` would
    give the enclosing stage task's, so a subflow's counts landed on the parent's log)."""
    from prefect.context import FlowRunContext, TaskRunContext
    from prefect.logging.loggers import flow_run_logger

    task_ctx, flow_ctx = TaskRunContext.get(), FlowRunContext.get()
    if flow_ctx is not None and flow_ctx.flow_run is not None and (
            task_ctx is None or task_ctx.task_run.flow_run_id != flow_ctx.flow_run.id):
        return flow_run_logger(flow_ctx.flow_run, flow_ctx.flow)
    try:
        return get_run_logger()
    except MissingContextError:  # called outside a flow or task run
        import logging
        return logging.getLogger("posttrain")


# The CLI installs a reporter to show stage progress; flows call it at stage boundaries.
_progress_hook: Callable[[str, str], None] | None = None


def set_progress_hook(hook: Callable[[str, str], None] | None) -> None:
    global _progress_hook
    _progress_hook = hook


# The pipeline stage whose run the caller is inside: flows a stage runs (the train flow and its
# per-stage steps under the pipeline's sft_short, ...) report nothing the stage's own bar does
# not already show. A context variable, so concurrent branches each see their own stage.
_progress_scope: ContextVar[str | None] = ContextVar("posttrain_progress_scope", default=None)


def report_progress(stage: str, event: str) -> None:
    if _progress_hook is None:
        return
    scope = _progress_scope.get()
    if scope is not None and stage != scope:
        return
    _progress_hook(stage, event)


@contextmanager
def progress_scope(stage: str) -> Iterator[None]:
    """Inside it, progress reports other than ``stage``'s own are left to ``stage``'s bar."""
    token = _progress_scope.set(stage)
    try:
        yield
    finally:
        _progress_scope.reset(token)
