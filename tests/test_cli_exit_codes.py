"""Exit codes of the installed ``posttrain`` entry point, run in a subprocess as CI would.

``CliRunner`` (test_cli.py, test_audit.py) calls the typer app and never goes through
``flows.cli:main``; ``main`` once dropped the code a command's ``typer.Exit`` carried, and a
failed audit exited 0. Each command that can fail cheaply is checked here, on a home that
holds the warehouse test_audit.py builds with the real stages, or on a fresh empty home.

A failure is one ``error:`` line naming the problem, never a traceback (Prefect's own log of a
failed run included): exit 2 for a bad argument (caught before any flow or server starts), 1
for a failure of the work itself.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import polars as pl
import pytest
from test_audit import BENCH, built  # noqa: F401  (built: the audited warehouse, a fixture)

from flows.cli import _FLOW_COMMANDS
from warehouse import Warehouse

POSTTRAIN = shutil.which("posttrain", path=str(Path(sys.executable).parent))


def start(home: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "POSTTRAIN_HOME": str(home)}
    env.pop("PREFECT_HOME", None)   # a user's run: Prefect's state under the home, not the test session's
    return subprocess.Popen([POSTTRAIN, *args], env=env, cwd=home, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def posttrain(home: Path, *args: str) -> tuple[int, str, str]:
    proc = start(home, *args)
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def assert_one_error_line(out: str, err: str, says: str) -> None:
    """One ``error:`` line on stderr that names the problem, and no traceback anywhere."""
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and says.lower() in errors[0].lower(), (out, err)
    assert "Traceback" not in out + err, err


@pytest.fixture(scope="module")
def audited_home(built, tmp_path_factory):  # noqa: F811  (the imported fixture)
    """A copy of the audited warehouse (the commands below only read it)."""
    wh, *_ = built
    return Path(shutil.copytree(wh.home, tmp_path_factory.mktemp("cli") / "home"))


def test_the_entry_point_is_installed():
    assert POSTTRAIN is not None and Path(POSTTRAIN).parent == Path(sys.executable).parent


def test_audit_exits_1_on_a_planted_violation_and_0_on_a_clean_home(audited_home, tmp_path):
    clean = Path(shutil.copytree(audited_home, tmp_path / "clean"))
    # the case: an sft_data row whose prompt is a benchmark item
    dirty = Path(shutil.copytree(audited_home, tmp_path / "dirty"))
    wh = Warehouse(dirty)
    sft = wh.read("sft_data")
    wh.write("sft_data", pl.concat([sft, sft.head(1).with_columns(pl.lit("contaminated").alias("example_id"),
                                                                  pl.lit(BENCH["prompt"]).alias("prompt"))]))
    # side by side: each audit starts its own temporary Prefect API (most of its time)
    clean_run, dirty_run = start(clean, "audit"), start(dirty, "audit")
    clean_out, clean_err = clean_run.communicate(timeout=300)
    dirty_out, dirty_err = dirty_run.communicate(timeout=300)
    assert clean_run.returncode == 0, clean_out + clean_err
    assert "audit passed" in clean_out
    assert dirty_run.returncode == 1, dirty_out + dirty_err
    assert "FAILED" in dirty_out and "tinybench:b1" in dirty_out


@pytest.mark.parametrize(("args", "code", "says"), [
    (["audit", "--no-such-option"], 2, "No such option"),
    (["table", "show"], 2, "Missing argument"),
    (["table", "show", "no_such_table"], 1, "no_such_table"),
    (["table", "history", "no_such_table"], 1, "no_such_table"),
    (["table", "export", "sft_data", "out.txt"], 2, "unsupported extension"),
    (["sql", "select * from no_such_table"], 1, "no_such_table"),
    (["profile", "show", "no-such-profile"], 1, "unknown profile"),
    (["no-such-command"], 2, "No such command"),
])
def test_a_failing_command_exits_non_zero_with_one_error_line(audited_home, args, code, says):
    rc, out, err = posttrain(audited_home, *args)
    assert rc == code, (rc, out, err)
    assert_one_error_line(out, err, says)


def test_a_command_that_succeeds_exits_0(audited_home):
    rc, out, err = posttrain(audited_home, "table", "show", "sft_data", "--limit", "1")
    assert rc == 0, err
    assert "sft_data" in out


# Each command that can fail, on a fresh empty home: (arguments, exit code, what the error line says),
# the slow ones first. A failure of the work itself: a flow (and its temporary Prefect API) starts;
# the difficulty flow's own failure is the one `run` reports here.
CASES = {
    "train-with-no-data": (["train"], 1, "ingest or synthesize data before training"),
    "run-a-failing-stage": (["run", "--stage", "difficulty"], 1,
                            "difficulty: failed: LookupError: model 'policy': no trained pre-RL stage"),
    "compare-unknown-runs": (["compare", "no-such-run-a", "no-such-run-b"], 1,
                             "'no-such-run-a' is neither an MLflow run id nor an experiment name"),
    "report-unknown-run": (["report", "no-such-run"], 1, "no-such-run not found"),
    "serve-model-missing-model": (["serve-model", "no_such_model_dir"], 1,
                                  "'no_such_model_dir' is neither an alias"),
    "run-unknown-stage": (["run", "--stage", "no_such_stage"], 2, "unknown stage(s) ['no_such_stage']"),
    "samples-unknown-job": (["samples", "no_such_job"], 2, "not 'no_such_job'"),
    "train-unknown-stage": (["train", "--stage", "no_such_stage"], 2, "unknown stage(s) ['no_such_stage']"),
    "references-missing-labelled-file": (["references", "--labelled", "no_such_file.jsonl"], 2,
                                         "'no_such_file.jsonl' does not exist"),
    "table-lineage-unknown-table": (["table", "lineage", "no_such_table"], 1, "no_such_table"),
    # a --home that is a file: before any server starts
    "serve-home-is-a-file": (["serve", "--home", "not_a_dir", "--port", "0"], 2, "not_a_dir: not a directory"),
    "ui-home-is-a-file": (["ui", "--home", "not_a_dir", "--prefect-port", "0", "--mlflow-port", "0"], 2,
                          "not_a_dir: not a directory"),
    # every command that runs a flow refuses an unknown profile before the flow starts
    **{f"{cmd}-unknown-profile": ([cmd, "--profile", "no-such-profile"], 2, "unknown profile 'no-such-profile'")
       for cmd in sorted(_FLOW_COMMANDS)},
}


def processes_of(homes: list[Path]) -> list[str]:
    """Processes still running with one of ``homes`` as their POSTTRAIN_HOME (servers left behind)."""
    marks = {f"POSTTRAIN_HOME={h}".encode() for h in homes}
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if marks & set((proc / "environ").read_bytes().split(b"\0")):
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{proc.name}: {cmdline}")
        except OSError:   # gone meanwhile, or not ours
            continue
    return found


@pytest.fixture(scope="module")
def failed(tmp_path_factory) -> dict[str, tuple[int, str, str]]:
    """Every case's (exit code, stdout, stderr), run a few at a time, each in a home of its own
    (most of a case's time is the entry point's imports, or a temporary Prefect API starting)."""
    homes = {name: tmp_path_factory.mktemp(name) for name in CASES}
    for home in homes.values():
        (home / "not_a_dir").write_text("a file\n")
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = dict(zip(CASES, pool.map(lambda name: posttrain(homes[name], *CASES[name][0]), CASES)))
    deadline = time.time() + 15   # a server a command stopped may take a moment to go
    while (left := processes_of(list(homes.values()))) and time.time() < deadline:
        time.sleep(0.5)
    assert not left, f"processes left behind: {left}"
    return results


@pytest.mark.parametrize("case", list(CASES))
def test_each_command_that_fails_exits_non_zero_with_one_error_line(failed, case):
    _, code, says = CASES[case]
    rc, out, err = failed[case]
    assert rc == code, (rc, out, err)
    assert_one_error_line(out, err, says)


def test_every_flow_command_is_checked():
    assert {args[0] for args, _, _ in CASES.values() if "--profile" in args} == _FLOW_COMMANDS
