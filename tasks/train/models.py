"""The ``models`` table: registering a finished stage's model (a row with lineage, and
MLflow artifacts), and finding the model RL starts from."""
from __future__ import annotations

import json
from pathlib import Path

import polars as pl
from mlflow.tracking import MlflowClient

from data_specs import get_spec
from data_specs.stages import earlier_stages, stages_of
from tasks import tracking
from warehouse import TableRef, Warehouse


def _size_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def register_model(wh: Warehouse, *, run_name: str, stage: str, result: dict, init_model: str, profile: str,
                   parents: list[TableRef], config_hash: str, mlflow_run_id: str | None,
                   log_weights_max_mb: float, audit_violations: int | None = None) -> TableRef:
    """Append the model to ``models`` with ``parents`` = the snapshots it was trained on, and the
    verdict of the training-data audit of what it saw (``audit_violations``: 0 passed, more
    failed; None: not audited)."""
    path = Path(result["path"])
    num_parameters = None
    config_file = path / "config.json"
    if mlflow_run_id:
        if _size_mb(path) <= log_weights_max_mb:
            MlflowClient().log_artifacts(mlflow_run_id, str(path), f"model/{stage}")
        else:  # too big to copy into the artifact store: log where it lives
            tracking.log_dict({"path": str(path)}, f"model/{stage}/location.json", run_id=mlflow_run_id)
        if config_file.exists():
            tracking.log_dict(json.loads(config_file.read_text()), f"model/{stage}/config.json", run_id=mlflow_run_id)
    safetensors = list(path.glob("*.safetensors"))
    if safetensors:
        from safetensors import safe_open
        num_parameters = 0
        for f in safetensors:
            with safe_open(str(f), "pt") as fh:
                for key in fh.keys():  # noqa: SIM118 - safe_open handles are not mappings
                    num_parameters += _prod(fh.get_slice(key).get_shape())
    row = {"model_id": f"{run_name}/{stage}", "run_name": run_name, "stage": stage, "path": str(path),
           "init_model": init_model, "profile": profile, "steps": int(result.get("steps", 0)),
           "final_loss": result.get("final_loss"), "data_snapshots": json.dumps([str(p) for p in parents]),
           "config_hash": config_hash, "mlflow_run_id": mlflow_run_id, "num_parameters": num_parameters,
           "audit": None if audit_violations is None else ("passed" if audit_violations == 0 else "failed"),
           "audit_violations": audit_violations}
    frame = get_spec("models").conform(pl.DataFrame([row]))
    latest = wh.latest("models")
    if latest is not None and set(wh.scan("models", latest.snapshot).collect_schema().names()) != set(frame.columns):
        # a table written under an older spec (no audit columns): rewritten once, old rows unaudited
        old = get_spec("models").conform(wh.read_ref(latest))
        return wh.write("models", pl.concat([old, frame]), parents=[latest, *parents],
                        note="models spec v2: audit columns added")
    return wh.append("models", frame, parents=parents)


def read_models(wh: Warehouse) -> pl.DataFrame:
    """The ``models`` table (empty if none) with its checkpoint paths (``path``, ``init_model``)
    as paths in this home: in a copied home, rows written before the copy name the original's
    directories, and a copy must never train or evaluate from (or write into) those."""
    models = wh.read("models", default_empty=True)
    if models.is_empty() or not wh.former_homes:
        return models
    return models.with_columns(pl.col(c).map_elements(wh.local_path, return_dtype=pl.Utf8)
                               for c in ("path", "init_model"))


class FailedAuditError(LookupError):
    """A model whose training-data audit failed was asked for without forcing."""


def refuse_failed_audit(row: dict, accept_failed_audit: bool = False) -> None:
    """Raise ``FailedAuditError`` for a ``models`` row whose audit failed, unless accepted."""
    if row.get("audit") == "failed" and not accept_failed_audit:
        raise FailedAuditError(
            f"model {row['model_id']!r} failed its training-data audit ({row.get('audit_violations')} violation(s) "
            f"in what it trained on; its MLflow run {row.get('mlflow_run_id')} holds audit/report.json): fix the data "
            f"and retrain the stage, or pass --accept-failed-audit to use it anyway")


def audited_row(wh: Warehouse, path: str) -> dict | None:
    """The newest ``models`` row whose checkpoint is ``path`` (None: not a registered model)."""
    rows = read_models(wh).filter(pl.col("path") == wh.local_path(path))
    return rows.row(-1, named=True) if rows.height else None


def _prod(shape) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out


POLICY_MODEL = "policy"


def stage_model(wh: Warehouse, stage: str, accept_failed_audit: bool = False) -> str:
    """The newest model a training stage produced in this home (``model: judge`` in a profile);
    refused when its audit failed, unless accepted."""
    models = read_models(wh).filter(pl.col("stage") == stage)
    if models.is_empty():
        raise LookupError(f"model {stage!r}: the `models` table of {wh.home} has no model of stage {stage!r}; "
                          f"train it first (`posttrain train --stage {stage}`) or name a model")
    refuse_failed_audit(models.row(-1, named=True), accept_failed_audit)
    return str(models["path"][-1])


def rl_start_model(wh: Warehouse, accept_failed_audit: bool = False) -> str:
    """The model the RL stage starts from: the newest ``models`` row of a policy stage before RL;
    refused when its audit failed, unless accepted."""
    before_rl = earlier_stages(stages_of("rl")[0])
    models = read_models(wh).filter(pl.col("stage").is_in(before_rl))
    if models.is_empty():
        raise LookupError(f"model {POLICY_MODEL!r}: no trained pre-RL stage in the `models` table of {wh.home}; "
                          "run the SFT/DPO stages first or name a model")
    refuse_failed_audit(models.row(-1, named=True), accept_failed_audit)
    return str(models["path"][-1])
