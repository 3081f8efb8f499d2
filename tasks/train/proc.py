"""Processes a stage starts, and the locks that keep two of them off one directory.

- **Launchers die with the pipeline.** A launcher runs in a session of its own (so a stop
  reaches its ranks as one group), which also means a kill of the pipeline's process group
  misses it. So every launcher is tied to the process that started it: a parent-death
  signal (Linux ``prctl(PR_SET_PDEATHSIG)``, set by a tiny exec wrapper, so no code runs
  between fork and exec in a threaded pipeline), and each rank watches the pipeline's pid and
  leaves when it is gone (``launcher_entry.py``; it covers launchers that start ranks in
  sessions of their own and platforms without ``prctl``). Live launchers are also kept in a
  registry, so the CLI's SIGTERM / Ctrl-C handler stops them at once.
- **A stage's checkpoint directory is locked** (``flock`` on ``<stage dir>.lock``, beside the
  directory so a cleared directory keeps its lock). The launcher inherits the locked
  descriptor, so the directory stays locked while any process working on it lives. The lock
  file names its holder; a rerun that finds the lock held by a launcher whose pipeline is gone
  stops that launcher and then resumes; a live holder is an error.
- **One directory for compiled torch extensions** (``extensions_dir``): ``make setup``, a
  direct ``posttrain run``, the ranks and the benchmarks all load DeepSpeed's CPU comm op
  from it. Building or loading it takes an ``flock`` there, so a build lock torch left behind
  by a killed process (its ``lock`` file; torch waits on one forever) is found and removed,
  and an engine start that waits for another build says so and times out with a clear error.

This module imports only the standard library at load time: the exec wrapper, the ranks'
first lines and the Makefile use it before anything heavy is imported.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
OWNER_ENV = "POSTTRAIN_LAUNCH_OWNER"          # "<pid>:<start time>" of the process a launcher belongs to
BUILD_LOCK_TIMEOUT_ENV = "POSTTRAIN_BUILD_LOCK_TIMEOUT_S"
DEFAULT_BUILD_LOCK_TIMEOUT_S = 900.0        # a cold build of the comm op is ~80 s of gcc on 2 idle cores
BUILD_LOCK_NAME = "posttrain-build.lock"
TORCH_BATON = "lock"                         # torch.utils.cpp_extension's FileBaton in a build directory
_PR_SET_PDEATHSIG = 1


def _say(msg: str) -> None:
    print(f"posttrain: {msg}", file=sys.stderr, flush=True)


# -- the one directory of compiled extensions -------------------------------------------------
def extensions_dir() -> Path:
    """Where torch compiles and loads extensions (DeepSpeed's CPU comm op): ``$TORCH_EXTENSIONS_DIR``
    when set, else ``<repo>/.posttrain/torch_extensions``, the directory ``make setup`` builds into."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR", "").strip()
    return Path(env).expanduser().resolve() if env else REPO_ROOT / ".posttrain" / "torch_extensions"


def use_extensions_dir(env: dict[str, str] | os._Environ = os.environ) -> Path:
    """Set ``TORCH_EXTENSIONS_DIR`` in ``env`` to ``extensions_dir()`` (an empty value would make
    torch build into the working directory); the directory."""
    path = extensions_dir()
    env["TORCH_EXTENSIONS_DIR"] = str(path)
    return path


# -- processes --------------------------------------------------------------------------------
def process_start_time(pid: int) -> float | None:
    """When ``pid`` started (seconds since the epoch), or None if no such process: a pid with its
    start time names one process even after the pid is reused."""
    try:
        import psutil
        return round(psutil.Process(pid).create_time(), 2)
    except Exception:  # noqa: BLE001 - gone, or not ours to inspect
        return None


def process_alive(pid: int | None, started: float | None = None) -> bool:
    """``pid`` is a live process (and the one that started at ``started``, when given)."""
    if not pid or pid <= 0:
        return False
    try:
        import psutil
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return started is None or abs(round(proc.create_time(), 2) - started) < 0.05
    except Exception:  # noqa: BLE001 - psutil.NoSuchProcess / AccessDenied
        return False


