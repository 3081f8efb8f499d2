"""MLflow tracking used by every flow.

One parent run per flow run (tagged with the Prefect flow run id), a nested child run per
stage, warehouse snapshots logged as dataset inputs (``name@snapshot`` with its content
digest), counters as metrics and plots as artifacts.

Runs are addressed by id through ``MlflowClient`` rather than MLflow's thread-local active
run, because Prefect executes tasks in worker threads (and training stages in
subprocesses): the current run id travels in a context variable, and in the
``POSTTRAIN_MLFLOW_RUN_ID`` environment variable for child processes.
"""
from __future__ import annotations

import contextvars
import json
import math
import os
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from warehouse import TableRef, posttrain_home

RUN_ID_ENV = "POSTTRAIN_MLFLOW_RUN_ID"
TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
_current_run: contextvars.ContextVar[str | None] = contextvars.ContextVar("posttrain_run", default=None)


def default_tracking_uri(home: str | os.PathLike | None = None) -> str:
    return f"sqlite:///{posttrain_home(home) / 'mlflow.db'}"


def configure(tracking_uri: str | None = None, home: str | os.PathLike | None = None) -> str:
    """Point MLflow at the configured store (default: SQLite under $POSTTRAIN_HOME); a home's own
    store copied from another home is relocated first (``relocate_store``)."""
    uri = tracking_uri or os.environ.get(TRACKING_URI_ENV) or default_tracking_uri(home)
    relocate_store(uri)
    mlflow.set_tracking_uri(uri)
    ensure_store(uri)
    return uri


_READY_STORES: set[str] = set()
STORE_LOCK_TIMEOUT_S = 300


def ensure_store(uri: str) -> None:
    """A SQLite store created (or migrated to this MLflow's schema) by one process at a time:
    MLflow builds its tables with alembic when it first opens a store, and two commands started
    at once on a new home would otherwise both run the migrations on the same file (one fails:
    "duplicate column name", "table _alembic_tmp_metrics already exists"). Holds
    ``<store>.lock`` while the first use opens it; MLflow then reuses the opened store in
    this process. Other stores are left to their server."""
    if not uri.startswith("sqlite:///") or uri in _READY_STORES:
        return
    from filelock import FileLock

    db = Path(uri[len("sqlite:///"):])
    db.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(db.with_name(db.name + ".lock")), timeout=STORE_LOCK_TIMEOUT_S):
        MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
    _READY_STORES.add(uri)


# where MLflow's SQLite store names artifact directories (MLflow 3: runs, experiments, logged models)
_ARTIFACT_COLUMNS = (("experiments", "artifact_location"), ("runs", "artifact_uri"),
                     ("logged_models", "artifact_location"))


def relocate_store(uri: str) -> int:
    """For a home's own SQLite store (``<home>/mlflow.db``) in a home copied or moved from
    elsewhere: point every experiment's, run's and logged model's artifact location that lies in
    a directory the home was copied from at the same place in this home, so a copy never writes
    artifacts into (or reads them from) the original. Returns the locations rewritten."""
    import sqlite3

    from warehouse import Warehouse

    if not uri.startswith("sqlite:///"):
        return 0
    db = Path(uri[len("sqlite:///"):])
    if not db.exists() or not (db.parent / "warehouse.duckdb").exists():
        return 0
    wh = Warehouse(db.parent)
    if not wh.former_homes:
        return 0
    changed = 0
    with sqlite3.connect(db, timeout=60) as con:
        tables = {r[0] for r in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        for table, column in _ARTIFACT_COLUMNS:
            if table not in tables:
                continue
            for old in wh.former_homes:
                old_uri, new_uri = Path(old).as_uri(), wh.home.as_uri()
                cur = con.execute(
                    f"UPDATE {table} SET {column} = ? || substr({column}, ?) "
                    f"WHERE substr({column}, 1, ?) = ? AND (length({column}) = ? OR substr({column}, ?, 1) = '/')",
                    [new_uri, len(old_uri) + 1, len(old_uri), old_uri, len(old_uri), len(old_uri) + 1])
                changed += cur.rowcount
    return changed


# The experiment kind says the experiment holds model training, not GenAI traces. (MLflow
# 3.17's UI still opens its GenAI view unless the URL says ?workflowType=machine_learning,
# which is the address `posttrain ui` prints.)
EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND = "mlflow.experimentKind", "custom_model_development"


def ensure_experiment(name: str, home: str | os.PathLike | None = None) -> str:
    """The experiment's id, created (as a model-training experiment) if it does not exist."""
    client = MlflowClient()
    exp = client.get_experiment_by_name(name)
    if exp is None:
        artifact_root = posttrain_home(home) / "artifacts" / "mlflow"
        artifact_root.mkdir(parents=True, exist_ok=True)
        try:
            return client.create_experiment(name, artifact_location=artifact_root.as_uri(),
                                            tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND})
        except mlflow.exceptions.MlflowException:
            exp = client.get_experiment_by_name(name)  # created concurrently by another process
    if EXPERIMENT_KIND_TAG not in exp.tags:  # made by an older version, or by hand
        client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND)
    return exp.experiment_id


def current_run_id() -> str | None:
    return _current_run.get() or os.environ.get(RUN_ID_ENV)


