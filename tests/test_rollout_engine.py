"""The RL stage with a separate rollout engine (a real ``serve-model`` process) fed the trainer's
weights: versions in every response, a dead engine restarted with the weights it had."""
import json
import os
import signal

import httpx
import polars as pl
import pytest
from test_train_engine import seeded_sft_job

from model.loading import load_causal_lm
from tasks.rollout.base import SamplingParams
from tasks.rollout.config import OpenAIConfig
from tasks.rollout.openai_client import OpenAIBackend
from tasks.rollout.server import ServerProcess
from tasks.train.config import TrainConfig
from tasks.train.harness import StageHarness, StageJob
from tasks.train.rl import train_rl

STEPS = 5


def test_served_model_swaps_weights_between_batches_and_reports_the_version(tmp_path):
    from tasks.rollout.tiny_model import tiny_llama_path

    path = tiny_llama_path(home=tmp_path)
    model, tokenizer = load_causal_lm(path)
    for p in model.parameters():   # other weights: the same shapes, every value changed
        p.data.mul_(-1.0)
    changed = tmp_path / "changed"
    model.save_pretrained(changed)
    tokenizer.save_pretrained(changed)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=4, seed=0)
    with ServerProcess(path, threads=1) as server:
        client = OpenAIBackend(OpenAIConfig(base_url=server.base_url))
        before = client.generate(["hello"], params)[0]
        assert {c.policy_version for c in before} == {0}
        swap = httpx.post(f"{server.base_url}/weights", json={"path": str(changed), "version": 7}, timeout=60)
        assert swap.status_code == 200 and swap.json()["policy_version"] == 7
        after = client.generate(["hello"], params)[0]
        assert {c.policy_version for c in after} == {7}
        assert [c.token_ids for c in after] != [c.token_ids for c in before]   # greedy: new weights, new text
        bad = httpx.post(f"{server.base_url}/weights", json={"path": str(tmp_path / "nowhere"), "version": 8})
        assert bad.status_code == 400 and "nowhere" in bad.json()["detail"]
        assert httpx.get(f"http://{server.host}:{server.port}/health").json()["policy_version"] == 7
        client.close()


def engine_config() -> TrainConfig:
    return TrainConfig(
        seed=0,
        base_model={"kind": "hybrid", "name": "test-base", "tokenizer_texts": 200},
        optimizer={"lr": 1e-2},
        engine={"zero_stage": 2, "precision": "fp32", "micro_batch_size": 2},
        rl={"steps": STEPS, "checkpoint_every": 100, "prompts_per_step": 4, "group_size": 4, "updates_per_batch": 2,
            "windows": [{"max_tokens": 3, "eps_high": 0.2, "gradient_clipping": 1.0}],
            "curriculum": [{"start_step": 0, "domains": {"logic": 1.0}}], "dynamic_sampling": False,
            "repetition_window": None, "max_sampling_rounds": 1,
            "rollout_engine": {"kind": "serve-model", "max_staleness": 0, "threads": 1, "restarts": 1}})


def test_rl_samples_from_an_engine_fed_each_update_and_survives_its_death(wh):
    cfg = engine_config()
    sft_job = seeded_sft_job(wh, cfg)
    job = StageJob(stage="rl", home=str(wh.home), run_name="engine", profile="test", init_model=sft_job.init_model,
                   data_ref=str(wh.latest("rl_prompts")), config=cfg.model_dump(), fingerprint="engine")
    stage_path = job.stage_path
    killed = []

    def reward_killing_the_engine_once(row, text, token_ids):
        info = json.loads((stage_path / "engine.json").read_text())
        if info["policy_version"] == 4 and not killed:   # third step's sampling done: kill the engine
            os.kill(info["pid"], signal.SIGKILL)
            killed.append(info["pid"])
        return 1.0 if token_ids and token_ids[0] % 2 == 0 else 0.0

    train_rl(StageHarness(job), reward_fn=reward_killing_the_engine_once)
    curve = StageHarness(job).steps.records()
    rollouts = wh.read("rl_rollouts")
    versions = rollouts.group_by("step").agg(pl.col("policy_version").unique()).sort("step")
    # each step sampled with the weights of every update before it (2 optimizer steps per RL step)
    assert versions["policy_version"].to_list() == [[2 * s] for s in range(STEPS)]
    assert set(rollouts["staleness"]) == {0} and set(rollouts["backend"]) == {"serve-model"}
    assert [r["engine_syncs"] for r in curve] == list(range(STEPS))          # a push before steps 1..4
    assert all(r["policy_staleness"] == 0.0 for r in curve)
    # the engine died after step 2's sampling; step 3 went to a restarted one holding v4, then v6
    info = json.loads((stage_path / "engine.json").read_text())
    assert killed and info["pid"] != killed[0] and info["restarts"] == 1 and info["policy_version"] == 8
    with pytest.raises(ProcessLookupError):
        os.kill(info["pid"], 0)   # the stage stopped its engine


def test_a_lagging_engine_is_bounded_and_its_own_logprobs_are_the_behaviour_policy(wh):
    cfg = engine_config()
    cfg.rl.rollout_engine.max_staleness = 2          # one RL step (2 optimizer steps) behind at most
    sft_job = seeded_sft_job(wh, cfg)
    job = StageJob(stage="rl", home=str(wh.home), run_name="stale", profile="test", init_model=sft_job.init_model,
                   data_ref=str(wh.latest("rl_prompts")), config=cfg.model_dump(), fingerprint="stale")
    train_rl(StageHarness(job), reward_fn=lambda row, text, ids: 1.0 if ids and ids[0] % 2 == 0 else 0.0)
    curve = StageHarness(job).steps.records()
    assert [r["policy_staleness"] for r in curve] == [0.0, 2.0, 0.0, 2.0, 0.0]   # pushed when it would exceed 2
    rollouts = wh.read("rl_rollouts")
    by_step = rollouts.group_by("step").agg(pl.col("staleness").first(), pl.col("policy_version").first()).sort("step")
    assert by_step["staleness"].to_list() == [0, 2, 0, 2, 0]
    assert by_step["policy_version"].to_list() == [0, 0, 4, 4, 8]
    # on a stale step the first update's ratio is the current policy over the sampler's: not 1
    assert all(abs(r["ratio_mean"] - 1.0) > 1e-4 for r in curve if r["policy_staleness"] > 0)
