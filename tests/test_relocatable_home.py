"""A copied home is safe to experiment in (issue #37, item 1): it never writes into, trains from
or evaluates from the original's files.

Real components: the real ingest -> curate -> synthesize stages, ``train_flow`` on DeepSpeed in
process (the tiny hybrid, two steps), MLflow's SQLite store and the warehouse catalog, copied
with ``shutil.copytree`` as a user would copy the directory.
"""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import polars as pl
import pytest
from test_audit import seed_curated
from test_audit_gate import TWO_STEPS

from warehouse import Warehouse, WarehouseError


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_stage_run_in_a_copied_home_leaves_the_original_byte_identical(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient

    from flows.train import train_flow
    from tasks.model_registry import read_models

    for key, value in {**TWO_STEPS, "POSTTRAIN__TRAIN__SFT_LONG__STEPS": "2",
                       "POSTTRAIN__TRAIN__SFT_LONG__CHECKPOINT_EVERY": "2"}.items():
        monkeypatch.setenv(key, value)
    original, copy = tmp_path / "original", tmp_path / "copy"
    monkeypatch.setenv("POSTTRAIN_HOME", str(original))
    seed_curated(Warehouse(original), per_task=8)
    first = train_flow(profile="tiny", home=str(original), stages=["sft_short"])
    assert first["stages"]["sft_short"]["path"].startswith(str(original))

    shutil.copytree(original, copy)
    before = _digests(original)
    monkeypatch.setenv("POSTTRAIN_HOME", str(copy))
    res = train_flow(profile="tiny", home=str(copy), stages=["sft_short", "sft_long"])
    after = _digests(original)
    assert after == before   # not one file of the original written, added or removed

    # the finished stage is reused from the copy's own checkpoint, and the next starts from it
    short = res["stages"]["sft_short"]
    assert short["skipped"] and short["path"].startswith(str(copy))
    models = read_models(Warehouse(copy))
    assert models.height == 3 and all(p.startswith(str(copy)) for p in models["path"].to_list())
    assert all(p.startswith(str(copy)) for p in models["init_model"].to_list())
    long_row = models.filter(pl.col("stage") == "sft_long").row(-1, named=True)
    assert long_row["init_model"] == short["path"]
    # MLflow: every experiment and run of the copy's store keeps its artifacts in the copy
    client = MlflowClient(tracking_uri=f"sqlite:///{copy / 'mlflow.db'}")
    experiments = [e for e in client.search_experiments() if e.name != "Default"]
    assert experiments and all(e.artifact_location.startswith(copy.as_uri()) for e in experiments)
    runs = client.search_runs([e.experiment_id for e in experiments])
    assert len(runs) >= 4 and all(r.info.artifact_uri.startswith(copy.as_uri() + "/") for r in runs)
    new_run = client.get_run(res["stages"]["sft_long"]["mlflow_run_id"])
    assert any(a.path == "model" for a in client.list_artifacts(new_run.info.run_id))
    assert (copy / "artifacts" / "mlflow").exists()

    # the original's tracking store, named from the copy, is refused before anything is written
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{original / 'mlflow.db'}")
    with pytest.raises(WarehouseError, match="copied from"):
        train_flow(profile="tiny", home=str(copy), stages=["sft_short"])
    assert _digests(original) == before


def test_paths_stored_before_a_copy_read_as_the_copy_s_own(tmp_path):
    original, copy = tmp_path / "a", tmp_path / "b"
    Warehouse(original)
    shutil.copytree(original, copy)
    wh = Warehouse(copy)
    assert wh.former_homes == (str(original),)
    assert wh.local_path(original / "checkpoints" / "run" / "final") == str(copy / "checkpoints" / "run" / "final")
    assert wh.local_path(str(tmp_path / "ab" / "x")) == str(tmp_path / "ab" / "x")   # a sibling, not inside
    assert wh.local_path("/elsewhere/model") == "/elsewhere/model"
    assert wh.is_foreign(original / "mlflow.db") and not wh.is_foreign(copy / "mlflow.db")
    assert Warehouse(original).former_homes == ()   # the original knows no copy
    # a copy of the copy maps both
    third = tmp_path / "c"
    shutil.copytree(copy, third)
    assert set(Warehouse(third).former_homes) == {str(original), str(copy)}


def test_a_prefect_server_record_copied_from_another_home_is_not_reused(tmp_path):
    """A copied home's ``prefect/server.json`` names the original's server, whose database is the
    original's: the copy starts its own instead of writing flow runs there."""
    import json
    import os
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from flows.services import running_prefect_server

    class Healthy(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Healthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        original, copy = tmp_path / "original", tmp_path / "copy"
        for home in (original, copy):
            (home / "prefect").mkdir(parents=True)
            (home / "prefect" / "server.json").write_text(
                json.dumps({"url": url, "pid": os.getpid(), "home": str(original)}))
        assert running_prefect_server(original) == url
        assert running_prefect_server(copy) is None
        assert not (copy / "prefect" / "server.json").exists()
    finally:
        server.shutdown()
