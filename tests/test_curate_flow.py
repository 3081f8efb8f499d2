"""The curate flow end to end: pools, accounting, MLflow, and Dask giving the same decisions."""
from __future__ import annotations

import polars as pl
import pytest
from mlflow.tracking import MlflowClient

from flows.curate import curate_flow
from tasks import tracking
from tasks.curate.config import SemanticConfig
from tasks.curate.semantic import load_model
from tasks.ingest import store_records
from tasks.records import RawRecord
from warehouse import Warehouse

TEMPLATE = "A bag holds {n} red marbles and {m} blue marbles; how many ways can we draw {k} marbles of one colour"
PROMPTS = (
    [{"prompt": TEMPLATE.format(n=n, m=m, k=2) + "?", "answer": str(n + m), "domain": "math"}
     for n, m in [(3, 4), (5, 6), (7, 8)]]
    + [{"prompt": TEMPLATE.format(n=3, m=4, k=2) + " ?", "answer": "7", "domain": "math"},          # exact dup
       {"prompt": "Prove that the square root of two is irrational.", "answer": "0", "domain": "math"},
       {"prompt": "Is 97 a prime number, given it is odd?", "answer": "Yes", "domain": "math"},
       {"prompt": "Which is the largest? (A) 2 (B) 9 (C) 4", "answer": "B", "domain": "math"},
       {"prompt": "How many positive divisors does the number 3600 have?", "answer": "45", "domain": "math"},
       {"prompt": "Spell this word backward (example: sun -> nus): harbor", "answer": "robrah", "domain": "logic"},
       {"prompt": "Write a short poem about the sea and its colours.", "answer": "Waves...", "domain": "general"}]
)
BENCH = [{"item_id": "b1", "prompt": "How many positive divisors does the number 3600 have?", "answer": "45",
          "domain": "math"}]


@pytest.fixture(scope="module", autouse=True)
def model_once():
    load_model(SemanticConfig())


def _ingest(wh):
    store_records(wh, [RawRecord("t.jsonl", i + 1, data=r) for i, r in enumerate(PROMPTS)], "unit")
    store_records(wh, [RawRecord("b.jsonl", 1, data=BENCH[0])], "tinybench", kind="benchmarks")


def _decisions(wh: Warehouse) -> pl.DataFrame:
    return (wh.read("decisions").select("row_id", "stage", "decision", "reason", "reference_id",
                                        pl.col("score").round(4)).sort("row_id", "stage", "decision"))


def test_curate_flow_pools_accounting_mlflow(home, wh):
    _ingest(wh)
    out = curate_flow(profile="tiny", home=str(home))
    sft, rl = wh.read("sft_pool"), wh.read("rl_pool")
    assert out["sft_pool"] == sft.height and out["rl_pool"] == rl.height
    assert set(sft["pool"]) <= {"sft"} and set(rl["pool"]) <= {"rl"} and rl["verifiable"].all()
    assert not set(sft["cluster_id"]) & set(rl["cluster_id"])          # no cluster straddles the pools
    d = wh.read("decisions")
    removed = d.filter(pl.col("decision") == "removed")
    # rows in = rows kept + rows removed, over the whole run and per stage
    assert len(PROMPTS) == sft.height + rl.height + removed.height
    for stage, counts in out["stages"].items():
        assert counts["rows_in"] == counts["kept"] + counts["removed"], stage
        assert counts["removed"] == removed.filter(pl.col("stage") == stage).height
    reasons = dict(zip(*removed.group_by("reason").len().sort("reason").to_dict(as_series=False).values()))
    assert reasons["exact_duplicate"] == 1 and reasons["proof:proof_question"] == 1
    assert reasons["binary_answer:yes_no_true_false"] == 1
    assert removed.filter(pl.col("stage") == "curate.decontam")["reference_id"].to_list() == ["tinybench:b1"]
    rewritten = d.filter(pl.col("decision") == "rewritten")
    assert rewritten["reason"].to_list() == ["multiple_choice:rewritten_open_ended"]
    assert pl.concat([sft, rl]).filter(pl.col("id") == rewritten["row_id"][0])["answer"].to_list() == ["9"]

    tracking.configure(home=home)
    run = MlflowClient().get_run(out["mlflow_run_id"])
    assert run.data.metrics["curate.filter.rows_in"] == len(PROMPTS)
    assert run.data.metrics["curate.rows_new"] == len(PROMPTS)
    artifacts = {a.path for a in MlflowClient().list_artifacts(run.info.run_id, "plots")}
    assert {"plots/curate_funnel.png", "plots/curate_similarity.png"} <= artifacts
    # the removed rows, per block, in MLflow (a table) and in Prefect (a table artifact): what, why, matched what
    tables = {a.path for a in MlflowClient().list_artifacts(run.info.run_id, "curate/removed")}
    assert {"curate/removed/decontam.json", "curate/removed/exact.json", "curate/removed/filter.json"} <= tables
    import json
    from pathlib import Path
    table = json.loads(Path(MlflowClient().download_artifacts(run.info.run_id, "curate/removed/decontam.json")).read_text())
    row = dict(zip(table["columns"], table["data"][0]))
    assert row["prompt"] == BENCH[0]["prompt"] and row["matched_id"] == "tinybench:b1" and row["reason"]
    assert row["matched"] == BENCH[0]["prompt"]

    # each block is its own Prefect task run in the flow run's graph, in order
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    with get_client(sync_client=True) as prefect:
        runs = prefect.read_task_runs(flow_run_filter=FlowRunFilter(
            id=FlowRunFilterId(any_=[run.data.tags["prefect.flow_run_id"]])))
    names = [r.name.rsplit("-", 1)[0] for r in sorted(runs, key=lambda r: r.start_time)]   # "<task>-<suffix>"
    assert names == ["curate.filter", "curate.exact", "curate.minhash", "curate.semantic", "curate.keep",
                     "curate.decontaminate", "curate.split"], names
    assert all(r.state.is_completed() for r in runs)
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    with get_client(sync_client=True) as prefect:
        arts = prefect.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
            any_=[run.data.tags["prefect.flow_run_id"]])))
    removed_tables = {a.key: a for a in arts if a.type == "table"}
    assert {"curate-removed-decontam", "curate-removed-exact", "curate-removed-filter"} <= set(removed_tables)
    assert "tinybench:b1" in str(removed_tables["curate-removed-decontam"].data)
    assert "1 row(s)" in removed_tables["curate-removed-exact"].description


