"""The audit as a gate (issue #32, item 2): a trained model is audited on what it saw before it
becomes its stage's newest model. A model that fails is recorded as failed, the stage fails, and
the next stage, ``evaluate`` and the aliases that name it refuse it unless forced.

Real components: the real ingest -> curate -> synthesize stages build the home, ``train_flow``
trains the tiny hybrid for two steps on DeepSpeed in process, and the installed ``posttrain``
entry point is run in a subprocess for the exit code. The planted fault is a benchmark item
written into the curated SFT pool (as a hand-edited or badly merged pool would carry it).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
from test_audit import BENCH, seed_curated

from tasks.audit import AuditFailed, model_scope, run_audit
from tasks.evaluate import choose_model, stage_ladder
from tasks.model_registry import FailedAuditError, rl_start_model, stage_model
from warehouse import TableRef

POSTTRAIN = str(Path(sys.executable).with_name("posttrain"))
TWO_STEPS = {"POSTTRAIN__TRAIN__SFT_SHORT__STEPS": "2", "POSTTRAIN__TRAIN__SFT_SHORT__CHECKPOINT_EVERY": "2",
             "POSTTRAIN__TRAIN__SFT_SHORT__LOG_EVERY": "1"}


def _plant_benchmark_in_pool(wh) -> pl.DataFrame:
    """The SFT pool with one row's prompt replaced by the benchmark item; the clean pool back."""
    clean = wh.read("sft_pool")
    assert BENCH["prompt"] not in clean["prompt"].to_list()   # curation removed it
    planted = clean.with_columns(pl.when(pl.int_range(pl.len()) == 0).then(pl.lit(BENCH["prompt"]))
                                 .otherwise(pl.col("prompt")).alias("prompt"))
    wh.write("sft_pool", planted, parents=[wh.latest("sft_pool")])
    return clean