def owner_token(pid: int | None = None) -> str:
    pid = pid or os.getpid()
    return f"{pid}:{process_start_time(pid) or 0}"


def _parse_token(token: str) -> tuple[int, float | None]:
    pid, _, started = token.partition(":")
    return int(pid), (float(started) or None) if started else None


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Ask Linux to send ``sig`` to this process when the thread that started it exits; False
    where there is no ``prctl`` (then the owner watch below is the only tie)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def watch_owner(token: str | None = None, interval_s: float = 0.5, on_gone=None) -> threading.Thread | None:
    """In a launcher-started process: end this process (SIGKILL to itself, by default) once the
    pipeline that started the launcher is gone. ``token`` defaults to ``$POSTTRAIN_LAUNCH_OWNER``;
    None when there is no owner to watch."""
    token = token or os.environ.get(OWNER_ENV)
    if not token:
        return None
    pid, started = _parse_token(token)

    def gone() -> None:
        _say(f"the pipeline that started this launcher (pid {pid}) is gone; pid {os.getpid()} exits")
        os.kill(os.getpid(), signal.SIGKILL)

    def watch() -> None:
        while process_alive(pid, started):
            time.sleep(interval_s)
        (on_gone or gone)()

    thread = threading.Thread(target=watch, name="posttrain-owner-watch", daemon=True)
    thread.start()
    return thread


# run as `python -I -S -c _TIE <owner pid> <signal> <command...>`: set the parent-death signal,
# give up if the owner died before that, then become the command (the setting survives exec)
_TIE = ("import ctypes, os, sys\n"
        "owner, sig = int(sys.argv[1]), int(sys.argv[2])\n"
        "try:\n"
        "    ctypes.CDLL(None).prctl(1, sig, 0, 0, 0)\n"
        "except (OSError, AttributeError):\n"
        "    pass\n"
        "if os.getppid() != owner:\n"
        "    sys.exit(f'posttrain: the process that started {sys.argv[3]} exited before it began')\n"
        "os.execvp(sys.argv[3], sys.argv[3:])\n")

_LIVE: dict[int, subprocess.Popen] = {}
_LIVE_LOCK = threading.RLock()   # re-entrant: a signal handler in the main thread may take it


def spawn_tied(cmd: list[str], *, death_signal: int = signal.SIGTERM, **popen_kwargs) -> subprocess.Popen:
    """``subprocess.Popen(cmd, start_new_session=True, ...)`` for a process that must not outlive
    this one: it gets ``death_signal`` when the calling thread exits (Linux), its descendants find
    this process in ``$POSTTRAIN_LAUNCH_OWNER``, and ``terminate_children`` reaches it. The calling
    thread must live as long as the child may (``execute_stage`` waits on it)."""
    env = dict(popen_kwargs.pop("env", None) or os.environ)
    env[OWNER_ENV] = owner_token()
    full = cmd
    if sys.platform.startswith("linux"):
        full = [sys.executable, "-I", "-S", "-c", _TIE, str(os.getpid()), str(int(death_signal)), *cmd]
    proc = subprocess.Popen(full, env=env, start_new_session=True, **popen_kwargs)
    with _LIVE_LOCK:
        _LIVE[proc.pid] = proc
    return proc


def forget(proc: subprocess.Popen) -> None:
    with _LIVE_LOCK:
        _LIVE.pop(proc.pid, None)


def live_children() -> list[subprocess.Popen]:
    with _LIVE_LOCK:
        procs = list(_LIVE.values())
    return [p for p in procs if p.poll() is None]