def test_changed_settings_recompute_every_row_and_unchanged_ones_do_not(home, wh, monkeypatch):
    """Re-curating with another MinHash threshold applies it to the rows already curated (new
    pool snapshots and decisions, the old ones kept); the same settings again change nothing."""
    _ingest(wh)
    # a reworded copy of the first template problem (Jaccard ~0.55, MiniLM cosine ~0.998): the
    # semantic stage removes it at the profile's settings, MinHash at 0.3. (The template rows
    # answer differently: other problems, linked at 0.3 but never duplicates.)
    reworded = TEMPLATE.format(n=3, m=4, k=2).replace("can we draw", "could we draw") + "?"
    store_records(wh, [RawRecord("r.jsonl", 1, data={"prompt": reworded, "answer": "7", "domain": "math"})],
                  "reworded")
    first = curate_flow(profile="tiny", home=str(home))
    monkeypatch.setenv("POSTTRAIN__CURATE__MINHASH__THRESHOLD", "0.3")
    monkeypatch.setenv("POSTTRAIN__CURATE__SEMANTIC__ENABLED", "false")
    second = curate_flow(profile="tiny", home=str(home))
    assert second["from_scratch"] == 1.0 and second["rows_new"] == len(PROMPTS) + 1
    assert second["stages"]["curate.filter"]["rows_in"] == len(PROMPTS) + 1
    decisions = wh.read("decisions").filter(pl.col("decision") == "removed")
    runs = {first["mlflow_run_id"]: None, second["mlflow_run_id"]: None}
    by_run = {r: set(decisions.filter(pl.col("run_id") == r)["row_id"]) for r in runs}
    stages = {r: set(decisions.filter(pl.col("run_id") == r).select("row_id", "stage").iter_rows()) for r in runs}
    assert stages[first["mlflow_run_id"]] != stages[second["mlflow_run_id"]]      # the new threshold acted
    assert second["stages"]["curate.minhash"]["removed"] > first["stages"]["curate.minhash"]["removed"]
    assert wh.history("sft_pool").height == 2                                     # the old pools stay
    assert set(wh.read("sft_pool")["id"]) | set(wh.read("rl_pool")["id"]) == (
        set(wh.read("prompts")["id"]) - by_run[second["mlflow_run_id"]])
    third = curate_flow(profile="tiny", home=str(home))
    assert third["from_scratch"] == 0.0 and third["rows_new"] == 0
    assert wh.history("sft_pool").height == 2


def test_dask_runner_gives_the_same_decisions(tmp_path, monkeypatch):
    homes = {}
    for runner in ("local", "dask"):
        home = tmp_path / runner
        home.mkdir()
        monkeypatch.setenv("POSTTRAIN_HOME", str(home))
        monkeypatch.setenv("POSTTRAIN__PROFILE__TASK_RUNNER", runner)
        monkeypatch.setenv("POSTTRAIN__CURATE__CHUNK_ROWS", "4")     # several map tasks per step
        wh = Warehouse(home)
        _ingest(wh)
        # thread workers: a 2-worker LocalCluster with processes=False starts in about a second here
        out = curate_flow(profile="tiny", home=str(home), dask_processes=False)
        assert out["runner"] == runner
        homes[runner] = wh
    local, dask = _decisions(homes["local"]), _decisions(homes["dask"])
    assert local.height > 0 and local.equals(dask)
    for name in ("sft_pool", "rl_pool"):
        cols = ["id", "prompt", "answer", "cluster_id", "pool"]
        assert homes["local"].read(name).select(cols).sort("id").equals(homes["dask"].read(name).select(cols).sort("id"))
