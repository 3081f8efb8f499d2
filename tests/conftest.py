"""Shared fixtures. Each test gets its own POSTTRAIN_HOME; Prefect keeps one home per session."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# before Prefect / MLflow / transformers are imported anywhere
_SESSION_DIR = tempfile.mkdtemp(prefix="posttrain-tests-")
# the process that made it removes it (xdist workers inherit the controller's PREFECT_HOME, so
# theirs stay empty; the controller exits after them)
atexit.register(shutil.rmtree, _SESSION_DIR, ignore_errors=True)
os.environ.setdefault("PREFECT_HOME", os.path.join(_SESSION_DIR, "prefect"))
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# TORCH_EXTENSIONS_DIR is left to tasks/train/proc.py's one resolution (the directory `make setup`
# builds DeepSpeed's comm op into), so a bare `pytest` never compiles it a second time elsewhere
os.environ.pop("MLFLOW_TRACKING_URI", None)
os.environ.pop("POSTTRAIN_MLFLOW_RUN_ID", None)

import pytest
import torch

# Without a GPU only Triton's interpreter runs kernels. It must be on before any module
# applies @triton.jit, whichever test file happens to import triton first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """The slow tests (the whole default run in one module fixture) first: under `make test`'s
    two workers one of them starts the pipeline at once and the other runs the rest meanwhile,
    instead of the pipeline starting mid-suite and running alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


_TRACKING_ENV = ("MLFLOW_TRACKING_URI", "POSTTRAIN_MLFLOW_RUN_ID")


@pytest.fixture(autouse=True)
def _isolated_tracking():
    """No test inherits another's MLflow store or active run through the environment: cleared
    before each test and again after it (``mlflow.set_tracking_uri`` exports the variable, and
    a module-scoped fixture of the next file runs before this fixture does)."""
    for name in _TRACKING_ENV:
        os.environ.pop(name, None)
    yield
    for name in _TRACKING_ENV:
        os.environ.pop(name, None)


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh POSTTRAIN_HOME for the test."""
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("POSTTRAIN_HOME", str(h))
    return h


@pytest.fixture
def wh(home):
    from warehouse import Warehouse
    return Warehouse(home)
