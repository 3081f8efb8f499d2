"""Each CLI command once, through a real subprocess."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

POSTTRAIN = shutil.which("posttrain", path=str(Path(sys.executable).parent)) or "posttrain"


def cli(*args, home, timeout=300, check=True):
    env = {**os.environ, "POSTTRAIN_HOME": str(home), "COLUMNS": "200"}
    proc = subprocess.run([POSTTRAIN, *args], capture_output=True, text=True, env=env, timeout=timeout,
                          check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"posttrain {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def cli_home(tmp_path_factory):
    home = tmp_path_factory.mktemp("cli_home")
    data = tmp_path_factory.mktemp("cli_data")
    (data / "mine.jsonl").write_text('{"question": "What is 6*7?", "answer": "42"}\n{"question": 5}\nnot json\n')
    out = cli("ingest", str(data / "mine.jsonl"), "--source", "mine", "--domain", "math", home=home)
    assert "quarantined 2" in out.stdout, out.stdout
    return home


def test_help_lists_commands(cli_home):
    out = cli("--help", home=cli_home).stdout
    for cmd in ("ingest", "table", "sql", "run", "ui"):
        assert cmd in out


def test_table_commands(cli_home, tmp_path):
    out = cli("table", "list", home=cli_home).stdout
    assert "prompts" in out and "quarantine" in out
    assert "What is 6*7?" in cli("table", "show", "prompts", home=cli_home).stdout
    assert "append" in cli("table", "history", "prompts", home=cli_home).stdout
    dest = tmp_path / "q.parquet"
    cli("table", "export", "quarantine", str(dest), home=cli_home)
    assert pl.read_parquet(dest).height == 2
    assert "no parents" in cli("table", "lineage", "prompts", home=cli_home).stdout


def test_sql_json(cli_home):
    out = cli("sql", "SELECT count(*) AS n FROM prompts", "--format", "json", home=cli_home).stdout
    assert json.loads(out) == [{"n": 1}]


def test_errors_are_one_line_and_nonzero(cli_home):
    bad = cli("table", "show", "../etc", home=cli_home, check=False)
    assert bad.returncode != 0 and bad.stderr.strip().startswith("error:") and len(bad.stderr.strip().splitlines()) == 1
    missing = cli("table", "show", "nope", home=cli_home, check=False)
    assert missing.returncode == 1 and "nope" in missing.stderr
    nothing = cli("ingest", home=cli_home, check=False)
    assert nothing.returncode == 2 and "error:" in nothing.stderr


def test_profile_commands(cli_home):
    assert "tiny" in cli("profile", "list", home=cli_home).stdout
    shown = json.loads(cli("profile", "show", "tiny", home=cli_home).stdout)
    assert shown["sections"]["profile"]["task_runner"] == "local"


def test_run_ingest_stage_prints_summary(tmp_path):
    home = tmp_path / "a-home-path-long-enough-to-pass-the-width-of-a-narrow-terminal"
    env = {**os.environ, "POSTTRAIN_HOME": str(home), "COLUMNS": "40"}   # piped into a narrow pager
    out = subprocess.run([POSTTRAIN, "run", "--profile", "tiny", "--stage", "ingest"], capture_output=True,
                         text=True, env=env, timeout=300, check=True).stdout
    assert "posttrain run summary" in out and "benchmarks" in out and "pipeline MLflow run" in out
    report = next(line for line in out.splitlines() if line.startswith("report: "))
    assert report.startswith(f"report: {home}") and report.endswith("report.html")   # one whole line


def test_ui_starts_both_servers_and_stops(tmp_path):
    out = cli("ui", "--duration", "1", "--prefect-port", "0", "--mlflow-port", "0", home=tmp_path, timeout=240).stdout
    assert "Prefect UI: http://127.0.0.1:" in out and "MLflow UI:  http://127.0.0.1:" in out


def _started_ui(home) -> tuple[subprocess.Popen, str]:
    """`posttrain ui` running in the background, and what it printed up to its MLflow URL."""
    import time

    env = {**os.environ, "POSTTRAIN_HOME": str(home), "COLUMNS": "200"}
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen([POSTTRAIN, "ui", "--prefect-port", "0", "--mlflow-port", "0"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = ""
    deadline = time.time() + 240
    while "MLflow UI:" not in seen and time.time() < deadline and proc.poll() is None:
        seen += proc.stdout.readline()
    return proc, seen


def test_ui_reuses_the_home_prefect_server_and_stops_on_sigterm(tmp_path):
    """A second `posttrain ui` on the same home reuses the first one's Prefect server (one
    database, one server); SIGTERM stops each like Ctrl-C, leaving no server behind."""
    import re
    import signal

    import psutil

    first, seen = _started_ui(tmp_path)
    second = None
    try:
        assert "Prefect UI: http://127.0.0.1:" in seen and "MLflow UI:" in seen, seen
        prefect_url = re.search(r"Prefect UI: (\S+)", seen).group(1)
        children = psutil.Process(first.pid).children(recursive=True)
        assert len(children) >= 2
        second, seen_again = _started_ui(tmp_path)
        assert f"Prefect UI: {prefect_url}" in seen_again and "reused" in seen_again, seen_again
        second_children = psutil.Process(second.pid).children(recursive=True)
        assert not any("prefect" in " ".join(c.cmdline()) for c in second_children)   # no second server
        for proc, kids in ((second, second_children), (first, children)):
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) in (0, 143)
            _, alive = psutil.wait_procs(kids, timeout=30)
            assert not alive, [c.cmdline() for c in alive]
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()


def test_gc(cli_home):
    assert "removed 0" in cli("gc", home=cli_home).stdout


def test_synthesize_command(tmp_path):
    out = cli("synthesize", "--per-task", "2", "--task", "game_of_24", "--task", "sudoku", home=tmp_path / "new").stdout
    assert "4 instances over 2 tasks" in out


def test_the_term_deadline_kills_the_temporary_prefect_server_os_exit_would_leave(monkeypatch):
    """After SIGTERM a command that will not stop is ended by ``os._exit``, which skips Prefect's
    exit handler for its temporary API server; the deadline kills that server first. A real
    ``SubprocessASGIServer`` whose process is a stand-in (a ``sleep``: the uvicorn server itself
    takes ~30 s to start on 2 cores)."""
    from prefect.server.api.server import SubprocessASGIServer

    from flows.cli import _kill_temporary_prefect_servers

    # a registry of its own: this test session's real temporary server must live on
    monkeypatch.setattr(SubprocessASGIServer, "_instances", {})
    server = SubprocessASGIServer(port=1)   # a port no one binds: only the registry entry is used
    server.server_process = subprocess.Popen(["sleep", "120"])
    try:
        _kill_temporary_prefect_servers()
        assert server.server_process.wait(timeout=10) == -9
    finally:
        if server.server_process.poll() is None:
            server.server_process.kill()
