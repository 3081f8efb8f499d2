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
from warehouse import TableRef, Warehouse, note_standing_output


def _size_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def register_model(wh: Warehouse, *, run_name: str, stage: str, result: dict, init_model: str, profile: str,
                   parents: list[TableRef], config_hash: str, mlflow_run_id: str | None,
                   log_weights_max_mb: float, audit_violations: int | None = None) -> TableRef:
    """Append the model to ``models`` with ``parents`` = the snapshots it was trained on, and the
    verdict of the training-data audit of what it saw (``audit_violations``: 0 passed, more
    failed; None: not audited). A model registered already (the same row but for the MLflow run:
    an earlier run of the stage was killed before the pipeline recorded it) is not added twice;
    the newest snapshot, which holds it, is returned and this MLflow run tagged with the one that
    registered it; that snapshot is what the stage hands over (``note_standing_output``), so the
    stage after it starts from this model."""
    path = Path(result["path"])
    num_parameters = None
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
    standing = _registered(wh, row)
    if standing is not None:
        # the same model from the same data, registered by an earlier run of the stage (one killed
        # before the pipeline recorded it, or re-run): it stands, and this run points at it
        if mlflow_run_id:
            tracking.set_tags({"posttrain.registered_by": standing}, run_id=mlflow_run_id)
        ref = wh.latest("models")
        note_standing_output(ref)
        return ref
    if mlflow_run_id:
        if _size_mb(path) <= log_weights_max_mb:
            MlflowClient().log_artifacts(mlflow_run_id, str(path), f"model/{stage}")
        else:  # too big to copy into the artifact store: log where it lives
            tracking.log_dict({"path": str(path)}, f"model/{stage}/location.json", run_id=mlflow_run_id)
        if (path / "config.json").exists():
            tracking.log_dict(json.loads((path / "config.json").read_text()), f"model/{stage}/config.json",
                              run_id=mlflow_run_id)
    frame = get_spec("models").conform(pl.DataFrame([row]))
    latest = wh.latest("models")
    if latest is not None and set(wh.scan("models", latest.snapshot).collect_schema().names()) != set(frame.columns):
        # a table written under an older spec (no audit columns): rewritten once, old rows unaudited
        old = get_spec("models").conform(wh.read_ref(latest))
        return wh.write("models", pl.concat([old, frame]), parents=[latest, *parents],
                        note="models spec v2: audit columns added")
    return wh.append("models", frame, parents=parents)


# what makes two registrations the same model: every column but the run that registered it
_SAME_MODEL = ("model_id", "path", "init_model", "profile", "steps", "final_loss", "data_snapshots", "config_hash",
               "num_parameters", "audit", "audit_violations")


def _registered(wh: Warehouse, row: dict) -> str | None:
    """The MLflow run that registered this very model already (the newest row of its
    ``model_id`` equal in every ``_SAME_MODEL`` column), or None; "" when that row names no run."""
    if not wh.exists("models"):
        return None
    rows = wh.read("models").filter(pl.col("model_id") == row["model_id"])
    if not rows.height or "audit" not in rows.columns:
        return None
    last = rows.row(-1, named=True)
    return (last.get("mlflow_run_id") or "") if all(last.get(c) == row[c] for c in _SAME_MODEL) else None


def _prod(shape) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out
