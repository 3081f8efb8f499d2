"""MLflow tracking through real Prefect flow runs and a real SQLite MLflow store."""
import json

from mlflow.tracking import MlflowClient

from tasks import tracking


def _client(home):
    return MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")


def test_pipeline_run_has_child_runs_with_dataset_inputs(home, tmp_path, monkeypatch):
    from flows.pipeline import pipeline_flow
    monkeypatch.setenv("POSTTRAIN__CURATE__MINHASH__THRESHOLD", "0.6")   # an override: in the run's name
    res = pipeline_flow(profile="tiny", stages=["ingest"], home=str(home))
    client = _client(home)
    parent = client.get_run(res["mlflow_run_id"])
    assert parent.data.tags["posttrain.profile"] == "tiny"
    assert parent.data.tags.get("prefect.flow_run_id")
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert [c.data.tags["posttrain.stage"] for c in children] == ["ingest"]
    child = children[0]
    assert child.data.tags["prefect.flow_run_id"] != parent.data.tags["prefect.flow_run_id"]
    names = {d.dataset.name.split("@")[0]: d for d in child.inputs.dataset_inputs}
    assert {"prompts", "benchmarks"} <= set(names)
    assert names["prompts"].dataset.digest
    assert json.loads(names["prompts"].dataset.profile)["num_rows"] == res["tables"]["prompts"]
    assert child.data.metrics["ingest.rows_in"] == child.data.metrics["ingest.stored_prompts"] + \
        child.data.metrics["ingest.stored_benchmarks"] + child.data.metrics["ingest.quarantined"] + \
        child.data.metrics["ingest.already_present"]
    assert child.data.metrics["ingest.stored_benchmarks"] >= 374 + 164
    # the Prefect flow run links to its MLflow run and report (an artifact on its page)
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    with get_client(sync_client=True) as prefect:
        arts = prefect.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["posttrain-run-summary"])))
        # flow runs named by what they are (the stages, the overridden settings), not a random
        # adjective-animal, and the MLflow run alike
        title = "pipeline tiny [ingest] curate.minhash.threshold=0.6"
        assert prefect.read_flow_run(parent.data.tags["prefect.flow_run_id"]).name == title
        assert parent.info.run_name == title
        assert prefect.read_flow_run(child.data.tags["prefect.flow_run_id"]).name == "ingest"
    mine = [a for a in arts if str(a.flow_run_id) == parent.data.tags["prefect.flow_run_id"]]
    assert len(mine) == 1 and res["mlflow_run_id"] in mine[0].data and res["report"] in mine[0].data
    # the UI opens it as a model-training experiment, not in its GenAI (traces) view
    experiment = client.get_experiment(parent.info.experiment_id)
    assert experiment.tags[tracking.EXPERIMENT_KIND_TAG] == "custom_model_development"


def test_an_experiment_made_without_a_kind_gets_one(home):
    client = _client(home)
    tracking.configure(f"sqlite:///{home / 'mlflow.db'}")
    made = client.create_experiment("by-hand")
    assert tracking.ensure_experiment("by-hand", home) == made
    assert client.get_experiment(made).tags[tracking.EXPERIMENT_KIND_TAG] == tracking.MODEL_TRAINING_KIND


def test_tracked_run_nests_and_restores(home):
    with tracking.tracked_run("outer", tracking_uri=f"sqlite:///{home / 'mlflow.db'}") as outer:
        with tracking.tracked_run("inner", params={"a": {"b": 1}, "lst": [1, 2]}) as inner:
            assert tracking.current_run_id() == inner
            tracking.log_counters({"x": 1.0, "nan": float("nan")}, prefix="p")
        assert tracking.current_run_id() == outer
    assert tracking.current_run_id() is None
    run = _client(home).get_run(inner)
    assert run.data.params == {"a.b": "1", "lst": "[1, 2]"}
    assert run.data.metrics == {"p.x": 1.0}
    assert run.data.tags["mlflow.parentRunId"] == outer
    assert run.info.status == "FINISHED"


