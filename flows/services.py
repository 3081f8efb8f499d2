"""Local services started by the CLI: the Prefect server and the MLflow UI on 127.0.0.1.

Each is a child process in its own process group, stopped by pid (SIGINT, then SIGTERM,
then SIGKILL) when the caller is done. A Prefect server started for a home is recorded in
``$POSTTRAIN_HOME/prefect/server.json`` (URL, pid, home): ``posttrain ui`` and ``posttrain
serve`` reuse a live one instead of starting a second server on the same database, and CLI
commands run their flows on it. The MLflow UI ``posttrain ui`` starts is recorded in
``$POSTTRAIN_HOME/mlflow-ui.json``, so links to MLflow runs use the port that serves the home.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from tasks.tracking import ensure_store, relocate_store
from warehouse import posttrain_home


def free_port(preferred: int | None = None) -> int:
    if preferred:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", preferred)) != 0:
                return preferred
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Service:
    name: str
    url: str
    health_url: str
    proc: subprocess.Popen
    log_path: Path

    def wait_healthy(self, timeout_s: float = 90.0) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}; log tail:\n{tail}")
            try:
                if httpx.get(self.health_url, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not healthy at {self.health_url} after {timeout_s:.0f}s (log: {self.log_path})")

    def stop(self, grace_s: float = 20.0) -> None:
        if self.proc.poll() is not None:
            return
        for sig, wait in ((signal.SIGINT, grace_s), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


def bin_path(name: str) -> str:
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def start_process(name: str, cmd: list[str], env: dict[str, str], log_dir: Path) -> tuple[subprocess.Popen, Path]:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"{name}.log"
    with open(log_path, "ab") as fh:   # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, log_path


def start_prefect_server(port: int = 4200, home: str | None = None) -> Service:
    home_path = posttrain_home(home)
    port = free_port(port)
    # the UI's own API address: Prefect derives it from its port *setting*, not from --port, so a
    # server on any port but 4200 would serve a UI that cannot reach its API
    env = {**os.environ, "PREFECT_HOME": os.environ.get("PREFECT_HOME", str(home_path / "prefect")),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_API_URL": f"http://127.0.0.1:{port}/api"}
    env.pop("PREFECT_API_URL", None)
    proc, log = start_process("prefect-server", [bin_path("prefect"), "server", "start", "--host", "127.0.0.1",
                                          "--port", str(port)], env, home_path / "logs")
    url = f"http://127.0.0.1:{port}"
    return Service("prefect", url, f"{url}/api/health", proc, log)


# where a server started for a home is recorded, and the path its health answers on
_RECORDS = {"prefect": (Path("prefect") / "server.json", "/api/health"),
            "mlflow": (Path("mlflow-ui.json"), "/health")}


def _server_record(home: str | os.PathLike | None, kind: str = "prefect") -> Path:
    return posttrain_home(home) / _RECORDS[kind][0]


def running_server(home: str | os.PathLike | None, kind: str) -> str | None:
    """The URL of a live server of ``kind`` (``prefect``, ``mlflow``) recorded for this home, else
    None (a stale record is removed, and so is one copied from another home: that server runs on
    the other home's database)."""
    record = _server_record(home, kind)
    try:
        data = json.loads(record.read_text())
        if data.get("home", str(posttrain_home(home))) != str(posttrain_home(home)):
            raise ValueError("recorded for another home")
        os.kill(int(data["pid"]), 0)  # the recorded process still exists
        if httpx.get(f"{data['url']}{_RECORDS[kind][1]}", timeout=3.0).status_code == 200:
            return str(data["url"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, httpx.HTTPError):
        pass
    record.unlink(missing_ok=True)
    return None


def running_prefect_server(home: str | os.PathLike | None) -> str | None:
    """The URL of a live Prefect server recorded for this home, else None."""
    return running_server(home, "prefect")


def running_mlflow_ui(home: str | os.PathLike | None) -> str | None:
    """The URL of a live MLflow UI ``posttrain ui`` started for this home, else None."""
    return running_server(home, "mlflow")


def record_server(home: str | os.PathLike | None, service: Service, kind: str = "prefect") -> None:
    """Note a server this process started (and waited healthy) so others on the home reuse it
    (Prefect) or link to it (the MLflow UI)."""
    record = _server_record(home, kind)
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({"url": service.url, "pid": service.proc.pid, "home": str(posttrain_home(home)),
                                  "owner": os.getpid()}))


def record_prefect_server(home: str | os.PathLike | None, service: Service) -> None:
    record_server(home, service, "prefect")


# -- who depends on a home's Prefect server --------------------------------------------------------
# `ui` and `serve` each note themselves in prefect/users/<pid> while they run: the command that
# started the server leaves it running while another depends on it, and the last one out stops a
# server whose starter is gone.

def _users_dir(home: str | os.PathLike | None) -> Path:
    return posttrain_home(home) / "prefect" / "users"


@contextmanager
def using_prefect_server(home: str | os.PathLike | None, command: str) -> Iterator[None]:
    """This process depends on the home's Prefect server while inside."""
    from tasks.train.proc import process_start_time

    users = _users_dir(home)
    users.mkdir(parents=True, exist_ok=True)
    mine = users / str(os.getpid())
    mine.write_text(json.dumps({"command": command, "started": process_start_time(os.getpid())}))
    try:
        yield
    finally:
        mine.unlink(missing_ok=True)


def other_users(home: str | os.PathLike | None) -> list[str]:
    """The other live commands that depend on the home's Prefect server (``posttrain serve (pid
    N)``); records of processes that are gone are removed."""
    from tasks.train.proc import process_alive

    out = []
    users = _users_dir(home)
    for path in sorted(users.glob("*")) if users.exists() else []:
        try:
            pid, data = int(path.name), json.loads(path.read_text())
        except (ValueError, OSError):
            path.unlink(missing_ok=True)
            continue
        if pid == os.getpid():
            continue
        if process_alive(pid, data.get("started")):
            out.append(f"{data.get('command', 'a command')} (pid {pid})")
        else:
            path.unlink(missing_ok=True)
    return out


def release_prefect_server(home: str | os.PathLike | None, own: Service | None, log) -> None:
    """On the way out of ``ui`` / ``serve``: stop the server this command started unless another
    command depends on it (then it is left running, and said so); a command that reused a server
    whose starter has gone stops it when no one else depends on it."""
    from tasks.train.proc import process_alive

    others = other_users(home)
    if others:
        if own is not None:
            log(f"leaving the Prefect server {own.url} running: {', '.join(others)} depends on it")
        return
    if own is not None:
        own.stop()
        _server_record(home).unlink(missing_ok=True)
        return
    record = _server_record(home)
    try:
        data = json.loads(record.read_text())
    except (OSError, ValueError):
        return
    if data.get("home", str(posttrain_home(home))) != str(posttrain_home(home)) or \
            process_alive(data.get("owner")) or not process_alive(data.get("pid")):
        return
    log(f"stopping the Prefect server {data['url']}: its starter has exited and nothing else depends on it")
    for sig, wait in ((signal.SIGINT, 20.0), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(int(data["pid"]), sig)
        except (ProcessLookupError, PermissionError):
            break
        deadline = time.time() + wait
        while time.time() < deadline and process_alive(int(data["pid"])):
            time.sleep(0.2)
        if not process_alive(int(data["pid"])):
            break
    record.unlink(missing_ok=True)


def start_mlflow_ui(port: int = 5000, home: str | None = None, tracking_uri: str | None = None) -> Service:
    home_path = posttrain_home(home)
    port = free_port(port)
    store = tracking_uri or f"sqlite:///{home_path / 'mlflow.db'}"
    relocate_store(store)   # a copied home's UI shows (and serves) its own artifacts
    ensure_store(store)     # created here, under the store's lock, not by the server beside a running command
    artifacts = home_path / "artifacts" / "mlflow"
    artifacts.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    cmd = [bin_path("mlflow"), "server", "--backend-store-uri", store, "--default-artifact-root", artifacts.as_uri(),
           "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]
    proc, log = start_process("mlflow-ui", cmd, env, home_path / "logs")
    url = f"http://127.0.0.1:{port}"
    return Service("mlflow", url, f"{url}/health", proc, log)
