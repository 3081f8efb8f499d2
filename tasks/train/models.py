"""The ``models`` table: registering a finished stage's model (a row with lineage, the verdict
of its audit, and MLflow artifacts). Reading it (which model a stage or alias names, refused
when its audit failed) is ``tasks.model_registry``'s, below every stage that reads it."""
from __future__ import annotations

import json
from pathlib import Path

import polars as pl
from mlflow.tracking import MlflowClient

from data_specs import get_spec
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


def _prod(shape) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out