def signal_group(pid: int, sig: int) -> bool:
    """``sig`` to the process group ``pid`` leads (a launcher started in its own session); False
    if there is none."""
    try:
        os.killpg(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def terminate_children(sig: int = signal.SIGTERM) -> int:
    """Send ``sig`` to every live launcher this process started (their process groups), without
    waiting: safe in a signal handler. How many were signalled."""
    n = 0
    for proc in live_children():
        n += signal_group(proc.pid, sig)
    return n


def stop_process_group(proc: subprocess.Popen | int, grace_s: float = 10.0) -> None:
    """SIGTERM to the group ``proc`` leads, then SIGKILL after ``grace_s``. ``proc`` is a Popen
    (waited on) or the pid of a process that is not our child (polled)."""
    pid = proc if isinstance(proc, int) else proc.pid
    started = None if not isinstance(proc, int) else process_start_time(pid)

    def finished(wait: float | None) -> bool:
        if not isinstance(proc, int):
            try:
                proc.wait(timeout=wait)
                return True
            except subprocess.TimeoutExpired:
                return False
        deadline = time.time() + (wait if wait is not None else 30.0)
        while time.time() < deadline:
            if not process_alive(pid, started):
                return True
            time.sleep(0.05)
        return not process_alive(pid, started)

    if not isinstance(proc, int) and proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
        for s in (sig, signal.SIGCONT):   # a stopped (suspended) process acts on SIGTERM only once continued
            if not signal_group(pid, s):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, s)   # not a group leader (another launcher's doing): the process itself
        if finished(wait):
            return


def stop_children(grace_s: float = 5.0) -> None:
    """Stop every live launcher this process started (SIGTERM, then SIGKILL after ``grace_s``)."""
    for proc in live_children():
        stop_process_group(proc, grace_s)


def watch_signals(on_signal, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> bool:
    """Call ``on_signal(signum)`` from a thread as soon as one of ``signals`` arrives, whichever
    Python handler is installed then: a flow run swaps in Prefect's own SIGTERM handler, and
    the main thread may be blocked waiting for a stage thread that waits on its launcher, so a
    handler alone would never get to stop the launcher. Uses the interpreter's wakeup fd
    (written for every caught signal; a wakeup fd set before is still written to). Main thread
    only; False where it cannot be set."""
    if threading.current_thread() is not threading.main_thread():
        return False
    r, w = os.pipe()
    os.set_blocking(w, False)
    try:
        previous = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
    except (ValueError, OSError):
        os.close(r)
        os.close(w)
        return False
    wanted = {int(s) for s in signals}

    def pump() -> None:
        while True:
            data = os.read(r, 64)
            if not data:
                return
            if previous != -1:
                with contextlib.suppress(OSError):
                    os.write(previous, data)
            for signum in data:
                if signum in wanted:
                    on_signal(signum)

    threading.Thread(target=pump, name="posttrain-signal-watch", daemon=True).start()
    return True


# -- the stage directory's lock -----------------------------------------------------------------
class StageBusy(RuntimeError):
    """Another live run is training this stage in this checkpoint directory."""


def stage_lock_path(stage_path: Path) -> Path:
    return Path(stage_path).parent / f"{Path(stage_path).name}.lock"


def _read_holder(lock_path: Path) -> dict:
    try:
        return json.loads(lock_path.read_text() or "{}")
    except (OSError, ValueError):
        return {}


def job_processes(job_path: Path, exclude: set[int] | None = None) -> list[int]:
    """Pids of live processes running the launcher (or a rank) for ``job_path``: ``launcher_entry``,
    ``torchrun`` or ``deepspeed`` with ``--job <job_path>`` on their command line."""
    import psutil

    job = str(Path(job_path).resolve())
    exclude = (exclude or set()) | {os.getpid()}
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info.get("cmdline") or []
        if p.info["pid"] in exclude or "--job" not in cmd:
            continue
        try:
            arg = cmd[cmd.index("--job") + 1]
        except IndexError:
            continue
        if any("launcher_entry" in c for c in cmd) and str(Path(arg).resolve()) == job:
            found.append(p.info["pid"])
    return found


def stop_job_processes(job_path: Path, grace_s: float = 10.0) -> list[int]:
    """Stop every live process working on ``job_path`` (a launcher left by a dead pipeline, its
    ranks); their pids."""
    pids = job_processes(job_path)
    for pid in pids:
        stop_process_group(pid, grace_s)
    return pids


@dataclass
class StageLock:
    """The held lock of one stage's checkpoint directory (see ``stage_lock``)."""
    path: Path
    fd: int
    holder: dict = field(default_factory=dict)
    stopped: list[int] = field(default_factory=list)   # pids of stale launchers stopped to get it

    def record(self, **info) -> None:
        """Write who holds the lock (this process, and the launcher it started) into the lock file."""
        self.holder.update(info)
        data = json.dumps(self.holder).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)


