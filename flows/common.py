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
    with tracking.tracked_run(stage, params=run_params, tags=tags, experiment=prof.core.experiment,
                              tracking_uri=uri, run_name=run_name) as run_id, \
            recording_flow_run(_prefect_flow_run_id()):
        yield FlowContext(prof, wh, run_id)


def _prefect_flow_run_id() -> str | None:
    """This flow run's id, recorded on every snapshot it writes (None outside a Prefect flow)."""
    from prefect.runtime import flow_run

    fid = flow_run.get_id()
    return str(fid) if fid else None


def flow_logger():
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
