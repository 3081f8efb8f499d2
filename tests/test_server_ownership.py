"""`serve` and `ui` share a home's Prefect server without pulling it from under each other (issue
#37, item 6): `ui` never stops a server `serve` depends on, the last command out stops a server
whose starter has gone, and `serve` exits with a clear error when its server disappears. Real
servers and commands: `posttrain ui` and `posttrain serve` in subprocesses on 127.0.0.1, stopped
(by pid) when the test ends."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import httpx
import psutil
import pytest
from test_cli import POSTTRAIN, _started_ui


def _started_serve(home) -> tuple[subprocess.Popen, list[str]]:
    """`posttrain serve` (one deployment) reusing the home's server; its output, read as it comes."""
    env = {**os.environ, "POSTTRAIN_HOME": str(home), "COLUMNS": "250"}
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen([POSTTRAIN, "serve", "--deployment", "ingest", "--pool", "own-test", "--port", "0"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True).start()
    deadline = time.time() + 300
    while not any("worker running" in line for line in lines) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.5)
    assert proc.poll() is None and any("worker running" in line for line in lines), "".join(lines)
    return proc, lines


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/api/health", timeout=3).status_code == 200
    except httpx.HTTPError:
        return False


def _stop(*procs) -> None:
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture
def ui_then_serve(tmp_path):
    """`posttrain ui` started on a fresh home, then `posttrain serve` reusing its server: (ui, serve,
    serve's output lines, the server record); both stopped when the test ends."""
    home = tmp_path / "home"
    ui, _ = _started_ui(home)
    serve = None
    try:
        record = json.loads((home / "prefect" / "server.json").read_text())
        serve, lines = _started_serve(home)
        yield ui, serve, lines, record
    finally:
        _stop(serve, ui)


@pytest.mark.timeout(600)
def test_ui_leaves_the_server_serve_uses_and_serve_stops_it_last(ui_then_serve):
    ui, serve, lines, record = ui_then_serve
    assert any("reused" in line for line in lines), "".join(lines)
    ui.send_signal(signal.SIGTERM)
    out = ui.communicate(timeout=90)[0]
    assert ui.returncode in (0, 143) and "leaving the Prefect server" in out and "posttrain serve" in out, out
    time.sleep(8)   # longer than serve waits on a silent server
    assert _healthy(record["url"]) and serve.poll() is None
    serve.send_signal(signal.SIGTERM)
    serve.wait(timeout=120)
    assert "stopping the Prefect server" in "".join(lines), "".join(lines)
    _, alive = psutil.wait_procs([psutil.Process(record["pid"])], timeout=30) if psutil.pid_exists(
        record["pid"]) else ([], [])
    assert not alive and not _healthy(record["url"])


@pytest.mark.timeout(600)
def test_serve_exits_with_an_error_when_the_server_it_reused_goes_away(ui_then_serve):
    _, serve, lines, record = ui_then_serve
    os.killpg(record["pid"], signal.SIGKILL)   # the server dies under both commands
    rc = serve.wait(timeout=60)
    text = "".join(lines)
    assert rc == 1 and "is gone" in text and "start `posttrain serve` again" in text, text
