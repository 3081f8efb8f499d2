"""Which registered model a name means: the ``models`` table read as paths in this home, the
newest model of a training stage, the model RL starts from (``policy``), and the refusal of a
model whose training-data audit failed. Below the stages that name models (train, evaluate,
the GenRM judge, the audit), so none of them reaches into another."""
from __future__ import annotations

import re
from collections.abc import Mapping

import polars as pl

from data_specs.stages import earlier_stages, first_of
from warehouse import TableRef, Warehouse

# A seed sweep's models (``posttrain sweep``) are registered under ``<run>~seed<k>``: they stand
# beside the run they were swept from and never become its newest model, the model a stage name
# means, or the ladder evaluate scores.
SWEEP_MARK = "~seed"


def sweep_run_name(run_name: str, seed: int) -> str:
    return f"{run_name}{SWEEP_MARK}{seed}"


def is_sweep_run(run_name: str | None) -> bool:
    return bool(run_name) and re.search(rf"{re.escape(SWEEP_MARK)}\d+$", run_name) is not None


def pipeline_models(models: pl.DataFrame) -> pl.DataFrame:
    """The rows of ``models`` a training run (not a seed sweep) registered."""
    if models.is_empty():
        return models
    return models.filter(~pl.col("run_name").map_elements(is_sweep_run, return_dtype=pl.Boolean))


def read_models(wh: Warehouse, sources: Mapping[str, TableRef] | None = None) -> pl.DataFrame:
    """The ``models`` table (empty if none), at the snapshot handed over in ``sources`` (else its
    newest), with its checkpoint paths (``path``, ``init_model``) as paths in this home: in a
    copied home, rows written before the copy name the original's directories, and a copy must
    never train or evaluate from (or write into) those."""
    ref = wh.pinned("models", sources)
    models = wh.read_ref(ref) if ref is not None else wh.read("models", default_empty=True)
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


POLICY_MODEL = "policy"


def stage_model(wh: Warehouse, stage: str, accept_failed_audit: bool = False,
                sources: Mapping[str, TableRef] | None = None) -> str:
    """The newest model a training stage produced in this home (``model: judge`` in a profile), as
    of the ``models`` snapshot handed over in ``sources`` (else the newest); refused when its audit
    failed, unless accepted."""
    models = pipeline_models(read_models(wh, sources)).filter(pl.col("stage") == stage)
    if models.is_empty():
        raise LookupError(f"model {stage!r}: the `models` table of {wh.home} has no model of stage {stage!r}; "
                          f"train it first (`posttrain train --stage {stage}`) or name a model")
    refuse_failed_audit(models.row(-1, named=True), accept_failed_audit)
    return str(models["path"][-1])


def rl_start_model(wh: Warehouse, accept_failed_audit: bool = False,
                   sources: Mapping[str, TableRef] | None = None) -> str:
    """The model the RL stage starts from: the newest ``models`` row of a policy stage before RL
    (as of the ``models`` snapshot handed over in ``sources``, else the newest); refused when its
    audit failed, unless accepted."""
    before_rl = earlier_stages(first_of("rl"))
    models = pipeline_models(read_models(wh, sources)).filter(pl.col("stage").is_in(before_rl))
    if models.is_empty():
        raise LookupError(f"model {POLICY_MODEL!r}: no trained pre-RL stage in the `models` table of {wh.home}; "
                          "run the SFT/DPO stages first or name a model")
    refuse_failed_audit(models.row(-1, named=True), accept_failed_audit)
    return str(models["path"][-1])
