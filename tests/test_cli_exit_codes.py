"""Exit codes of the installed ``posttrain`` entry point, run in a subprocess as CI would.

``CliRunner`` (test_cli.py, test_audit.py) calls the typer app and never goes through
``flows.cli:main``; ``main`` once dropped the code a command's ``typer.Exit`` carried, and a
failed audit exited 0. Each command that can fail cheaply is checked here, on a home that
holds the warehouse test_audit.py builds with the real stages.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
from test_audit import BENCH, built  # noqa: F401  (built: the audited warehouse, a fixture)

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
    assert says.lower() in err.lower() and "Traceback" not in err


def test_a_command_that_succeeds_exits_0(audited_home):
    rc, out, err = posttrain(audited_home, "table", "show", "sft_data", "--limit", "1")
    assert rc == 0, err
    assert "sft_data" in out
