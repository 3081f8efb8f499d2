"""The synthesize table layer: run_synthesis fills synthetic_tasks deterministically for every
task, drops and records duplicates, follows calibration, logs to MLflow, runs inside a flow."""
import json

import polars as pl
import pytest
from mlflow.tracking import MlflowClient
from prefect import flow

from tasks.synth.config import SynthesizeConfig
from tasks.synth.registry import get_task, own_task_names
from tasks.synthesize import SynthesisConfigError, run_synthesis


def _runs(home):
    client = MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
    exps = client.search_experiments()
    return client, client.search_runs([e.experiment_id for e in exps])


def test_every_task_100_instances_twice_identical(wh, home):
    cfg = SynthesizeConfig()
    first = run_synthesis(wh, cfg, per_task=100, tasks=None, seed=0)
    second = run_synthesis(wh, cfg, per_task=100, tasks=None, seed=0)
    assert first.content_hash == second.content_hash and first.snapshot != second.snapshot
    table = wh.read("synthetic_tasks", first.snapshot)
    counts = dict(table.group_by("task").len().iter_rows())
    assert set(counts) == set(own_task_names())
    assert table["id"].n_unique() == table.height
    assert set(table["domain"].to_list()) == {"logic"}
    # every stored row verifies against its own gold answer, from the stored metadata alone
    from tasks.synth.base import TaskInstance
    for row in table.sample(120, seed=1).iter_rows(named=True):
        inst = TaskInstance(row["task"], row["level"], row["seed"], row["question"], row["prompt"],
                            row["answer"], json.loads(row["metadata"]))
        assert get_task(row["task"]).verify(inst, f"<answer>{row['answer']}</answer>") == 1.0
    # duplicates: rows + removed == draws, every removal recorded in decisions
    decisions = wh.read("decisions").filter(pl.col("stage") == "synthesize_dedup")
    per_run = decisions.height // 2
    short = {t: 100 - n for t, n in counts.items() if n < 100}
    assert all(decisions.filter(pl.col("row_id").str.starts_with(f"{t}/")).height > 0 for t in short)
    assert set(decisions["reference_id"].to_list()) <= set(table["id"].to_list())
    # counts and the level plot went to MLflow
    client, runs = _runs(home)
    run = next(r for r in runs if r.data.tags.get("posttrain.stage") == "synthesize")
    assert run.data.metrics["synthesize.rows"] == table.height
    assert run.data.metrics["synthesize.duplicates"] == per_run
    assert run.data.metrics["synthesize.sudoku.level_0"] == table.filter(
        (pl.col("task") == "sudoku") & (pl.col("level") == 0)).height
    artifacts = [a.path for a in client.list_artifacts(run.info.run_id, "plots")]
    assert "plots/synthetic_level_distribution.png" in artifacts


def test_calibrated_band_and_configured_levels(wh):
    calibration = pl.DataFrame({
        "task": ["sudoku", "cipher"], "n_levels": [6, 7], "lower_level": [1, 0], "upper_level": [2, 0],
        "status": ["band", "too_hard"], "probes": ["[]", "[]"], "instances_per_level": [1, 1],
        "base_samples": [1, 1], "strong_samples": [10, 10], "strong_k": [10, 10],
        "base_solver": ["b", "b"], "strong_solver": ["s", "s"],
    })
    cal_ref = wh.write("task_calibration", calibration)
    cfg = SynthesizeConfig(levels={"word_sorting": [3]}, default_levels=[0])
    ref = run_synthesis(wh, cfg, per_task=10, tasks=["sudoku", "cipher", "word_sorting", "survo"], seed=3)
    table = wh.read("synthetic_tasks", ref.snapshot)
    levels = {t: sorted(set(g["level"].to_list())) for (t,), g in table.group_by("task")}
    assert levels == {"sudoku": [1, 2], "word_sorting": [3], "survo": [0]}   # cipher: too hard, skipped
    sources = dict(table.select("task", "level_source").unique().iter_rows())
    assert sources["sudoku"] == "calibrated" and sources["survo"] == "configured"
    assert any(cal_ref.snapshot in str(p) for p in wh.lineage("synthetic_tasks", ref.snapshot))
    other_seed = run_synthesis(wh, cfg, per_task=10, tasks=["survo"], seed=4)
    assert other_seed.content_hash != run_synthesis(wh, cfg, per_task=10, tasks=["survo"], seed=3).content_hash


def test_bad_configuration_is_a_clear_error(wh):
    with pytest.raises(SynthesisConfigError, match=r"synthesize.levels.sudoku: levels \[9\]"):
        run_synthesis(wh, SynthesizeConfig(levels={"sudoku": [0, 9]}), per_task=2, tasks=["sudoku"], seed=0)
    with pytest.raises(ValueError, match="unknown synthetic task 'sodoku'"):
        run_synthesis(wh, SynthesizeConfig(), per_task=2, tasks=["sodoku"], seed=0)


