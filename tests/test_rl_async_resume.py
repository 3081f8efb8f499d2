"""Asynchronous RL with partial rollouts, killed with SIGKILL mid-stage and run again: the stage
resumes from its checkpoint with the same data position and the same policy versions, and its
rollouts, curve and final weights equal an uninterrupted run's (a real serve-model engine, a
real DeepSpeed engine in a launcher-started process)."""
from pathlib import Path

import polars as pl
import pytest
import torch
from rl_kill_reward import KILL_AFTER_STEP
from safetensors.torch import load_file
from test_rollout_engine import engine_config
from test_train_engine import seeded_sft_job

from tasks.train import checkpoint
from tasks.train.harness import StageJob
from tasks.train.runner import execute_stage

STEPS = 6
COMPARED = ["step", "prompt_id", "sample_index", "token_ids", "logprob_sum", "reward", "policy_version",
            "policy_version_last", "version_boundary", "staleness"]


def async_config():
    cfg = engine_config()
    cfg.engine.launcher = "process"
    cfg.rl.steps, cfg.rl.checkpoint_every = STEPS, 2
    cfg.rl.dynamic_sampling, cfg.rl.max_sampling_rounds = True, 2   # a second round queues behind the batch ahead
    cfg.rl.rollout_engine.max_staleness = 2            # updates_per_batch 2: one batch sampled ahead
    cfg.rl.rollout_engine.partial_rollout_tokens = 2   # of max_tokens 3: the third token under the next weights
    return cfg


def _job(wh, sft_job, cfg, run_name: str) -> StageJob:
    return StageJob(stage="rl", home=str(wh.home), run_name=run_name, profile="test", init_model=sft_job.init_model,
                    data_ref=str(wh.latest("rl_prompts")), config=cfg.model_dump(), fingerprint=run_name,
                    extra={"reward_fn": f"{Path(__file__).parent / 'rl_kill_reward.py'}:parity_killed_once"})


def _final_weights(job: StageJob) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(checkpoint.final_dir(job.stage_path).glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def test_async_rl_killed_and_resumed_equals_an_uninterrupted_run(wh, monkeypatch):
    cfg = async_config()
    sft_job = seeded_sft_job(wh, cfg)
    whole = _job(wh, sft_job, cfg, "whole")
    execute_stage(whole, timeout_s=600)

    killed = _job(wh, sft_job, cfg, "killed")
    monkeypatch.setenv("POSTTRAIN_TEST_KILL_STAGE", str(killed.stage_path))
    with pytest.raises(RuntimeError, match="launcher exited with -9"):
        execute_stage(killed, timeout_s=600)
    assert (killed.stage_path / "killed").exists() and not checkpoint.is_done(killed.stage_path)
    assert checkpoint.latest_step(killed.stage_path) == KILL_AFTER_STEP
    execute_stage(killed, timeout_s=600)   # the marker is there: this run is not killed

    rollouts = wh.read("rl_rollouts")
    a, b = (rollouts.filter(pl.col("train_run") == run).select(COMPARED).sort("step", "prompt_id", "sample_index")
            for run in ("whole", "killed"))
    assert a.height == b.height > 0 and sorted(set(b["step"])) == list(range(STEPS))
    assert a.equals(b)
    # the asynchronous schedule itself: each step after the first trains on the batch sampled
    # while the step before it trained, and its partial rollouts' third tokens came from the
    # weights the step trains with
    first = a.filter(pl.col("step") >= 1, pl.col("version_boundary").is_null().not_())
    assert first.height > 0 and set(first["version_boundary"]) == {2}
    assert (first["policy_version_last"] == first["policy_version"] + first["staleness"]).all()
    # the first round of every later step was sampled ahead; a second (dynamic sampling) round is
    # sampled when the step needs it, with the weights it trains with
    rounds = rollouts.filter(pl.col("train_run") == "whole", pl.col("step") >= 1).with_columns(
        round=pl.col("rollout_id").str.split(":").list.get(3).cast(pl.Int64))
    assert (rounds.filter(pl.col("round") == 0)["staleness"] > 0).all()
    assert (rounds.filter(pl.col("round") > 0)["staleness"] == 0).all()

    curve_a, curve_b = (checkpoint.StepLog(j.stage_path, enabled=False).records() for j in (whole, killed))
    assert [r["step"] for r in curve_b] == list(range(STEPS))
    assert [(r["loss"], r["policy_staleness"], r["partial_rollouts"]) for r in curve_a] == \
           [(r["loss"], r["policy_staleness"], r["partial_rollouts"]) for r in curve_b]
    wa, wb = _final_weights(whole), _final_weights(killed)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
