"""A stage's launcher never outlives the pipeline that started it, a stage directory holds one
training at a time, and DeepSpeed's comm op build lock can neither hang an engine start
forever nor outlive its (dead) builder (issue #32, item 12)."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from test_train_engine import seeded_sft_job, small_config

from tasks.train import checkpoint, proc
from tasks.train.config import TrainConfig
from tasks.train.harness import StageJob

REPO = Path(__file__).resolve().parents[1]
ENTRY = REPO / "tasks" / "train" / "launcher_entry.py"
LONG = 5000          # steps: a stage that never finishes while a test kills things around it


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # not this process's rank settings (an in-process stage leaves them, and its port in use)
    for key in (proc.OWNER_ENV, "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _python(code: str, *args: str, **kwargs) -> subprocess.Popen:
    """A helper process (its own session, as a pipeline killed with its process group)."""
    kwargs.setdefault("env", _env())
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=str(REPO), start_new_session=True, **kwargs)


def _running(job_json: Path) -> list[int]:
    """Pids of live (non-zombie) processes with ``job_json`` on their command line."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        if p.info["status"] != psutil.STATUS_ZOMBIE and str(job_json) in " ".join(p.info["cmdline"] or []):
            out.append(p.info["pid"])
    return out


def _wait(predicate, timeout_s: float, what: str, poll_s: float = 0.05):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"not within {timeout_s} s: {what}")


def _gone_within(job_json: Path, timeout_s: float) -> float:
    """Seconds until no process runs ``job_json``; fails after ``timeout_s``."""
    t0 = time.time()
    _wait(lambda: not _running(job_json), timeout_s, f"every process of {job_json} exits")
    return time.time() - t0


def _training(stage: Path, records: int = 1) -> bool:
    return len(checkpoint.StepLog(stage, enabled=False).records()) >= records


