"""Deployments: the full pipeline and every stage flow, served from this checkout by a worker.

``prefect.yaml`` at the repository root defines the deployments (entrypoints, parameters,
example schedules). ``served(...)`` makes them runnable:

1. a Prefect server: the one ``PREFECT_API_URL`` points at when it answers, else a local
   server started on 127.0.0.1 (``flows.services.start_prefect_server``);
2. a process work pool (created if missing);
3. ``prefect --no-prompt deploy`` from the repository root, so each deployment's pull step
   is "set the working directory to this checkout" (no git clone, works offline);
4. a ``prefect worker`` on the pool, whose flow runs use ``home`` as ``$POSTTRAIN_HOME``.

Everything it started is stopped by pid on exit: the worker with SIGINT (it ignores the
first SIGTERM for about 15 s), then the server.
"""
from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from flows.services import (
    Service,
    bin_path,
    free_port,
    record_prefect_server,
    release_prefect_server,
    running_prefect_server,
    start_prefect_server,
    start_process,
    using_prefect_server,
)
from warehouse import posttrain_home

REPO_ROOT = Path(__file__).resolve().parents[1]
PREFECT_FILE = REPO_ROOT / "prefect.yaml"
DEFAULT_POOL = "posttrain"
DEPLOY_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class DeploymentSpec:
    """One entry of ``prefect.yaml``'s ``deployments`` list."""

    name: str
    entrypoint: str
    parameters: dict[str, Any] = field(default_factory=dict)
    schedules: tuple[dict[str, Any], ...] = ()
    description: str = ""

    @property
    def flow_file(self) -> Path:
        return REPO_ROOT / self.entrypoint.partition(":")[0]

    @property
    def function(self) -> str:
        return self.entrypoint.partition(":")[2]


def deployment_specs(prefect_file: Path = PREFECT_FILE) -> list[DeploymentSpec]:
    data = yaml.safe_load(Path(prefect_file).read_text()) or {}
    out = []
    for i, d in enumerate(data.get("deployments") or []):
        if not d.get("name") or not d.get("entrypoint"):
            raise ValueError(f"{prefect_file}: deployments[{i}] needs a name and an entrypoint")
        out.append(DeploymentSpec(d["name"], d["entrypoint"], dict(d.get("parameters") or {}),
                                  tuple(d.get("schedules") or ()), d.get("description") or ""))
    return out


# -- the server ------------------------------------------------------------------------------------

def api_healthy(api_url: str | None, timeout_s: float = 3.0) -> bool:
    if not api_url:
        return False
    try:
        return httpx.get(f"{api_url.rstrip('/')}/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def ensure_prefect_server(home: str | os.PathLike | None, port: int) -> tuple[str, Service | None]:
    """(API URL, the server we started or None when an already running one was reused):
    ``PREFECT_API_URL`` when it answers, else the server another ``ui``/``serve`` started for
    this home, else a new one (recorded for the next)."""
    existing = os.environ.get("PREFECT_API_URL")
    if api_healthy(existing):
        return existing.rstrip("/"), None
    running = running_prefect_server(home)
    if running:
        return f"{running}/api", None
    server = start_prefect_server(port, str(home) if home else None)
    try:
        server.wait_healthy()
    except BaseException:
        server.stop()
        raise
    record_prefect_server(home, server)
    return f"{server.url}/api", server


@contextmanager
def prefect_api(api_url: str) -> Iterator[None]:
    """Point this process's Prefect client at ``api_url`` (its settings were read at import)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings
    with temporary_settings({PREFECT_API_URL: api_url}):
        yield


def ensure_work_pool(api_url: str, pool: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    with prefect_api(api_url), get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
        except ObjectAlreadyExists:
            existing = client.read_work_pool(pool)
            if existing.type != "process":
                raise ValueError(f"work pool {pool!r} exists with type {existing.type!r}, not 'process'") from None


# -- deploying -------------------------------------------------------------------------------------

def _child_env(api_url: str, home: str | os.PathLike | None, pool: str | None = None) -> dict[str, str]:
    env = {**os.environ, "PREFECT_API_URL": api_url, "POSTTRAIN_HOME": str(posttrain_home(home))}
    if pool:
        env["PREFECT_DEFAULT_WORK_POOL_NAME"] = pool
    return env


def deploy(api_url: str, pool: str, names: list[str] | None = None, home: str | os.PathLike | None = None,
           prefect_file: Path = PREFECT_FILE) -> list[str]:
    """Create or update the deployments ``names`` (all by default); returns ``flow/deployment`` names."""
    specs = deployment_specs(prefect_file)
    known = {s.name: s for s in specs}
    unknown = [n for n in names or [] if n not in known]
    if unknown:
        raise ValueError(f"unknown deployment(s) {unknown}; {prefect_file.name} defines {sorted(known)}")
    chosen = [known[n] for n in names] if names else specs
    missing = [f"{s.name} ({s.entrypoint})" for s in chosen if not s.flow_file.exists()]
    if missing:
        raise FileNotFoundError(f"deployment entrypoint file(s) missing: {', '.join(missing)}")
    cmd = [bin_path("prefect"), "--no-prompt", "deploy", "--prefect-file", str(prefect_file)]
    for s in chosen:
        cmd += ["--name", s.name]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=_child_env(api_url, home, pool), capture_output=True,
                          text=True, timeout=DEPLOY_TIMEOUT_S, check=False)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"`prefect deploy` failed with exit code {proc.returncode}:\n{tail}")
    return deployed_names(api_url, [s.name for s in chosen])


def deployed_names(api_url: str, deployment_names: list[str]) -> list[str]:
    """``flow_name/deployment_name`` of the named deployments as the server knows them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    with prefect_api(api_url), get_client(sync_client=True) as client:
        deployments = client.read_deployments(
            deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=deployment_names)))
        flows = {d.flow_id: client.read_flow(d.flow_id).name for d in deployments}
        return sorted(f"{flows[d.flow_id]}/{d.name}" for d in deployments)