def test_runs_inside_a_prefect_flow_with_reasoning_gym(wh, home):
    @flow(name="synthesize-test")
    def synthesize_flow(home_dir: str) -> str:
        from warehouse import Warehouse
        ref = run_synthesis(Warehouse(home_dir), SynthesizeConfig(default_levels=[0, 1]), per_task=5,
                            tasks=["game_of_24", "web_of_lies", "rg:basic_arithmetic"], seed=1)
        return str(ref)

    ref_text = synthesize_flow(str(home))
    table = wh.read("synthetic_tasks")
    assert ref_text.startswith("synthetic_tasks@")
    assert dict(table.group_by("task").len().iter_rows()) == {
        "game_of_24": 5, "web_of_lies": 5, "rg:basic_arithmetic": 5}
    direct = run_synthesis(wh, SynthesizeConfig(default_levels=[0, 1]), per_task=5,
                           tasks=["game_of_24", "web_of_lies", "rg:basic_arithmetic"], seed=1)
    assert direct.content_hash == wh.latest("synthetic_tasks").content_hash
    assert wh.read("synthetic_tasks").equals(table)


def test_calibration_flow_with_a_real_local_model_backend(home, monkeypatch, caplog):
    """`synthesize --calibrate` through real rollout backends (the tiny local model as both
    solvers): probes and the samples that decided them land in the warehouse, synthesis follows
    the stored band and reports the task it skips, the summary shows the band, and a rerun with
    the profile's own switch probes nothing it probed already."""
    for key, value in {"POSTTRAIN__SYNTHESIZE__CALIBRATION__INSTANCES_PER_LEVEL": "2",
                       "POSTTRAIN__SYNTHESIZE__CALIBRATION__BASE_SAMPLES": "2",
                       "POSTTRAIN__SYNTHESIZE__CALIBRATION__STRONG_SAMPLES": "2",
                       "POSTTRAIN__SYNTHESIZE__CALIBRATION__STRONG_K": "2",
                       "POSTTRAIN__SYNTHESIZE__CALIBRATION__MAX_TOKENS": "12",
                       "POSTTRAIN__ROLLOUT__REPETITION_WINDOW": "8"}.items():
        monkeypatch.setenv(key, value)
    from flows.pipeline import run_summary_markdown
    from flows.synthesize import synthesize_flow
    from warehouse import Warehouse
    res = synthesize_flow(profile="tiny", home=str(home), per_task=2, tasks=["word_sorting"],
                          calibrate=True, strong_model="tiny-llama")
    wh = Warehouse(home)
    cal = wh.read("task_calibration").row(0, named=True)
    assert cal["task"] == "word_sorting" and cal["base_solver"].startswith("base:tiny-llama@")
    assert cal["strong_solver"].startswith("strong:tiny-llama@") and cal["calibration_key"]
    probes = json.loads(cal["probes"])
    assert probes and all("level" in p for p in probes)
    assert set(res["tables"]) == {"task_calibration", "synthetic_tasks"}
    samples = wh.read("calibration_samples")
    assert samples.height == len(probes) * 2 * (2 + 2) and set(samples["solver"]) == {"base", "strong"}
    # a random model solves nothing even at level 0: the task is too hard for it, and
    # synthesis (skip_too_hard) draws no instances of it, and says so
    assert cal["status"] == "too_hard"
    assert res["instances"] == 0 and wh.read("synthetic_tasks").height == 0
    assert res["calibration"] == [{"task": "word_sorting", "lower_level": 0, "upper_level": 0, "n_levels": cal["n_levels"],
                                   "status": "too_hard"}]
    summary = run_summary_markdown({"mlflow_run_id": "r", "report": "x", "synthesize": res})
    assert "## Calibrated difficulty bands (M1)" in summary and "| word_sorting | skipped |" in summary

    # the profile's switch, no strong model: the model is its own strong solver (a new key: probed
    # again, sampled once per probe); then a rerun probes nothing
    monkeypatch.setenv("POSTTRAIN__SYNTHESIZE__CALIBRATION__ENABLED", "true")
    again = synthesize_flow(profile="tiny", home=str(home), per_task=2, tasks=["word_sorting"])
    shared = wh.read("task_calibration").row(0, named=True)
    assert shared["strong_solver"] == shared["base_solver"]          # the same model, named once
    assert shared["calibration_key"] != cal["calibration_key"] and again["calibration"][0]["status"] == "too_hard"
    grown = wh.read("calibration_samples").height
    assert grown == samples.height + len(json.loads(shared["probes"])) * 2 * 2
    with caplog.at_level("INFO", logger="prefect.flow_runs"):
        synthesize_flow(profile="tiny", home=str(home), per_task=2, tasks=["word_sorting"])
    assert wh.read("calibration_samples").height == grown
    assert wh.read("task_calibration").row(0, named=True)["calibration_key"] == shared["calibration_key"]
    assert any("unchanged since it was probed" in r.getMessage() for r in caplog.records)
    assert any("skipped, calibration found no level" in r.getMessage() for r in caplog.records)