@contextlib.contextmanager
def stage_lock(stage_path: Path, job_path: Path, fingerprint: str = "", timeout_s: float = 60.0,
               grace_s: float = 10.0) -> Iterator[StageLock]:
    """Hold ``<stage dir>.lock`` (``flock``) while a stage trains in ``stage_path``.

    The lock is free once every process holding it has exited (a killed pipeline and its
    launcher included), so it is never stale. If it is held:
    - by a live pipeline (the pid written in it): ``StageBusy``, at once;
    - by a launcher whose pipeline is gone (it inherited the lock): that launcher and its ranks
      are stopped, then the lock is taken.
    Once held, any process still running this stage's ``job.json`` (a launcher or rank left
    over, e.g. one started by older code without the lock) is stopped as well, so training
    resumes alone in the directory.
    """
    import fcntl

    lock_path = stage_lock_path(stage_path)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    os.set_inheritable(fd, False)
    stopped: list[int] = []
    deadline = time.time() + timeout_s
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            holder = _read_holder(lock_path)
            pid, started = holder.get("pid"), holder.get("pid_started")
            if pid and process_alive(pid, started):
                raise StageBusy(f"{stage_path} is in use: pid {pid} ({holder.get('command', '?')}) holds "
                                f"{lock_path} and is training stage job {holder.get('job', '?')}")
            launcher, lstarted = holder.get("launcher_pid"), holder.get("launcher_started")
            if launcher and process_alive(launcher, lstarted):
                _say(f"stopping launcher pid {launcher} left on {stage_path} by pipeline pid {pid}, which is gone")
                stop_process_group(launcher, grace_s)
                stopped.append(launcher)
            stopped.extend(stop_job_processes(job_path, grace_s))
            if time.time() > deadline:
                raise StageBusy(f"{stage_path}: {lock_path} is still held after {timeout_s:.0f} s by a process "
                                f"that is not a posttrain launcher of this stage (holder recorded: {holder or 'none'})")
            time.sleep(0.1)
        for other in stop_job_processes(job_path, grace_s):
            _say(f"stopped pid {other}, still running {job_path} without holding its lock")
            stopped.append(other)
        lock = StageLock(lock_path, fd, stopped=stopped)
        lock.record(pid=os.getpid(), pid_started=process_start_time(os.getpid()),
                    command=" ".join(sys.argv)[:300], job=str(job_path), fingerprint=fingerprint,
                    since=time.time())
        try:
            yield lock
        finally:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)
    finally:
        os.close(fd)   # releases the flock (a launcher still holding its inherited copy keeps it)


# -- the extension build lock -------------------------------------------------------------------
def _build_lock_timeout() -> float:
    try:
        return float(os.environ.get(BUILD_LOCK_TIMEOUT_ENV, DEFAULT_BUILD_LOCK_TIMEOUT_S))
    except ValueError:
        return DEFAULT_BUILD_LOCK_TIMEOUT_S


class BuildLockTimeout(TimeoutError):
    """An engine start waited too long for another process's build of a torch extension."""


def _working_in(directory: Path) -> list[int]:
    """Pids of live processes whose working directory is ``directory`` (torch runs ninja and the
    compiler there while it builds an extension)."""
    import psutil

    target = str(directory.resolve())
    pids = []
    for p in psutil.process_iter(["pid"]):
        with contextlib.suppress(psutil.Error):
            if p.cwd() == target:
                pids.append(p.info["pid"])
    return pids