def test_a_model_that_fails_the_audit_is_recorded_failed_and_refused_unless_forced(home, wh, monkeypatch):
    from flows.train import train_flow

    for key, value in TWO_STEPS.items():
        monkeypatch.setenv(key, value)
    seed_curated(wh, per_task=8)
    clean = _plant_benchmark_in_pool(wh)

    with pytest.raises(AuditFailed, match="no_benchmark_item") as failed:
        train_flow(profile="tiny", home=str(home), stages=["sft_short"])
    assert any("tinybench:b1" in o for c in failed.value.report.checks for o in c.offending)
    models = wh.read("models")
    assert models["stage"].to_list() == ["sft_short"]
    row = models.row(-1, named=True)
    assert row["audit"] == "failed" and row["audit_violations"] >= 1
    from mlflow.tracking import MlflowClient
    run = MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}").get_run(row["mlflow_run_id"])
    assert run.data.tags["posttrain.audit"] == "failed" and run.data.metrics["audit.violations"] >= 1

    # the next stage, evaluate and the aliases refuse it, naming the way out
    with pytest.raises(FailedAuditError, match="--accept-failed-audit"):
        train_flow(profile="tiny", home=str(home), stages=["sft_long"])
    for refuse in (lambda: choose_model(wh), lambda: stage_ladder(wh, ["base", "sft_short"]),
                   lambda: stage_model(wh, "sft_short"), lambda: rl_start_model(wh),
                   lambda: choose_model(wh, row["path"])):
        with pytest.raises(FailedAuditError, match=row["model_id"]):
            refuse()
    # forced: the caller gets it
    assert choose_model(wh, accept_failed_audit=True).path == row["path"]
    assert stage_ladder(wh, ["base", "sft_short"], accept_failed_audit=True)[-1].path == row["path"]
    # the installed command exits 1 with one line saying why, before sampling anything
    out = subprocess.run([POSTTRAIN, "evaluate", "--home", str(home), "--max-items", "1"],
                         check=False, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "failed its training-data audit" in out.stderr and "--accept-failed-audit" in out.stderr

    # the pool fixed: the stage retrains on clean data, passes, and is the stage's model again
    wh.write("sft_pool", clean, parents=[wh.latest("sft_pool")])
    res = train_flow(profile="tiny", home=str(home), stages=["sft_short"])
    assert res["stages"]["sft_short"]["audit"] == "passed" and not res["stages"]["sft_short"]["skipped"]
    newest = wh.read("models").row(-1, named=True)
    assert newest["audit"] == "passed" and newest["audit_violations"] == 0
    assert choose_model(wh).path == newest["path"] == stage_model(wh, "sft_short")


def _register(wh, stage: str, path: str, init_model: str, snapshots: list[TableRef]) -> None:
    from data_specs import get_spec

    row = {"model_id": f"gate-run/{stage}", "run_name": "gate-run", "stage": stage, "path": path,
           "init_model": init_model, "profile": "test", "steps": 1, "final_loss": 0.1,
           "data_snapshots": json.dumps([str(s) for s in snapshots]), "config_hash": "c", "mlflow_run_id": None,
           "num_parameters": 1, "audit": "passed", "audit_violations": 0}
    wh.append("models", get_spec("models").conform(pl.DataFrame([row])))


def test_the_gate_audits_the_snapshot_a_model_trains_on_and_its_starting_lineage(wh):
    """What one model saw: its own training snapshot and those of the models it started from
    (newer snapshots of the same tables are not its concern)."""
    from tasks.train.config import TrainConfig
    from tasks.train.data import write_training_tables

    seed_curated(wh, per_task=8)
    cfg = TrainConfig(base_model={"kind": "hybrid", "name": "gate-base", "tokenizer_texts": 300},
                      data={"synthetic_per_task": 8, "rl_requires_difficulty": False})
    from test_train_engine import SMALL_MODEL
    from transformers import AutoTokenizer

    from tasks.train.base_model import prepare_base_model
    tokenizer = AutoTokenizer.from_pretrained(prepare_base_model(wh, cfg.base_model, SMALL_MODEL))
    refs, _ = write_training_tables(wh, cfg, tokenizer, ["sft_data", "dpo_pairs", "rl_prompts"])
    _register(wh, "sft_short", "/m/sft_short", "/m/base", [refs["sft_data"]])
    _register(wh, "dpo_short", "/m/dpo_short", "/m/sft_short", [refs["dpo_pairs"]])
    # dpo_long had no rows in its range: it passed dpo_short's weights through under its own row
    _register(wh, "dpo_long", "/m/dpo_short", "/m/dpo_short", [refs["dpo_pairs"]])
    scope = model_scope(wh, [refs["rl_prompts"]], "/m/dpo_short")
    assert {n: [r.snapshot for r in rs] for n, rs in scope.items()} == {
        n: [refs[n].snapshot] for n in ("rl_prompts", "dpo_pairs", "sft_data")}
    report = run_audit(wh, scope, require_difficulty=False)
    assert report.passed, report.describe()
    # the same RL prompts when difficulty is required: none was decided, every one is flagged
    strict = run_audit(wh, scope)
    flagged = next(c for c in strict.checks if c.name == "rl_latest_difficulty_keep").offending
    assert len(flagged) == refs["rl_prompts"].rows
    # a contaminated SFT snapshot newer than the one the lineage trained on is not in this model's scope,
    # and fails an audit that names it
    sft = wh.read_ref(refs["sft_data"])
    bad = wh.write("sft_data", pl.concat([sft, sft.head(1).with_columns(pl.lit("planted").alias("example_id"),
                                                                       pl.lit(BENCH["prompt"]).alias("prompt"))]))
    assert run_audit(wh, scope, require_difficulty=False).passed
    contaminated = run_audit(wh, model_scope(wh, [bad], "/m/base"), require_difficulty=False)
    assert any("tinybench:b1" in o for c in contaminated.checks for o in c.offending)
    missing = run_audit(wh, {"sft_data": [TableRef("sft_data", "20990101T000000-deadbeef")]})
    assert any("not in this warehouse" in o for c in missing.checks for o in c.offending)
