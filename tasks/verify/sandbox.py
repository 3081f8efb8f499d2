"""Run untrusted Python in a confined subprocess (see _sandbox_launcher for the layers).

The parent side: a scratch dir per run, output captured to size-capped files (not pipes,
so neither a flood of output nor a leftover child holding a pipe can stall us), a wall
clock timeout, and on the way out the whole process group killed plus every process of
the run's private uid (a fork bomb's children may have left the group).
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

LAUNCHER = Path(__file__).with_name("_sandbox_launcher.py")
# Private uids start here; each run uses base + launcher pid, unique among live runs.
SANDBOX_UID_BASE = 1_000_000
OUTPUT_TAIL_CHARS = 4000
KILL_DEADLINE_S = 10.0   # how long the uid's processes are killed again while some are alive


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0
    cpu_s: int = 10
    memory_mb: int = 512
    max_processes: int = 16
    max_file_mb: int = 16
    max_open_files: int = 64
    tmpfs_mb: int = 16


@dataclass
class SandboxResult:
    status: str  # "passed" | "failed" | "timeout"
    returncode: int | None
    stdout: str
    stderr: str
    duration_s: float
    isolation: list[str]
    uid: int | None = None  # the private uid the run executed as (root only)

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def run_python_sandboxed(source: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``source`` as a script; "passed" means it ran to the end and exited 0."""
    limits = limits or SandboxLimits()
    scratch = Path(tempfile.mkdtemp(prefix="posttrain-sbx-"))
    capture = Path(tempfile.mkdtemp(prefix="posttrain-sbx-out-"))
    nonce = secrets.token_hex(16)
    try:
        (scratch / "program.py").write_text(source, encoding="utf-8")
        return _run(scratch, capture, nonce, limits)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        shutil.rmtree(capture, ignore_errors=True)


def _run(scratch: Path, capture: Path, nonce: str, limits: SandboxLimits) -> SandboxResult:
    stdout_path, stderr_path, report_path = capture / "stdout", capture / "stderr", capture / "report"
    started = time.monotonic()
    with open(stdout_path, "wb") as out, open(stderr_path, "wb") as err, open(report_path, "wb") as report:
        proc = _spawn(scratch, nonce, limits, out, err, report)
        uid = SANDBOX_UID_BASE + proc.pid
        timed_out = False
        try:
            proc.wait(timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_everything(proc, uid)
    duration = time.monotonic() - started
    stdout = _tail(stdout_path)
    # the CPU-time limit (SIGXCPU at the soft limit) is a time limit
    # too; which of it and the wall clock fires first is a race on an idle machine
    cpu_limited = proc.returncode == -signal.SIGXCPU
    if timed_out or cpu_limited:
        status = "timeout"
    elif proc.returncode == 0 and stdout.rstrip().endswith(nonce):
        status = "passed"
    else:
        status = "failed"
    return SandboxResult(
        status=status,
        returncode=proc.returncode,
        stdout=stdout.replace(nonce, "").rstrip(),
        stderr=_tail(stderr_path),
        duration_s=duration,
        isolation=_read_report(report_path),
        uid=uid if os.geteuid() == 0 else None,
    )


def _spawn(scratch: Path, nonce: str, limits: SandboxLimits, out, err, report) -> subprocess.Popen:
    settings = {
        "scratch": str(scratch),
        "nonce": nonce,
        # The base interpreter (the venv adds nothing: the program runs with -I -S).
        "python": os.path.realpath(sys._base_executable),
        "python_prefix": os.path.realpath(sys.base_prefix),
        "limits": asdict(limits),
        # The launcher's uid is uid_base + its own pid, which the parent learns after spawning.
        "uid_base": SANDBOX_UID_BASE,
        "report_fd": report.fileno(),
    }
    return subprocess.Popen(
        [sys.executable, "-I", "-S", str(LAUNCHER), json.dumps(settings)],
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=err,
        pass_fds=(report.fileno(),),
        env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
        start_new_session=True,  # own process group, killed as one
        close_fds=True,
        cwd=str(scratch),
    )


def _kill_everything(proc: subprocess.Popen, uid: int) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if os.geteuid() == 0:
        # Processes of the run's private uid can only be ones this run started; a process
        # running as that uid may signal exactly those, so kill(-1) from it is precise. One
        # pass can miss a fork bomb's child forked while it ran (seen on a loaded machine):
        # it repeats until none of the uid's processes is alive (zombies are dead).
        deadline = time.monotonic() + KILL_DEADLINE_S
        while True:
            subprocess.run(
                [sys.executable, "-I", "-S", "-c",
                 (f"import os\nos.setgid({uid})\nos.setuid({uid})\n"
                 "try:\n    os.kill(-1, 9)\nexcept ProcessLookupError:\n    pass\n")],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                timeout=30, check=False,
            )
            if not _alive(uid) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _alive(uid: int) -> bool:
    """Whether a process of ``uid`` is alive (running, sleeping or stopped; not a zombie)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if entry.stat().st_uid == uid and "State:\tZ" not in (entry / "status").read_text():
                return True
        except (FileNotFoundError, ProcessLookupError):
            continue
    return False


def _tail(path: Path) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - OUTPUT_TAIL_CHARS))
        return f.read().decode("utf-8", errors="replace")


def _read_report(path: Path) -> list[str]:
    try:
        return list(json.loads(path.read_text() or "[]"))
    except (OSError, ValueError):
        return []