def stale_batons(root: Path, min_age_s: float = 5.0) -> tuple[list[Path], list[Path]]:
    """Torch build locks (``<root>/<extension>/lock``): (stale ones, live ones). Called while
    holding the posttrain build lock, so no posttrain process is building; a baton is live only
    if a process (another tool's build) works in its directory, or it is younger than
    ``min_age_s`` (a build that is still writing its ninja file)."""
    stale, live = [], []
    if not root.is_dir():
        return stale, live
    for baton in sorted(root.glob(f"*/{TORCH_BATON}")):
        try:
            age = time.time() - baton.stat().st_mtime
        except FileNotFoundError:
            continue
        (live if age < min_age_s or _working_in(baton.parent) else stale).append(baton)
    return stale, live


@contextlib.contextmanager
def build_lock(root: Path | None = None, timeout_s: float | None = None, poll_s: float = 0.2,
               baton_min_age_s: float = 5.0) -> Iterator[Path]:
    """Hold the posttrain build lock of ``root`` (``extensions_dir()``) with every torch build lock
    in it free: stale ones (their builder dead) are removed, live ones waited for. Waiting says
    so on stderr and gives up after ``timeout_s`` with ``BuildLockTimeout``."""
    import fcntl

    root = Path(root) if root is not None else extensions_dir()
    timeout_s = _build_lock_timeout() if timeout_s is None else timeout_s
    root.mkdir(parents=True, exist_ok=True)
    lock_path = root / BUILD_LOCK_NAME
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    os.set_inheritable(fd, False)
    t0 = time.time()
    said = False
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(lock_path)
                why = f"{lock_path} is held by pid {holder.get('pid', '?')} ({holder.get('command', '?')})"
            else:
                stale, live = stale_batons(root, baton_min_age_s)
                for baton in stale:
                    _say(f"removing {baton}: a torch extension build lock whose builder is gone")
                    with contextlib.suppress(FileNotFoundError):
                        baton.unlink()
                if not live:
                    break
                fcntl.flock(fd, fcntl.LOCK_UN)   # let the other build finish meanwhile
                why = f"{live[0]} is held by a build in progress"
            waited = time.time() - t0
            if waited > timeout_s:
                raise BuildLockTimeout(
                    f"gave up after {waited:.0f} s waiting for a torch extension build lock: {why}. If no "
                    f"build is running, delete the lock; raise ${BUILD_LOCK_TIMEOUT_ENV} to wait longer")
            if not said:
                _say(f"waiting (up to {timeout_s:.0f} s) for DeepSpeed's comm op build: {why}")
                said = True
            time.sleep(poll_s)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "command": " ".join(sys.argv)[:300],
                                  "since": time.time()}).encode(), 0)
        yield root
    finally:
        os.close(fd)


def ensure_comm_op(timeout_s: float | None = None):
    """Build (first time) and load DeepSpeed's CPU shared-memory comm op from ``extensions_dir()``
    under the build lock; DeepSpeed's later load in ``deepspeed.initialize`` reuses the loaded op.
    The op module, or None where the accelerator has none."""
    root = use_extensions_dir()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    venv_bin = str(Path(sys.executable).parent)   # the venv's ninja: switching ninjas forces a rebuild
    if not os.environ.get("PATH", "").startswith(venv_bin):
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")
    with build_lock(root, timeout_s):
        from deepspeed.comm.torch import build_shm_op
        return build_shm_op()


def main(argv: list[str] | None = None) -> int:
    """``python tasks/train/proc.py extensions-dir | build-comm-op`` (the Makefile's entry)."""
    args = sys.argv[1:] if argv is None else argv
    if args == ["extensions-dir"]:
        print(extensions_dir())
        return 0
    if args == ["build-comm-op"]:
        sys.path.insert(0, str(REPO_ROOT))
        op = ensure_comm_op()
        print(f"DeepSpeed comm op in {extensions_dir()}" if op is not None else "no comm op for this accelerator")
        return 0 if op is not None or os.environ.get("DS_ACCELERATOR", "cpu") != "cpu" else 1
    print("usage: proc.py extensions-dir | build-comm-op", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