def _kill_group(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
    p.wait(timeout=30)


def _kill_everything(p: subprocess.Popen, job_json: Path) -> None:
    """Cleanup: ``p``'s group and every process still running ``job_json``."""
    _kill_group(p)
    for pid in _running(job_json):
        os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def base_job(tmp_path_factory) -> StageJob:
    from warehouse import Warehouse

    home = tmp_path_factory.mktemp("lifecycle") / "home"
    home.mkdir()
    cfg = small_config()
    cfg.sft_short.checkpoint_every = 3
    return seeded_sft_job(Warehouse(home), cfg, stage_steps=LONG, run_name="base")


def _job(base: StageJob, name: str, steps: int = LONG, **engine) -> StageJob:
    cfg = TrainConfig(**base.config)
    cfg.sft_short.steps = steps
    for key, value in engine.items():
        setattr(cfg.engine, key, value)
    return dataclasses.replace(base, run_name=name, fingerprint=name, config=cfg.model_dump())


def _job_file(job: StageJob, tmp_path: Path) -> Path:
    path = tmp_path / f"{job.run_name}-in.json"
    job.save(path)
    return path


# -- launchers die with their pipeline -------------------------------------------------------
PIPELINE = """
import sys
from tasks.train.runner import StageJob, execute_stage
execute_stage(StageJob.load(sys.argv[1]))
"""


@pytest.mark.timeout(90)
def test_a_stage_launcher_dies_within_seconds_of_a_kill_9_of_its_pipeline(base_job, tmp_path):
    """The issue's case: the plain process launcher (as the tiny profile's judge stage runs), its
    pipeline's process group killed with -9. Killed as soon as the launcher runs, before it has
    imported anything: the parent-death signal leaves no window after the spawn (the torchrun
    test below kills mid-training)."""
    job = _job(base_job, "pdeath", launcher="process")
    stage, job_json = job.stage_path, job.stage_path / "job.json"
    pipeline = _python(PIPELINE, str(_job_file(job, tmp_path)))
    try:
        launchers = _wait(lambda: _running(job_json) or pipeline.poll() is not None, 60, "the launcher starts")
        assert pipeline.poll() is None, (stage / "launcher.log").read_text()[-3000:]
        assert all(psutil.Process(p).ppid() == pipeline.pid for p in launchers)
        assert all(os.getsid(p) == p for p in launchers)   # a session of its own: the group kill misses it
        os.killpg(pipeline.pid, signal.SIGKILL)   # the pipeline's whole process group, as in the issue
        pipeline.wait(timeout=30)
        took = _gone_within(job_json, 5)
    finally:
        _kill_everything(pipeline, job_json)
    print(f"launcher gone {took:.2f} s after its pipeline's kill -9")
    assert not checkpoint.is_done(stage)


@pytest.mark.timeout(150)
def test_torchrun_and_its_ranks_die_with_the_pipeline(base_job, tmp_path):
    """torchrun starts each rank in a session of its own: nothing but their own tie stops them."""
    job = _job(base_job, "pdeath-ranks", num_ranks=2, launcher="torchrun")
    stage, job_json = job.stage_path, job.stage_path / "job.json"
    pipeline = _python(PIPELINE, str(_job_file(job, tmp_path)))
    try:
        _wait(lambda: _training(stage) or pipeline.poll() is not None, 120, "the ranks train")
        assert pipeline.poll() is None, (stage / "launcher.log").read_text()[-3000:]
        ranks = [p for p in _running(job_json) if psutil.Process(p).environ().get("RANK") in ("0", "1")]
        assert len(ranks) == 2 and all(os.getsid(r) == r for r in ranks)   # sessions of their own
        os.killpg(pipeline.pid, signal.SIGKILL)
        pipeline.wait(timeout=30)
        took = _gone_within(job_json, 10)
    finally:
        _kill_everything(pipeline, job_json)
    print(f"torchrun and 2 ranks gone {took:.2f} s after the pipeline's kill -9")


@pytest.mark.timeout(60)
def test_a_rank_leaves_once_the_pipeline_is_gone_even_while_its_own_parent_lives(base_job, tmp_path):
    """The owner watch: a launcher between pipeline and rank (deepspeed's, or one that failed to
    pass the signal on) cannot keep a rank alive. Here the rank's parent is this test process,
    which lives on; its pipeline is a stand-in process, killed once the rank has tied itself to
    it (its watch thread runs: the rank's first lines, before torch is imported)."""
    job = _job(base_job, "watch", launcher="process")
    stage = job.stage_path
    stage.mkdir(parents=True, exist_ok=True)
    job.save(stage / "job.json")
    owner = subprocess.Popen(["sleep", "300"])
    env = {**_env(), proc.OWNER_ENV: proc.owner_token(owner.pid)}
    with open(stage / "launcher.log", "ab") as log:
        rank = subprocess.Popen([sys.executable, str(ENTRY), "--job", str(stage / "job.json")], cwd=str(REPO),
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait(lambda: rank.poll() is not None or psutil.Process(rank.pid).num_threads() > 1, 30,
              "the rank starts watching its pipeline")
        assert rank.poll() is None, (stage / "launcher.log").read_text()[-3000:]
        owner.kill()
        owner.wait()
        t0 = time.time()
        rc = rank.wait(timeout=5)
        took = time.time() - t0
    finally:
        owner.kill()
        if rank.poll() is None:
            os.killpg(rank.pid, signal.SIGKILL)
    assert rc == -signal.SIGKILL
    assert "is gone" in (stage / "launcher.log").read_text()
    print(f"rank left {took:.2f} s after its pipeline was killed")


SIGTERM_RUN = """
import sys
from prefect import flow, task
from flows import cli
from tasks.train.runner import StageJob, execute_stage

@task
def stage(job_file: str) -> dict:
    return execute_stage(StageJob.load(job_file))

@flow
def pipeline(job_file: str) -> dict:
    return stage.submit(job_file).result()   # in a worker thread, as `posttrain run` runs a stage

@cli.app.command("one-stage")
def one_stage(job_file: str):
    pipeline(job_file)

sys.argv = ["posttrain", "one-stage", sys.argv[1]]
cli.main()
"""


@pytest.mark.timeout(180)
def test_sigterm_ends_the_command_and_its_launcher_within_seconds(base_job, tmp_path):
    """Through the CLI's entry point, a flow running the stage in a worker thread as the pipeline
    does: today the temporary Prefect API stops but the command and its launcher never end."""
    job = _job(base_job, "sigterm", launcher="process")
    stage, job_json = job.stage_path, job.stage_path / "job.json"
    out = tmp_path / "cli.log"
    with open(out, "wb") as log:
        cli = _python(SIGTERM_RUN, str(_job_file(job, tmp_path)), stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait(lambda: _training(stage) or cli.poll() is not None, 150, "the stage trains")
        assert cli.poll() is None, out.read_text()[-3000:]
        assert _running(job_json)
        t0 = time.time()
        cli.send_signal(signal.SIGTERM)
        launcher_gone = _gone_within(job_json, 10)
        rc = cli.wait(timeout=30)
        took = time.time() - t0
    finally:
        _kill_everything(cli, job_json)
    print(f"SIGTERM: launcher gone after {launcher_gone:.2f} s, command exited {rc} after {took:.2f} s")
    assert rc == 143, out.read_text()[-3000:]
    assert took < 15, out.read_text()[-3000:]


# -- one training per stage directory ----------------------------------------------------------
UNTIED_PIPELINE = """
import json, subprocess, sys
from pathlib import Path
from tasks.train import proc   # the standard library only: this stand-in imports no torch

job_json, launcher_cmd = Path(sys.argv[1]), json.loads(sys.argv[2])
path = job_json.parent
with proc.stage_lock(path, job_json, "stale") as lock:
    # a launcher nothing ties to this process (one started by older code, or where there is no
    # parent-death signal): it inherits the stage lock and outlives this process
    with open(path / "launcher.log", "ab") as log:
        launcher = subprocess.Popen(launcher_cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    pass_fds=(lock.fd,))
    lock.record(launcher_pid=launcher.pid, launcher_started=proc.process_start_time(launcher.pid))
    launcher.wait()
"""


@pytest.mark.timeout(180)
def test_a_rerun_stops_the_launcher_a_dead_pipeline_left_on_the_stage_then_resumes(base_job, tmp_path,
                                                                                  monkeypatch, capfd):
    from tasks.train import runner
    from tasks.train.engine import launcher_command, subprocess_env

    job = _job(base_job, "stale")
    stage, job_json = job.stage_path, job.stage_path / "job.json"
    stage.mkdir(parents=True)
    job.save(job_json)
    old = _python(UNTIED_PIPELINE, str(job_json), json.dumps(launcher_command(job.train_config.engine, job_json)),
                  env=subprocess_env())
    try:
        _wait(lambda: (checkpoint.latest_step(stage) is not None and _training(stage, checkpoint.latest_step(stage) + 2))
              or old.poll() is not None, 120, "the first launcher checkpoints")
        assert old.poll() is None, (stage / "launcher.log").read_text()[-3000:]
        holder = json.loads(proc.stage_lock_path(stage).read_text())
        stale = holder["launcher_pid"]
        os.killpg(old.pid, signal.SIGKILL)
        old.wait(timeout=30)
        assert proc.process_alive(stale), "the untied launcher should outlive its pipeline here"
        # suspend the orphan, so that its progress is known when the rerun starts (a suspended
        # orphan must be stopped as well); the rerun trains a few steps past it
        os.killpg(stale, signal.SIGSTOP)
        steps = len(checkpoint.StepLog(stage, enabled=False).records()) + 6
        rerun = _job(base_job, "stale", steps=steps)

        def resume_alone(rerun_job):   # the stale launcher is gone before training resumes
            assert not proc.process_alive(stale) and not _running(job_json)
            return real(rerun_job)

        real = runner.run_stage_here
        monkeypatch.setattr(runner, "run_stage_here", resume_alone)
        t0 = time.time()
        result = runner.execute_stage(rerun)     # the rerun, in this process
        took = time.time() - t0
    finally:
        _kill_everything(old, job_json)
    assert f"stopping launcher pid {stale}" in capfd.readouterr().err
    curve = checkpoint.StepLog(stage, enabled=False).records()
    assert [r["step"] for r in curve] == list(range(steps))      # one training, no gap, no duplicate
    assert checkpoint.is_done(stage) and result["final_loss"] == curve[-1]["loss"]
    print(f"rerun stopped the orphan and resumed: {steps} steps, {took:.2f} s")


HOLD_STAGE = """
import sys, time
from pathlib import Path
from tasks.train import proc
stage = Path(sys.argv[1])
with proc.stage_lock(stage, stage / "job.json", "other"):
    print("held", flush=True)
    time.sleep(120)
"""


def test_a_stage_a_live_run_trains_is_refused_with_a_clear_error(base_job):
    from tasks.train.runner import execute_stage

    job = _job(base_job, "busy", steps=3)
    other = _python(HOLD_STAGE, str(job.stage_path), stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        t0 = time.time()
        with pytest.raises(proc.StageBusy, match=rf"pid {other.pid} .*holds"):
            execute_stage(job)
        assert time.time() - t0 < 5
        assert other.poll() is None   # a live run is never stopped
    finally:
        _kill_group(other)
    assert execute_stage(job)["steps"] == 3   # once it is gone the stage runs


def test_a_leftover_launcher_of_the_job_without_the_lock_is_stopped(tmp_path):
    """A launcher started by code that took no lock is still found, by its ``--job`` argument."""
    stage = tmp_path / "checkpoints" / "run" / "sft_short"
    stage.mkdir(parents=True)
    job_json = stage / "job.json"
    left = _python("import time; time.sleep(120)", str(ENTRY), "--job", str(job_json))
    unrelated = _python("import time; time.sleep(120)", str(ENTRY), "--job", str(tmp_path / "other.json"))
    try:
        _wait(lambda: _running(job_json), 10, "the leftover starts")
        with proc.stage_lock(stage, job_json, grace_s=5) as lock:
            assert lock.stopped == [left.pid] and left.wait(timeout=5) == -signal.SIGTERM
        assert unrelated.poll() is None
    finally:
        _kill_group(left)
        _kill_group(unrelated)


# -- the comm op's build lock ------------------------------------------------------------------
def _built_comm_op(root: Path) -> Path:
    """A copy of the built comm op (build outputs and ninja state) under ``root``."""
    src = proc.extensions_dir() / "deepspeed_shm_comm"
    if not (src / "deepspeed_shm_comm.so").exists():
        subprocess.run([sys.executable, str(REPO / "tasks" / "train" / "proc.py"), "build-comm-op"], env=_env(),
                       cwd=str(REPO), check=True, timeout=900)
    dst = root / "deepspeed_shm_comm"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("lock"))
    return dst


ENGINE_START = """
import torch
from tasks.train.config import EngineConfig, OptimizerConfig
from tasks.train.engine import create_engine
engine, _ = create_engine(torch.nn.Linear(4, 4), EngineConfig(zero_stage=0, precision="fp32", micro_batch_size=1),
                          OptimizerConfig(lr=1e-3), lr=1e-3, total_steps=1)
print("engine started", flush=True)
"""


@pytest.mark.timeout(150)
def test_an_engine_start_clears_a_build_lock_its_dead_builder_left(tmp_path):
    """The kill landed mid-build: torch's ``lock`` file stayed, and every later engine start slept
    on it forever. Now it is removed (no process builds there) and the engine starts."""
    build = _built_comm_op(tmp_path / "ext")
    baton = build / "lock"
    baton.touch()
    past = time.time() - 120
    os.utime(baton, (past, past))
    env = {**_env(), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    try:
        done = subprocess.run([sys.executable, "-c", ENGINE_START], env=env, cwd=str(REPO), capture_output=True,
                              text=True, timeout=120, check=False)
    except subprocess.TimeoutExpired as e:
        raise AssertionError("the engine start waited on the dead builder's lock") from e
    assert done.returncode == 0 and "engine started" in done.stdout, done.stderr[-3000:]
    assert f"removing {baton}" in done.stderr
    assert not baton.exists()


HOLD_BUILD = """
import sys, time
from pathlib import Path
from tasks.train import proc
with proc.build_lock(Path(sys.argv[1]), timeout_s=5):
    print("held", flush=True)
    time.sleep(120)
"""


def test_an_engine_start_waiting_on_a_live_build_says_so_and_times_out(tmp_path, monkeypatch, capfd):
    import torch

    from tasks.train.config import EngineConfig, OptimizerConfig
    from tasks.train.engine import create_engine

    root = tmp_path / "ext"
    builder = _python(HOLD_BUILD, str(root), stdout=subprocess.PIPE, text=True)
    for key, value in {"TORCH_EXTENSIONS_DIR": str(root), proc.BUILD_LOCK_TIMEOUT_ENV: "2", "RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999",
                       "PATH": os.environ["PATH"], "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}.items():
        monkeypatch.setenv(key, value)
    try:
        assert builder.stdout.readline().strip() == "held"
        t0 = time.time()
        with pytest.raises(proc.BuildLockTimeout, match=rf"gave up after \d+ s .*held by pid {builder.pid}"):
            create_engine(torch.nn.Linear(4, 4), EngineConfig(zero_stage=0, precision="fp32", micro_batch_size=1),
                          OptimizerConfig(lr=1e-3), lr=1e-3, total_steps=1)
        took = time.time() - t0
    finally:
        _kill_group(builder)
    assert 2 <= took < 6
    assert "waiting (up to 2 s) for DeepSpeed's comm op build" in capfd.readouterr().err


def test_a_torch_build_lock_is_live_while_a_process_builds_there_and_stale_after(tmp_path):
    """Another tool's build in progress (a process working in the build directory) is waited for,
    not broken; the same lock with nobody there is removed."""
    build = tmp_path / "ext" / "deepspeed_shm_comm"
    build.mkdir(parents=True)
    baton = build / "lock"
    baton.touch()
    past = time.time() - 120
    os.utime(baton, (past, past))
    compiler = subprocess.Popen(["sleep", "120"], cwd=str(build))
    try:
        with pytest.raises(proc.BuildLockTimeout, match="held by a build in progress"), \
                proc.build_lock(tmp_path / "ext", timeout_s=1):
            pass
        assert baton.exists()
    finally:
        compiler.kill()
        compiler.wait()
    with proc.build_lock(tmp_path / "ext", timeout_s=5):
        assert not baton.exists()


def test_every_entry_point_resolves_one_extensions_directory(monkeypatch):
    """The Makefile (``make setup`` builds there), a direct ``posttrain run`` and the ranks agree."""
    from tasks.train.engine import subprocess_env

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    default = proc.extensions_dir()
    assert default == REPO / ".posttrain" / "torch_extensions"
    assert subprocess_env()["TORCH_EXTENSIONS_DIR"] == str(default)
    make = subprocess.run(["make", "-s", "-p", "-n", "lint"], cwd=str(REPO), capture_output=True, text=True, check=False,
                          env={k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"})
    exported = [l for l in make.stdout.splitlines() if l.startswith("TORCH_EXTENSIONS_DIR ")]
    assert exported and exported[0].split("=", 1)[1].strip() == str(default)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "")   # empty: torch would build in the working directory
    assert subprocess_env()["TORCH_EXTENSIONS_DIR"] == str(default)
    assert "posttrain_torch_extensions" not in (REPO / "tasks" / "train" / "engine.py").read_text()
