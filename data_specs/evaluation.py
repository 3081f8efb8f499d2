"""Tables of the evaluate stage: held-out pass@k per benchmark, and per item."""
from __future__ import annotations

import polars as pl

from data_specs.base import Column, TableSpec, register


def _unit_interval(c: pl.Expr) -> pl.Expr:
    return (c >= 0) & (c <= 1)


EVAL_RESULTS = register(TableSpec(
    "eval_results", version=2, key=("model", "benchmark", "k", "run_id"),
    description="Held-out pass@k of one model on one benchmark: the mean of the unbiased "
                "per-item estimates over the evaluated items.",
    columns=[
        Column("model", pl.Utf8, required=True, description="model id (models.model_id, or the path given)"),
        Column("model_path", pl.Utf8, description="checkpoint directory or alias that was loaded"),
        Column("stage", pl.Utf8, description="training stage that produced the model (base = before training; "
                                              "<stage>_seed<k>: a seed sweep's model of that stage); "
                                              "empty for a model named on the command line"),
        Column("benchmark", pl.Utf8, required=True),
        Column("n", pl.Int64, required=True, check=lambda c: c >= 1, check_reason="n_below_1",
               description="samples per item"),
        Column("k", pl.Int64, required=True, check=lambda c: c >= 1, check_reason="k_below_1"),
        Column("pass_at_k", pl.Float64, required=True, check=_unit_interval, check_reason="pass_at_k_outside_0_1"),
        Column("items", pl.Int64, required=True, check=lambda c: c >= 1, check_reason="no_items"),
        Column("correct", pl.Int64, required=True, check=lambda c: c >= 0, check_reason="negative_correct",
               description="correct samples over all items"),
        Column("temperature", pl.Float64, required=True),
        Column("top_p", pl.Float64, required=True),
        Column("max_tokens", pl.Int64),
        Column("seed", pl.Int64),
        Column("backend", pl.Utf8),
        Column("run_id", pl.Utf8, description="MLflow run of the evaluate stage"),
        Column("created", pl.Datetime("us"), required=True),
    ],
))

EVAL_ITEMS = register(TableSpec(
    "eval_items", version=2, key=("model", "benchmark", "item_id", "run_id"),
    description="Per evaluated item: samples, correct samples, and why scoring failed if it did. Every stage "
                "of a ladder scores the same items with the same seed: the rows pair across stages, which is "
                "what the paired intervals of stage-vs-stage differences resample.",
    columns=[
        Column("model", pl.Utf8, required=True),
        Column("stage", pl.Utf8, description="training stage that produced the model (base = before training; "
                                              "<stage>_seed<k>: a seed sweep's model of that stage); "
                                              "empty for a model named on the command line"),
        Column("benchmark", pl.Utf8, required=True),
        Column("item_id", pl.Utf8, required=True),
        Column("domain", pl.Utf8, required=True),
        Column("n", pl.Int64, required=True, check=lambda c: c >= 1, check_reason="n_below_1"),
        Column("correct", pl.Int64, required=True, check=lambda c: c >= 0, check_reason="negative_correct"),
        Column("pass_at_1", pl.Float64, required=True, check=_unit_interval, check_reason="pass_at_1_outside_0_1"),
        Column("mean_tokens", pl.Float64),
        Column("verify_errors", pl.Int64, description="samples the verifier could not score (counted wrong)"),
        Column("first_error", pl.Utf8),
        Column("run_id", pl.Utf8),
    ],
))