def test_pipeline_skips_unchanged_stage_and_reruns_on_config_change(home, monkeypatch):
    from flows.pipeline import pipeline_flow
    from warehouse import Warehouse
    first = pipeline_flow(profile="tiny", stages=["ingest"], home=str(home))
    second = pipeline_flow(profile="tiny", stages=["ingest"], home=str(home))
    assert second["ingest"]["skipped"] is True
    assert second["ingest"]["mlflow_run_id"] == first["ingest"]["mlflow_run_id"]
    monkeypatch.setenv("POSTTRAIN__INGEST__REASONING_GYM_PER_TASK", "21")
    third = pipeline_flow(profile="tiny", stages=["ingest"], home=str(home))
    assert not third["ingest"].get("skipped")
    # only the new generator rows were stored
    assert third["ingest"]["stored"]["prompts"] == 6 and third["ingest"]["already_present"] > 0
    assert Warehouse(home).read("stage_runs").height == 2


def test_a_flow_called_from_a_pipeline_task_logs_to_its_own_flow_run():
    """A stage's flow runs inside the pipeline's stage task: its log records (curate's counts)
    belong on its own flow run, not on the task that called it (Prefect's get_run_logger picks
    the enclosing task's)."""
    from prefect import flow, task
    from prefect.runtime import flow_run

    from flows.common import flow_logger

    seen = {}

    @flow(name="inner-stage")
    def inner():
        seen["inner"] = str(flow_run.get_id())
        seen["logged_to"] = str(flow_logger().extra.get("flow_run_id"))

    @task(name="stage")
    def stage():
        seen["task_logged_to"] = str(flow_logger().extra.get("flow_run_id"))
        inner()

    @flow(name="outer-pipeline")
    def outer():
        seen["outer"] = str(flow_run.get_id())
        stage()

    outer()
    assert seen["logged_to"] == seen["inner"] != seen["outer"]
    assert seen["task_logged_to"] == seen["outer"]   # a task's own records stay on its run


_FIRST_COMMAND = """
import sys, time
from pathlib import Path
home, go = sys.argv[1], Path(sys.argv[2])
from tasks import tracking
Path(f"{go}.{sys.argv[3]}").touch()   # imported: ready for the go
while not go.exists():
    time.sleep(0.005)
tracking.configure(home=home)
experiment = tracking.ensure_experiment("posttrain-race", home=home)
with tracking.tracked_run(sys.argv[3], experiment="posttrain-race") as run_id:
    tracking.log_counters({"rows": 1})
print(run_id)
"""


def test_commands_started_at_once_on_a_new_home_share_one_store(tmp_path):
    """Four processes open a home's MLflow store that does not exist yet, released at the same
    moment: one creates it (MLflow's migrations under the store's lock), the others wait and
    use it; each records its run. Without the lock two of them run the migrations on the same
    file and fail ("duplicate column name", "table _alembic_tmp_metrics already exists")."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    from mlflow.tracking import MlflowClient

    from tasks import tracking
    from tasks.train.engine import subprocess_env

    home, go = tmp_path / "home", tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", _FIRST_COMMAND, str(home), str(go), f"command-{i}"],
                              env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(4)]
    deadline = time.time() + 240
    while not all(Path(f"{go}.command-{i}").exists() for i in range(4)):   # all imported, all waiting
        assert time.time() < deadline and all(p.poll() is None for p in procs), [p.poll() for p in procs]
        time.sleep(0.05)
    go.touch()
    outs = [p.communicate(timeout=240) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    client = MlflowClient(tracking_uri=tracking.default_tracking_uri(home))
    runs = client.search_runs([client.get_experiment_by_name("posttrain-race").experiment_id])
    assert sorted(r.info.run_name for r in runs) == [f"command-{i}" for i in range(4)]
    assert {r.info.run_id for r in runs} == {out.strip().splitlines()[-1] for out, _ in outs}
