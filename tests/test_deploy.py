"""Deployments: prefect.yaml covers every flow, and a served deployment really runs.

The end-to-end test starts a real Prefect server (temporary PREFECT_HOME), a process work
pool and a worker, deploys the ingest flow from prefect.yaml, triggers it through the API,
checks the warehouse, and stops everything it started.
"""
from __future__ import annotations

import ast
import os
import re

import pytest

from flows.deploy import (
    REPO_ROOT,
    deploy,
    deployment_specs,
    ensure_prefect_server,
    prefect_api,
    run_deployment_and_wait,
    served,
)
from warehouse import Warehouse

STAGE_FLOWS = ["ingest", "curate", "synthesize", "difficulty", "references", "train", "evaluate", "sweep"]
SAMPLE_JOBS = {"samples-teacher": "teacher", "samples-on-policy": "on_policy"}


def test_prefect_yaml_has_the_pipeline_and_every_stage_flow():
    specs = {s.name: s for s in deployment_specs()}
    assert set(specs) == {"full", *STAGE_FLOWS, *SAMPLE_JOBS}
    assert specs["full"].entrypoint == "flows/pipeline.py:pipeline_flow"
    for name in STAGE_FLOWS:
        assert specs[name].entrypoint == f"flows/{name}.py:{name}_flow"
    for name, job in SAMPLE_JOBS.items():   # one flow, one deployment per job
        assert specs[name].entrypoint == "flows/samples.py:samples_flow" and specs[name].parameters["job"] == job
    for spec in specs.values():
        assert spec.parameters["profile"] == "tiny"
        assert spec.schedules, f"{spec.name} has no example schedule"
        for schedule in spec.schedules:
            assert re.fullmatch(r"[\d*/,-]+( [\d*/,-]+){4}", schedule["cron"]), schedule
            assert schedule["active"] is False


def flow_parameters(spec) -> set[str]:
    """Parameter names of the entrypoint function, read from its source (no import needed)."""
    tree = ast.parse(spec.flow_file.read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == spec.function)
    return {a.arg for a in fn.args.args + fn.args.kwonlyargs}


def test_deployment_parameters_exist_on_their_flows():
    """Every parameter a deployment sets is accepted by its flow (for flows already written)."""
    checked = 0
    for spec in deployment_specs():
        if spec.flow_file.exists():
            assert set(spec.parameters) <= flow_parameters(spec), (spec.name, spec.parameters)
            checked += 1
    assert checked >= 3   # pipeline, ingest, evaluate at least


def test_deploy_refuses_unknown_names_and_missing_entrypoints(tmp_path):
    with pytest.raises(ValueError, match=r"unknown deployment\(s\) \['nope'\]"):
        deploy("http://127.0.0.1:9/api", "pool", ["nope"])
    broken = tmp_path / "prefect.yaml"
    broken.write_text("deployments:\n  - name: ghost\n    entrypoint: flows/ghost.py:ghost_flow\n")
    with pytest.raises(FileNotFoundError, match=r"ghost \(flows/ghost.py:ghost_flow\)"):
        deploy("http://127.0.0.1:9/api", "pool", None, prefect_file=broken)


def _group_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)   # the service was started in its own session: pgid == pid
        return True
    except ProcessLookupError:
        return False


def test_served_ingest_deployment_runs_through_the_worker(home, tmp_path, monkeypatch):
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    user_file = tmp_path / "mine.jsonl"
    user_file.write_text('{"question": "What is 6*7?", "answer": "42"}\n{"question": 5}\n')

    with served(home=home, port=0, pool="test-pool", deployments=["ingest"]) as handle:
        assert handle.server is not None and handle.deployments == ["ingest/ingest"]
        # a second caller with PREFECT_API_URL pointing at it reuses this server
        monkeypatch.setenv("PREFECT_API_URL", handle.api_url)
        assert ensure_prefect_server(home, 0) == (handle.api_url, None)

        from prefect.client.orchestration import get_client
        with prefect_api(handle.api_url), get_client(sync_client=True) as client:
            deployment = client.read_deployment_by_name("ingest/ingest")
        assert deployment.work_pool_name == "test-pool"
        assert deployment.parameters == {"profile": "tiny", "bundled": True}
        assert [s.active for s in deployment.schedules] == [False]
        # code runs from this checkout: no clone, just a working directory
        assert deployment.pull_steps == [
            {"prefect.deployments.steps.set_working_directory": {"directory": str(REPO_ROOT)}}]

        run = run_deployment_and_wait(handle.api_url, "ingest/ingest", {
            "paths": [str(user_file)], "source": "mine", "domain": "math", "bundled": False}, timeout_s=240)
        assert run.state.is_completed(), run.state
        procs = [handle.server.proc, handle.worker.proc]

    wh = Warehouse(home)
    assert wh.read("prompts").get_column("prompt").to_list() == ["What is 6*7?"]
    assert wh.read("quarantine").height == 1
    assert wh.history("prompts").get_column("flow_run_id").to_list() == [str(run.id)]
    for proc in procs:
        assert proc.poll() is not None and not _group_alive(proc.pid)
