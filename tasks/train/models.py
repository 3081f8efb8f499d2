"""The ``models`` table: registering a finished stage's model (a row with lineage, and
MLflow artifacts), and finding the model RL starts from."""
from __future__ import annotations

import json
from pathlib import Path

import polars as pl
from mlflow.tracking import MlflowClient

from data_specs.stages import STAGE_NAMES, earlier_stages
from tasks import tracking
from warehouse import TableRef, Warehouse


def _size_mb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20


def register_model(wh: Warehouse, *, run_name: str, stage: str, result: dict, init_model: str, profile: str,
                   parents: list[TableRef], config_hash: str, mlflow_run_id: str | None,
                   log_weights_max_mb: float) -> TableRef:
    """Append the model to ``models`` with ``parents`` = the snapshots it was trained on."""
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
           "config_hash": config_hash, "mlflow_run_id": mlflow_run_id, "num_parameters": num_parameters}
    return wh.append("models", pl.DataFrame([row], schema_overrides={"final_loss": pl.Float64,
                                                                     "num_parameters": pl.Int64}),
                     parents=parents)


def _prod(shape) -> int:
    out = 1
    for s in shape:
        out *= int(s)
    return out


POLICY_MODEL = "policy"


def stage_model(wh: Warehouse, stage: str) -> str:
    """The newest model a training stage produced in this home (``model: judge`` in a profile)."""
    models = wh.read("models", default_empty=True).filter(pl.col("stage") == stage)
    if models.is_empty():
        raise LookupError(f"model {stage!r}: the `models` table of {wh.home} has no model of stage {stage!r}; "
                          f"train it first (`posttrain train --stage {stage}`) or name a model")
    return str(models["path"][-1])


def rl_start_model(wh: Warehouse) -> str:
    """The model the RL stage starts from: the newest ``models`` row of a policy stage before RL."""
    before_rl = earlier_stages(STAGE_NAMES[-1])
    models = wh.read("models", default_empty=True).filter(pl.col("stage").is_in(before_rl))
    if models.is_empty():
        raise LookupError(f"model {POLICY_MODEL!r}: no trained pre-RL stage in the `models` table of {wh.home}; "
                          "run the SFT/DPO stages first or name a model")
    return str(models["path"][-1])
