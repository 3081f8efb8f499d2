"""Both UIs link each run to the other (issue #37, item 2), at the ports that actually serve
the home: a CLI run while `posttrain ui` serves the home runs its flows on that Prefect server
(not a temporary API), each flow run gets a Prefect link artifact to its MLflow run in the MLflow
UI `ui` started, each MLflow run's description links its Prefect flow run, and the report's run
links use the served MLflow port. Real servers: `posttrain ui` in a subprocess, bound to
127.0.0.1 and stopped when the test ends."""
from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path

import httpx
from test_cli import POSTTRAIN, _started_ui


def test_a_cli_run_while_ui_serves_the_home_links_both_ways(tmp_path):
    from mlflow.tracking import MlflowClient

    home = tmp_path / "home"
    ui, seen = _started_ui(home)
    try:
        prefect = re.search(r"Prefect UI: (\S+)", seen).group(1)
        mlflow_ui = re.search(r"MLflow UI:\s+(http://127\.0\.0\.1:\d+)", seen).group(1)
        env = {**os.environ, "POSTTRAIN_HOME": str(home), "COLUMNS": "200"}
        env.pop("PREFECT_API_URL", None)
        out = subprocess.run([POSTTRAIN, "run", "--profile", "tiny", "--stage", "ingest"], capture_output=True,
                             text=True, env=env, timeout=300, check=False)
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"using the Prefect server that serves this home: {prefect}" in out.stderr

        # this home's runs, found through its own MLflow store (the suite's Prefect database is
        # shared by every test, so names alone would pick another test's "pipeline tiny [ingest]")
        client = MlflowClient(tracking_uri=f"sqlite:///{home / 'mlflow.db'}")
        experiments = [e.experiment_id for e in client.search_experiments() if e.name != "Default"]
        mlflow_runs = {r.data.tags["posttrain.stage"]: r for r in client.search_runs(experiments)}
        api = f"{prefect}/api"
        for stage, name in (("pipeline", "pipeline tiny [ingest]"), ("ingest", "ingest")):
            flow_run_id = mlflow_runs[stage].data.tags["prefect.flow_run_id"]
            # the flow run is on the served server (a temporary API would have taken it with it)
            assert httpx.get(f"{api}/flow_runs/{flow_run_id}", timeout=30).json()["name"] == name
            artifacts = httpx.post(f"{api}/artifacts/filter", timeout=30, json={"artifacts": {
                "key": {"any_": ["mlflow-run"]}, "flow_run_id": {"any_": [flow_run_id]}}}).json()
            # a link (Prefect stores it as markdown, `[text](url)`) at the port the MLflow UI serves
            assert len(artifacts) == 1 and re.fullmatch(
                rf"\[MLflow run: .+\]\({re.escape(mlflow_ui)}/#/experiments/\w+/runs/"
                rf"{mlflow_runs[stage].info.run_id}\?workflowType=machine_learning\)", artifacts[0]["data"]), artifacts
            # MLflow: the run's description links back to its flow run on the served Prefect UI
            note = mlflow_runs[stage].data.tags["mlflow.note.content"]
            assert re.search(rf"\]\({re.escape(prefect)}/[\w/-]*flow-run/{flow_run_id}\)", note), note
        # the report links runs at the MLflow UI that serves the home, not a fixed port
        report = next(line for line in out.stdout.splitlines() if line.startswith("report: ")).split(" ", 1)[1]
        assert f"{mlflow_ui}/#/experiments/" in Path(report).read_text()
    finally:
        ui.send_signal(signal.SIGTERM)
        try:
            ui.wait(timeout=60)
        finally:
            if ui.poll() is None:
                ui.kill()
