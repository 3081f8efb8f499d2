"""The whole DAG on the tiny profile, end to end, with real Prefect, DuckDB, MLflow and DeepSpeed.

Sizes are scaled down through the profile's environment overrides (the same mechanism a
user has); the stages and their wiring are exactly those of `make run`.
"""
import json

import polars as pl
import pytest
from mlflow.tracking import MlflowClient

SMALL = {
    "POSTTRAIN__INGEST__REASONING_GYM_PER_TASK": "4",
    "POSTTRAIN__SYNTHESIZE__PER_TASK": "2",
    "POSTTRAIN__DIFFICULTY__MAX_ROWS_PER_TABLE": "6",
    "POSTTRAIN__TRAIN__SFT_SHORT__STEPS": "6",
    "POSTTRAIN__TRAIN__SFT_SHORT__CHECKPOINT_EVERY": "3",
    "POSTTRAIN__TRAIN__RL__STEPS": "2",
    "POSTTRAIN__TRAIN__RL__CHECKPOINT_EVERY": "1",
}


@pytest.mark.slow
def test_full_pipeline_then_unchanged_rerun_skips_everything(home, monkeypatch):
    for k, v in SMALL.items():
        monkeypatch.setenv(k, v)
    from flows.pipeline import pipeline_flow, stage_names
    from warehouse import Warehouse

    first = pipeline_flow(profile="tiny", home=str(home))
    wh = Warehouse(home)
    tables = set(wh.tables()["name"].to_list())
    assert {"prompts", "benchmarks", "sft_pool", "rl_pool", "synthetic_tasks", "rollouts", "difficulty",
            "references", "sft_data", "dpo_pairs", "rl_prompts", "models", "eval_results"} <= tables
    # one model per training stage, each with lineage to the data it saw
    models = wh.read("models")
    assert models.height == 5
    assert {e["parent"].split("@")[0] for e in wh.lineage("models")} >= {"sft_data", "dpo_pairs", "rl_prompts"}
    evals = wh.read("eval_results")
    assert set(evals["benchmark"]) >= {"aime2024", "math500", "humaneval"}
    assert evals["pass_at_k"].is_between(0, 1).all()
    # every filtering stage accounted for its rows
    decisions = wh.read("decisions")
    assert decisions["reason"].null_count() == 0 and decisions.height > 0
    # MLflow: one parent, one child per stage
    client = MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    parent = client.get_run(first["mlflow_run_id"])
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert {c.data.tags["posttrain.stage"] for c in children} >= {"ingest", "curate", "synthesize", "difficulty",
                                                                    "references", "evaluate"}
    assert (home / "artifacts" / "reports" / first["mlflow_run_id"] / "report.html").exists()

    again = pipeline_flow(profile="tiny", home=str(home))
    assert all(again[s].get("skipped") for s in stage_names()), {s: again[s].get("skipped") for s in stage_names()}
    assert wh.read("models").height == 5
    runs = wh.read("stage_runs")
    assert runs.height == len(stage_names())
    assert json.loads(runs.filter(pl.col("stage") == "evaluate")["outputs"].item())
