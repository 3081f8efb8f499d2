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
from tasks.train.rollout_engine import shared_weights_dir

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
    cfg.rl.rollout_engine.weight_sync = "stream"   # the weights in the request body (the default is shared memory)
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


def test_an_engine_sampling_ahead_stays_within_the_staleness_bound(wh):
    cfg = engine_config()
    cfg.rl.rollout_engine.max_staleness = 2          # one RL step (2 optimizer steps): one batch ahead
    assert cfg.rl.batches_ahead == 1
    sft_job = seeded_sft_job(wh, cfg)
    job = StageJob(stage="rl", home=str(wh.home), run_name="stale", profile="test", init_model=sft_job.init_model,
                   data_ref=str(wh.latest("rl_prompts")), config=cfg.model_dump(), fingerprint="stale")
    train_rl(StageHarness(job), reward_fn=lambda row, text, ids: 1.0 if ids and ids[0] % 2 == 0 else 0.0)
    curve = StageHarness(job).steps.records()
    # step s trains on the batch the engine sampled while step s-1 trained, with step s-1's weights
    assert [r["policy_staleness"] for r in curve] == [0.0, 2.0, 2.0, 2.0, 2.0]
    rollouts = wh.read("rl_rollouts")
    by_step = rollouts.group_by("step").agg(pl.col("staleness").unique(), pl.col("policy_version").unique()).sort("step")
    assert by_step["staleness"].to_list() == [[0], [2], [2], [2], [2]]
    assert by_step["policy_version"].to_list() == [[0], [0], [2], [4], [6]]
    assert rollouts["version_boundary"].null_count() == rollouts.height   # no partial rollouts asked for
    assert (rollouts["policy_version_last"] == rollouts["policy_version"]).all()
    # on a stale step the first update's ratio is the current policy over the sampler's: not 1
    assert all(abs(r["ratio_mean"] - 1.0) > 1e-4 for r in curve if r["policy_staleness"] > 0)
    # weights through shared memory: a push per step after the first, nothing written to disk, and
    # the stage's shared-memory snapshots gone with it
    assert [r["engine_syncs"] for r in curve] == list(range(STEPS))
    assert all(r["engine_sync_bytes"] > 0 for r in curve[1:])
    assert not list((job.stage_path / "engine_weights").glob("v*"))
    assert json.loads((job.stage_path / "engine.json").read_text())["weight_sync"] == "shm"
    assert not shared_weights_dir().exists()


def _push(server, state_blob: bytes, version: int) -> dict:
    response = httpx.post(f"{server.base_url}/weights/stream", params={"version": version}, content=state_blob,
                          timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_partial_rollout_goes_on_under_the_next_pushed_weights_and_says_where(tmp_path):
    from tasks.rollout.tiny_model import tiny_llama_path
    from tasks.train.checkpoint import _state_blob

    path = tiny_llama_path(home=tmp_path)
    model, _ = load_causal_lm(path)
    same = _state_blob(model)
    for p in model.parameters():   # the next update's weights: every value changed
        p.data.mul_(-1.0)
    changed = _state_blob(model)
    params = SamplingParams(n=4, temperature=1.0, max_tokens=6, seed=3)
    with ServerProcess(path, threads=1) as server:
        client = OpenAIBackend(OpenAIConfig(base_url=server.base_url))
        assert _push(server, same, 1)["bytes"] > 0
        whole = client.generate(["hello"], params, extra={"policy_version": 1})[0]
        assert {(c.policy_version, c.version_boundary) for c in whole} == {(1, None)}
        _push(server, changed, 2)   # stored; in force only where a request reaches for it
        partial = client.generate(["hello"], params, extra={"policy_version": 1, "continue_at": 3})[0]
        long = [(w, p) for w, p in zip(whole, partial) if len(p.token_ids) > 3]
        assert long, "no sample ran past the switch"
        for w, p in long:
            assert (p.policy_version, p.policy_version_last, p.version_boundary) == (1, 2, 3)
            # the first three tokens are the old weights' (the same draws as the whole rollout) ...
            assert p.token_ids[:3] == w.token_ids[:3] and p.logprobs[:3] == pytest.approx(w.logprobs[:3], abs=1e-6)
            # ... the fourth comes from the new weights' distribution
            assert abs(p.logprobs[3] - w.logprobs[3]) > 1e-3
        for p in partial:
            if len(p.token_ids) <= 3:
                assert (p.policy_version, p.version_boundary, p.last_version) == (1, None, 1)
        assert httpx.get(f"http://{server.host}:{server.port}/health").json()["policy_version"] == 2
        # a version already passed is refused, not sampled with the wrong weights
        old = httpx.post(f"{server.base_url}/completions", json={"prompt": "hi", "policy_version": 1}, timeout=60)
        assert old.status_code == 409 and "v2 is already in force" in old.json()["detail"]
        bad = httpx.post(f"{server.base_url}/completions", json={"prompt": "hi", "continue_at": 2}, timeout=60)
        assert bad.status_code == 422
        wrong = httpx.post(f"{server.base_url}/weights/stream", params={"version": 3}, content=b"not safetensors",
                           timeout=60)
        assert wrong.status_code == 400 and "streamed state dict (v3)" in wrong.json()["detail"]
        client.close()


def _parity(row, text, token_ids):
    return 1.0 if token_ids and token_ids[0] % 2 == 0 else 0.0


def test_an_engine_killed_while_sampling_ahead_comes_back_with_the_versions_it_owed(wh):
    """SIGKILL the engine of an asynchronous stage with partial rollouts after a batch was asked
    for ahead: the stage restarts it, sends it again every version an unfinished request needs,
    sends those requests again, and samples exactly what a run whose engine never died sampled."""
    cfg = engine_config()
    cfg.rl.rollout_engine.max_staleness = 2
    cfg.rl.rollout_engine.partial_rollout_tokens = 2
    sft_job = seeded_sft_job(wh, cfg)

    def job(name: str) -> StageJob:
        return StageJob(stage="rl", home=str(wh.home), run_name=name, profile="test", init_model=sft_job.init_model,
                        data_ref=str(wh.latest("rl_prompts")), config=cfg.model_dump(), fingerprint=name)

    train_rl(StageHarness(job("calm")), reward_fn=_parity)
    stage_path, killed = job("killed").stage_path, []

    def reward_killing_the_engine_once(row, text, token_ids):
        info = json.loads((stage_path / "engine.json").read_text())
        if info["policy_version"] == 4 and not killed:   # step 2 scores; batch 3 is asked for next
            os.kill(info["pid"], signal.SIGKILL)
            killed.append(info["pid"])
        return _parity(row, text, token_ids)

    train_rl(StageHarness(job("killed")), reward_fn=reward_killing_the_engine_once)
    info = json.loads((stage_path / "engine.json").read_text())
    assert killed and info["restarts"] == 1 and info["pid"] != killed[0]
    columns = ["step", "prompt_id", "sample_index", "token_ids", "reward", "policy_version", "policy_version_last",
               "version_boundary", "staleness"]
    rollouts = wh.read("rl_rollouts")
    calm, restarted = (rollouts.filter(pl.col("train_run") == run).select(columns).sort("step", "prompt_id",
                                                                                          "sample_index")
                       for run in ("calm", "killed"))
    assert calm.height > 0 and calm.equals(restarted)
    assert restarted["version_boundary"].is_not_null().any()