# -- the worker ------------------------------------------------------------------------------------

def start_worker(api_url: str, pool: str, home: str | os.PathLike | None, poll_seconds: float = 3.0) -> Service:
    """A process worker on ``pool``; its flow runs inherit ``home`` as $POSTTRAIN_HOME.

    ``poll_seconds``: how often it asks the server for scheduled runs (Prefect's default is
    10 s; a local worker can afford to ask more often and start runs sooner).
    """
    home_path = posttrain_home(home)
    port = free_port()
    env = _child_env(api_url, home)
    env.setdefault("PREFECT_WORKER_QUERY_SECONDS", str(poll_seconds))
    env["PREFECT_WORKER_WEBSERVER_HOST"] = "127.0.0.1"
    env["PREFECT_WORKER_WEBSERVER_PORT"] = str(port)
    cmd = [bin_path("prefect"), "worker", "start", "--pool", pool, "--type", "process", "--with-healthcheck"]
    proc, log = start_process(f"prefect-worker-{pool}", cmd, env, home_path / "logs")
    url = f"http://127.0.0.1:{port}"
    return Service("prefect-worker", url, f"{url}/health", proc, log)


def wait_worker_online(api_url: str, pool: str, worker: Service, timeout_s: float = 90.0) -> None:
    """Wait until the pool lists an online worker (it has polled the server at least once)."""
    from prefect.client.orchestration import get_client

    deadline = time.time() + timeout_s
    with prefect_api(api_url), get_client(sync_client=True) as client:
        while time.time() < deadline:
            if worker.proc.poll() is not None:
                tail = worker.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"worker exited with code {worker.proc.returncode}; log tail:\n{tail}")
            if any(str(w.status).upper().endswith("ONLINE") for w in client.read_workers_for_work_pool(pool)):
                return
            time.sleep(0.5)
    raise TimeoutError(f"no worker online in pool {pool!r} after {timeout_s:.0f}s (log: {worker.log_path})")


# -- all together ----------------------------------------------------------------------------------

@dataclass
class Served:
    api_url: str
    ui_url: str
    pool: str
    deployments: list[str]
    server: Service | None      # None: an already running server was reused
    worker: Service | None


@contextmanager
def served(home: str | os.PathLike | None = None, port: int = 4200, pool: str = DEFAULT_POOL,
           deployments: list[str] | None = None, worker: bool = True) -> Iterator[Served]:
    """Server (started or reused), work pool, deployments and a worker, stopped on exit (the
    server only when no other command depends on it: ``release_prefect_server``)."""
    using = using_prefect_server(home, "posttrain serve")
    using.__enter__()
    try:
        api_url, server = ensure_prefect_server(home, port)
    except BaseException:
        using.__exit__(None, None, None)
        raise
    worker_service = None
    try:
        ensure_work_pool(api_url, pool)
        names = deploy(api_url, pool, deployments, home)
        if worker:
            worker_service = start_worker(api_url, pool, home)
            worker_service.wait_healthy()
            wait_worker_online(api_url, pool, worker_service)
        yield Served(api_url, api_url.removesuffix("/api"), pool, names, server, worker_service)
    finally:
        if worker_service is not None:
            worker_service.stop()
        using.__exit__(None, None, None)
        release_prefect_server(home, server, lambda line: print(line, flush=True))


SERVER_CHECK_S = 2.0      # how often `serve` checks that its Prefect server still answers
SERVER_GONE_S = 6.0       # and how long it may not answer before `serve` exits with an error


def serve(home: str | os.PathLike | None = None, port: int = 4200, pool: str = DEFAULT_POOL,
          deployments: list[str] | None = None, duration: float = 0.0, on_ready=None) -> None:
    """Serve the deployments until Ctrl-C (or for ``duration`` seconds when it is > 0).

    ``on_ready(served)`` is called once everything is up (the CLI prints the URLs there).
    """
    with served(home, port, pool, deployments) as handle:
        if on_ready is not None:
            on_ready(handle)
        deadline = time.time() + duration if duration > 0 else None
        unhealthy_since: float | None = None
        next_check = time.time() + SERVER_CHECK_S
        try:
            while deadline is None or time.time() < deadline:
                if handle.worker is not None and handle.worker.proc.poll() is not None:
                    raise RuntimeError(f"the worker stopped (exit code {handle.worker.proc.returncode}); "
                                       f"log: {handle.worker.log_path}")
                if time.time() >= next_check:   # a server another command started can go away under us
                    next_check = time.time() + SERVER_CHECK_S
                    if api_healthy(handle.api_url):
                        unhealthy_since = None
                    elif unhealthy_since is None:
                        unhealthy_since = time.time()
                    elif time.time() - unhealthy_since >= SERVER_GONE_S:
                        who = "this command" if handle.server is not None else "another command (`posttrain ui`)"
                        raise RuntimeError(f"the Prefect server at {handle.ui_url}, started by {who}, is gone: the "
                                           "worker has no API to take runs from; start `posttrain serve` again")
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass


def run_deployment_and_wait(api_url: str, name: str, parameters: dict[str, Any] | None = None,
                            timeout_s: float = 300.0):
    """Trigger ``flow/deployment`` through the API and wait for its final state; returns the flow run."""
    from prefect.deployments import run_deployment

    with prefect_api(api_url):
        return run_deployment(name, parameters=parameters or {}, timeout=timeout_s, poll_interval=1)