@contextmanager
def tracked_run(
    name: str,
    params: Mapping[str, Any] | None = None,
    tags: Mapping[str, str] | None = None,
    experiment: str | None = None,
    parent_run_id: str | None = None,
    tracking_uri: str | None = None,
    run_name: str | None = None,
) -> Iterator[str]:
    """Start a run (nested under the current one if any) and yield its id.

    ``name`` is the stage (the ``posttrain.stage`` tag); ``run_name``, what the UI shows,
    defaults to it.

    Without ``tracking_uri`` a nested run stays in its parent's store and a top-level run
    uses ``$MLFLOW_TRACKING_URI`` or the SQLite store under ``$POSTTRAIN_HOME``.
    """
    parent = parent_run_id or current_run_id()
    # mlflow.set_tracking_uri exports MLFLOW_TRACKING_URI: restore it (and our run id) on exit
    saved_env = {k: os.environ.get(k) for k in (RUN_ID_ENV, TRACKING_URI_ENV)}
    if tracking_uri or not parent:
        configure(tracking_uri)
    uri = mlflow.get_tracking_uri()
    client = MlflowClient()
    if parent:
        experiment_id = client.get_run(parent).info.experiment_id
    else:
        experiment_id = ensure_experiment(experiment or os.environ.get("POSTTRAIN_EXPERIMENT", "posttrain"))
    all_tags = {"mlflow.runName": run_name or name, "posttrain.stage": name, **(tags or {})}
    if parent:
        all_tags["mlflow.parentRunId"] = parent
    run = client.create_run(experiment_id, tags=all_tags, run_name=run_name or name)
    run_id = run.info.run_id
    token = _current_run.set(run_id)
    # child processes (launcher-started training ranks) log to the same run and store
    os.environ[RUN_ID_ENV] = run_id
    os.environ[TRACKING_URI_ENV] = uri
    status = "FAILED"
    try:
        if params:
            log_params(params, run_id=run_id)
        yield run_id
        status = "FINISHED"
    finally:
        _current_run.reset(token)
        # back to the parent run (not to what the variable held on entry: a sibling stage running
        # in another thread may have set it meanwhile), and the store as it was
        saved_env[RUN_ID_ENV] = parent
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        client.set_terminated(run_id, status=status)


@contextmanager
def stage_run(name: str, params: Mapping[str, Any] | None = None) -> Iterator[str]:
    """The active run when a flow already opened one (params logged to it), else a new run.

    Task-level entry points use this so they log to their flow's run when called from a
    flow, and still track themselves when called directly.
    """
    active = current_run_id()
    if active is None:
        with tracked_run(name, params=params) as run_id:
            yield run_id
        return
    if params:
        # the flow logged its configured section under "<name>."; these are the values in effect
        log_params({f"{name}.effective.{k}": v for k, v in params.items()}, run_id=active)
    yield active


def _require_run(run_id: str | None) -> str:
    rid = run_id or current_run_id()
    if rid is None:
        raise RuntimeError("no MLflow run is active: wrap the call in tracked_run(...)")
    return rid


def _flatten(params: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    flat: dict[str, str] = {}
    for k, v in params.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            flat.update(_flatten(v, f"{key}."))
        else:
            flat[key] = json.dumps(v, default=str) if isinstance(v, (list, tuple)) else str(v)
    return flat


def log_params(params: Mapping[str, Any], run_id: str | None = None) -> None:
    rid = _require_run(run_id)
    items = [Param(k[:250], v[:6000]) for k, v in _flatten(params).items()]
    for i in range(0, len(items), 100):
        MlflowClient().log_batch(rid, params=items[i:i + 100])


def set_tags(tags: Mapping[str, Any], run_id: str | None = None) -> None:
    rid = _require_run(run_id)
    MlflowClient().log_batch(rid, tags=[RunTag(k, str(v)) for k, v in tags.items()])


def log_counters(counters: Mapping[str, float], prefix: str = "", step: int = 0,
                 run_id: str | None = None) -> None:
    """Log numbers as metrics named ``prefix.key`` (NaN and infinities are skipped)."""
    import time as _time
    rid = _require_run(run_id)
    ts = int(_time.time() * 1000)
    metrics = [
        Metric(f"{prefix}.{k}" if prefix else str(k), float(v), ts, step)
        for k, v in counters.items()
        if v is not None and math.isfinite(float(v))
    ]
    for i in range(0, len(metrics), 500):
        MlflowClient().log_batch(rid, metrics=metrics[i:i + 500])


def log_table(ref: TableRef, context: str = "input", run_id: str | None = None,
              source: str | None = None) -> None:
    """Record a warehouse snapshot as a dataset input of the run (context: input/output)."""
    rid = _require_run(run_id)
    dataset = Dataset(
        name=f"{ref.name}@{ref.snapshot}",
        digest=(ref.content_hash or "")[:36],
        source_type="posttrain-warehouse",
        source=json.dumps({"uri": source or f"posttrain://{ref.name}@{ref.snapshot}"}),
        profile=json.dumps({"num_rows": ref.rows}),
    )
    MlflowClient().log_inputs(rid, datasets=[DatasetInput(dataset, tags=[InputTag("mlflow.data.context", context)])])


def log_figure(fig, artifact_path: str, run_id: str | None = None) -> None:
    """Save a matplotlib figure as a PNG artifact and close it."""
    import matplotlib.pyplot as plt
    rid = _require_run(run_id)
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / Path(artifact_path).name
        fig.savefig(local, dpi=110, bbox_inches="tight")
        plt.close(fig)
        parent = str(Path(artifact_path).parent)
        MlflowClient().log_artifact(rid, str(local), None if parent == "." else parent)


def log_artifact(path: str | os.PathLike, artifact_dir: str | None = None, run_id: str | None = None) -> None:
    MlflowClient().log_artifact(_require_run(run_id), str(path), artifact_dir)


def log_dict(data: Any, artifact_file: str, run_id: str | None = None) -> None:
    MlflowClient().log_dict(_require_run(run_id), data, artifact_file)


def log_text(text: str, artifact_file: str, run_id: str | None = None) -> None:
    MlflowClient().log_text(_require_run(run_id), text, artifact_file)
