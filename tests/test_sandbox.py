"""Hostile programs must be contained, scored 0, and leave the machine as it was.

The fork bombs run with a process cap of 8 and a 2 s wall clock, so even a broken
sandbox could not take more than that from the shared machine.
"""
import os
from pathlib import Path

import pytest

from tasks.verify.code import verify_code
from tasks.verify.sandbox import SANDBOX_UID_BASE, SandboxLimits, run_python_sandboxed

LIMITS = SandboxLimits(timeout_s=2.0, cpu_s=2, memory_mb=256, max_processes=8)
PROMPT = "def add(a, b):\n    \"\"\"Add two numbers.\"\"\"\n"
TESTS = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n"


def sandbox_processes(uid: int | None = None) -> list[int]:
    """Live processes owned by ``uid`` (default: any sandbox uid); none may outlive a run."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                owner = entry.stat().st_uid
                owned = owner == uid if uid is not None else owner >= SANDBOX_UID_BASE
                if owned and "State:\tZ" not in (entry / "status").read_text():
                    pids.append(int(entry.name))
            except (FileNotFoundError, ProcessLookupError):
                continue
    return pids


def hostile(body: str) -> float:
    """Score ``body`` as the body of add(); a contained attack fails the tests."""
    return verify_code(PROMPT, body, TESTS, "add", LIMITS)


def test_a_correct_solution_passes_and_reports_its_isolation():
    result = run_python_sandboxed(PROMPT + "    return a + b\n\n" + TESTS + "\ncheck(add)\n", LIMITS)
    assert result.passed, result.stderr
    assert {"rlimits", "python_guard"} <= set(result.isolation)
    assert verify_code(PROMPT, "    return a + b\n", TESTS, "add", LIMITS) == 1.0
    assert verify_code(PROMPT, "    return a - b\n", TESTS, "add", LIMITS) == 0.0


def test_infinite_loop_is_killed_at_the_time_limit():
    result = run_python_sandboxed("while True:\n    pass\n", LIMITS)
    assert result.status == "timeout"
    assert result.duration_s < LIMITS.timeout_s + 5
    assert hostile("    while True:\n        pass\n") == 0.0


def test_fork_bombs_are_bounded_and_fully_reaped():
    assert hostile("    import os\n    while True:\n        os.fork()\n") == 0.0
    # ctypes goes around the Python-level guard: the kernel process cap must hold it.
    bomb = ("import ctypes\nlibc = ctypes.CDLL(None)\n"
            "while True:\n    libc.fork()\n")
    result = run_python_sandboxed(bomb, LIMITS)
    assert not result.passed
    assert result.uid is not None and sandbox_processes(result.uid) == []


def test_huge_allocation_fails_inside_the_memory_limit():
    result = run_python_sandboxed("x = bytearray(8 * 1024 ** 3)\nprint(len(x))\n", LIMITS)
    assert result.status == "failed"
    assert "MemoryError" in result.stderr
    assert hostile("    x = [0] * (4 * 1024 ** 3)\n    return a + b\n") == 0.0


@pytest.mark.parametrize("attack", [
    "import socket\ns = socket.create_connection(('93.184.216.34', 80), timeout=1)\n",
    "import _socket\ns = _socket.socket()\ns.settimeout(1)\ns.connect(('8.8.8.8', 53))\n",
])
def test_network_is_unreachable(attack):
    result = run_python_sandboxed(attack + "print('connected')\n", LIMITS)
    assert result.status == "failed"
    assert "connected" not in result.stdout


def test_writes_outside_the_scratch_dir_are_blocked_and_leave_no_trace():
    real_home = Path(os.path.expanduser("~"))
    marker = f"posttrain-sandbox-escape-{os.getpid()}"
    attacks = [
        f"open({str(real_home / marker)!r}, 'w').write('x')\n",
        f"import os\nfd = os.open({str(real_home / (marker + '-raw'))!r}, os.O_CREAT | os.O_WRONLY)\nos.write(fd, b'x')\n",
        f"import os\nfd = os.open('/tmp/{marker}', os.O_CREAT | os.O_WRONLY)\nos.write(fd, b'x')\n",
        f"import os\nfd = os.open({str(Path.cwd() / marker)!r}, os.O_CREAT | os.O_WRONLY)\nos.write(fd, b'x')\n",
    ]
    for attack in attacks:
        run_python_sandboxed(attack, LIMITS)
    leftovers = [p for p in (real_home / marker, real_home / (marker + "-raw"), Path("/tmp") / marker,
                             Path.cwd() / marker) if p.exists()]
    assert leftovers == []
    assert hostile(f"    open({str(real_home / marker)!r}, 'w').write('x')\n    return a + b\n") == 0.0
    assert not (real_home / marker).exists()


def test_scratch_dir_is_cwd_and_home_and_is_writable():
    program = ("import os\nopen('notes.txt', 'w').write('ok')\n"
               "assert open('notes.txt').read() == 'ok'\nassert os.environ['HOME'] == os.getcwd()\n")
    assert run_python_sandboxed(program, LIMITS).passed


def test_exiting_early_with_status_zero_does_not_pass():
    assert hostile("    import sys\n    sys.exit(0)\n") == 0.0
    assert run_python_sandboxed("import sys\nsys.exit(0)\nassert False\n", LIMITS).status == "failed"


def test_output_floods_are_capped():
    result = run_python_sandboxed("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", LIMITS)
    assert not result.passed
    assert len(result.stdout) <= 4000
