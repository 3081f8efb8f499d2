"""Running a stage: in this process for one rank, or through the launcher for several.

The stage's recipe comes from the stage registry (``data_specs.stages``); the recipe
modules import the harness, never this module, so nothing imports back in a circle.
"""
from __future__ import annotations

import importlib

from data_specs.stages import train_stage
from tasks.train import checkpoint, proc
from tasks.train.config import EngineConfig
from tasks.train.engine import run_launcher, stop_launcher
from tasks.train.harness import StageHarness, StageJob

__all__ = ["RECIPES", "StageHarness", "StageJob", "execute_stage", "run_stage_here"]

# recipe (data_specs.stages.TrainStage.recipe) -> "module:function" training one stage
RECIPES = {"sft": "tasks.train.sft:train_sft", "dpo": "tasks.train.dpo:train_dpo", "rl": "tasks.train.rl:train_rl",
           "agent": "tasks.train.agent:train_agent"}


def run_stage_here(job: StageJob) -> dict:
    """Run the stage in this process as whatever rank the environment says (1 if none)."""
    module, _, function = RECIPES[train_stage(job.stage).recipe].partition(":")
    return getattr(importlib.import_module(module), function)(StageHarness(job))


def _check_rl_ranks(job: StageJob, engine_cfg: EngineConfig) -> None:
    """Several RL ranks: rank 0 samples and every rank trains on its share of the groups. With
    the in-process sampler rank 0 samples with its own copy of the weights, which ZeRO-3 shards."""
    if train_stage(job.stage).recipe != "rl" or engine_cfg.num_ranks == 1:
        return
    sampler = job.train_config.stage(job.stage).rollout_engine.kind
    if sampler == "inprocess" and engine_cfg.zero_stage == 3:
        raise ValueError(f"RL on {engine_cfg.num_ranks} ranks under ZeRO-3 needs a rollout engine "
                         "(rl.rollout_engine.kind: serve-model): rank 0 cannot sample alone from sharded weights")


def execute_stage(job: StageJob, engine_cfg: EngineConfig | None = None, timeout_s: float | None = None) -> dict:
    """Run a stage: in process for one rank, else through the launcher; return its summary.

    The stage directory is locked meanwhile (``proc.stage_lock``): a launcher a dead pipeline
    left on it is stopped first, and a live run training it is an error (``proc.StageBusy``).
    The launcher inherits the lock and dies with this process."""
    engine_cfg = engine_cfg or job.train_config.engine_for(job.stage)
    path = job.stage_path
    path.mkdir(parents=True, exist_ok=True)
    with proc.stage_lock(path, path / "job.json", job.fingerprint) as lock:
        job.save(path / "job.json")
        if engine_cfg.launcher == "inprocess":
            return run_stage_here(job)
        _check_rl_ranks(job, engine_cfg)
        log_path = path / "launcher.log"
        launcher = run_launcher(engine_cfg, path / "job.json", log_path, pass_fds=(lock.fd,))
        lock.record(launcher_pid=launcher.pid, launcher_started=proc.process_start_time(launcher.pid))
        try:
            rc = launcher.wait(timeout=timeout_s)
        except BaseException:
            # interrupted or timed out: stop the ranks (a later run resumes from their last checkpoint)
            stop_launcher(launcher)
            raise
        finally:
            proc.forget(launcher)
    if rc != 0 or not checkpoint.is_done(path):
        tail = log_path.read_text(errors="replace")[-4000:] if log_path.exists() else ""
        raise RuntimeError(f"stage {job.stage}: launcher exited with {rc}; log {log_path}:\n{tail}")
    return checkpoint.read_done(path)
